# hpc_train signal relay. Slurm sends some signals to this batch shell only (--signal=B:, scancel
# --batch, preemption under preempt_send_user_signal); untrapped, USR2 or TERM would kill bash and the
# job before any rank saves, and a trap cannot run while srun runs in the foreground. So srun runs in
# the background and this shell relays both signals to it as USR2, which srun forwards to every task.
# TERM goes on as USR2 because srun (22.05, _srun_signal_mgr) answers its own SIGTERM with SIGKILL to
# every task. The ranks then read the USR2 by the clock (job.py stop_reason): near the time limit a
# "time_limit" (a site's --signal=B:TERM@lead), else a "preempt" (someone asked a live job to stop), with
# signal_lead_s to save; when Slurm itself ends the job it TERMs the tasks and srun directly as well.
# In-job restarts (cluster.spare_nodes): the deciding rank writes FOLDER/.relaunch-JOBID (FOLDER: srun's
# last word, sbatch.entry_command) holding the next step's srun options; each is read once and removed
# before the relaunch, so a crash loop ends within requeue.max_in_job_restarts. A signal that came while
# that step ended goes to the relaunched one as HPC_TRAIN_PENDING_SIGNAL, with the time it came
# in Unix seconds: SIGUSR2@1700000000, read by preempt.install_handlers.
# A rank that never exits (SIGSTOP, D state) would hold the step, and this shell, until the time limit;
# so would a task an in-process restart took for dead once the run finished (FOLDER/.finished-JOBID).
# Once the marker or that file is there (looked for every 5 s; on NFS up to acdirmax, 60 s, later) the step gets
# HPC_TRAIN_STEP_END_S (90 s: the verdict goes on record right after the marker, and the ranks that did
# not decide, polling for it every 0.5 s in failure.after_failure, then exit), then srun a TERM, which it
# turns into SIGKILL for every task (a stopped one too); then HPC_TRAIN_STEP_KILL_S (120 s: twice the
# default UnkillableStepTimeout of 60 s that slurmstepd gives a D-state task) before SIGKILL to srun
# itself, whose shepherd then has slurmctld kill the step, and the relaunch goes on.
# A job submitted from a rank of a spares job inherits its HPC_TRAIN_STEP_ARGS (sbatch --export=ALL), not this job:
# only the line the renderer writes after this one, for a job with spares, sets it.
unset HPC_TRAIN_STEP_ARGS
srun() {
  local marker="${!#}/.relaunch-${SLURM_JOB_ID}" step="${HPC_TRAIN_STEP_ARGS:-}" pending="" now="" pid="" status watch
  # Single-quoted: each trap reads $pid when it fires, so a signal during a launch reaches no stale pid
  # and stays pending (sent to the step once it runs). A pending signal keeps the time of the first,
  # in whole Unix seconds: the relaunched step judges and times its stop from when it came.
  # printf's %(%s)T, not EPOCHSECONDS: bash 4.4 (RHEL 8) has none, and SIGUSR2@0 would read as "now"
  # `|| true` last: under a site template's set -e a failed kill (srun reaped, $pid not yet cleared) ends the shell
  trap '[ -n "${pending:-}" ] || printf -v pending "SIGUSR2@%(%s)T" -1; [ -z "${pid:-}" ] || kill -USR2 "$pid" 2>/dev/null || true' USR2
  trap '[ -n "${pending:-}" ] || printf -v pending "SIGUSR2@%(%s)T" -1; [ -z "${pid:-}" ] || { kill -USR2 "$pid" 2>/dev/null && echo "hpc_train relay: batch shell got SIGTERM; sent SIGUSR2 to srun, which would turn TERM into SIGKILL for every task" >&2; } || true' TERM
  [ -z "$step" ] || rm -f "$marker" "${!#}/.finished-${SLURM_JOB_ID}"  # a requeued job's leftovers: never act on them
  while true; do
    now="$pending" pending="" pid=""
    # With spares --no-kill (the job's too, sbatch.executor_parameters): a failed node's tasks die, not the step's;
    # --kill-on-bad-exit=0: a site's KillOnBadExit=1 would kill every task at the first one to die, the deciding one too
    HPC_TRAIN_PENDING_SIGNAL="$now" command srun ${step:+--no-kill --kill-on-bad-exit=0} $step "$@" &
    pid=$!
    [ -z "$pending" ] || kill -USR2 "$pid" 2>/dev/null || true  # caught between the steps, after $now was read
    watch=""
    [ -z "$step" ] || { _hpc_train_watch "$pid" "$marker" "${!#}/.finished-${SLURM_JOB_ID}" "${!#}/.relay-${SLURM_JOB_ID}" & watch=$!; }
    while true; do
      wait "$pid" && status=0 || status=$?  # not a bare wait: under set -e in a site template its 145 would end this shell
      kill -0 "$pid" 2>/dev/null || break  # wait returned for a trapped signal: srun still runs
    done
    [ -z "$watch" ] || { kill "$watch" 2>/dev/null; wait "$watch" 2>/dev/null; rm -f "${!#}/.relay-${SLURM_JOB_ID}".??????; } || true
    [ -n "$step" ] || return "$status"  # no hot spares: as before, srun's status is the job's
    rm -f "${!#}/.relay-${SLURM_JOB_ID}"  # a relaunch writes it anew at once; a decision read it while the step ran
    # A listing first: on NFS this shell's negative lookup of the marker (the rm above) may be cached for
    # acdirmax (60 s) after another node wrote it; reading the folder revalidates it (close-to-open).
    [ "$status" = 0 ] || ls -a "${!#}" >/dev/null 2>&1 || true
    # cluster.in_process_restart: the ranks finished the run (job._run_function wrote the file) in a step where a task
    # that an in-process restart replaced died (SIGKILL: srun's status 137): the job completed.
    if [ -f "${!#}/.finished-${SLURM_JOB_ID}" ] && [ ! -L "${!#}/.finished-${SLURM_JOB_ID}" ] && [ -O "${!#}/.finished-${SLURM_JOB_ID}" ]; then
      rm -f "${!#}/.finished-${SLURM_JOB_ID}" "$marker"
      return 0
    fi
    [ -s "$marker" ] || return "$status"
    # Its words become srun options: only a plain file of this user, only the options relaunch.relaunch writes
    # (a group-writable folder must not let a teammate add --task-prolog or --export to the step of this user).
    step=""
    if [ -L "$marker" ] || [ ! -O "$marker" ]; then
      echo "hpc_train relay: $marker is not a plain file owned by this user; not relaunching on it" >&2
    else
      IFS= read -r step < "$marker" || true
      [[ "$step" =~ ^--nodes=[0-9]+\ --ntasks=[0-9]+(\ --exclude=[A-Za-z0-9._,-]+)?$ ]] || {
        echo "hpc_train relay: $marker holds other than the srun options hpc_train writes; not relaunching on it" >&2
        step=""
      }
    fi
    rm -f "$marker"
    [ -n "$step" ] || return "$status"
    echo "hpc_train relay: training step ended with status $status; relaunching it inside the allocation: srun $step" >&2
  done
}
# While the step runs it also writes the time (Unix s) into FOLDER/.relay-JOBID every 5 s: a deciding rank that
# finds it older than 30 s (deadlines.RELAY_SILENT_S) takes this shell's node for lost and requeues instead of
# writing a marker nobody would read.
_hpc_train_watch() {  # srun's pid, the marker, the finished file, the beat file: end a step that outlives either
  local pid="$1" marker="$2" finished="$3" beat="$4" why="its relaunch marker" i
  while kill -0 "$pid" 2>/dev/null && [ ! -e "$marker" ] && [ ! -e "$finished" ]; do
    # mktemp: a new file of ours (O_EXCL), never through a name a teammate planted in a group-writable folder;
    # printf's %(%s)T, not EPOCHSECONDS: bash 4.4 (RHEL 8) has no EPOCHSECONDS and would write 0, read as silent
    { i=$(mktemp "$beat.XXXXXX") && { printf '%(%s)T\n' -1 > "$i" && mv -f "$i" "$beat" || rm -f "$i"; }; } >/dev/null 2>&1 || true
    sleep 5 >/dev/null 2>&1  # no pipe held
  done
  [ -e "$marker" ] || why="its run's finish (${finished##*/})"
  for i in $(seq "${HPC_TRAIN_STEP_END_S:-90}"); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1 >/dev/null 2>&1; done
  echo "hpc_train relay: the training step did not end within ${HPC_TRAIN_STEP_END_S:-90} s of $why; sent srun SIGTERM, which kills every task" >&2
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq "${HPC_TRAIN_STEP_KILL_S:-120}"); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1 >/dev/null 2>&1; done
  echo "hpc_train relay: srun still runs ${HPC_TRAIN_STEP_KILL_S:-120} s after SIGTERM, a task stuck in D state?; sent srun SIGKILL, so Slurm kills the step" >&2
  kill -KILL "$pid" 2>/dev/null || true
}
