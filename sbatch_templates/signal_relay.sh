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
# that step ended goes to the relaunched one as HPC_TRAIN_PENDING_SIGNAL (preempt.install_handlers).
srun() {
  local marker="${!#}/.relaunch-${SLURM_JOB_ID}" step="${HPC_TRAIN_STEP_ARGS:-}" pending="" now="" pid="" status
  # Single-quoted: each trap reads $pid when it fires, so a signal during a launch reaches no stale pid
  # and stays pending (sent to the step once it runs).
  trap 'pending=SIGUSR2; [ -z "${pid:-}" ] || kill -USR2 "$pid" 2>/dev/null' USR2
  trap 'pending=SIGUSR2; [ -z "${pid:-}" ] || { kill -USR2 "$pid" 2>/dev/null && echo "hpc_train relay: batch shell got SIGTERM; sent SIGUSR2 to srun, which would turn TERM into SIGKILL for every task" >&2; }' TERM
  [ -z "$step" ] || rm -f "$marker"  # a requeued job's leftover from its last allocation: never relaunch on it
  while true; do
    now="$pending" pending="" pid=""
    HPC_TRAIN_PENDING_SIGNAL="$now" command srun $step "$@" &
    pid=$!
    [ -z "$pending" ] || kill -USR2 "$pid" 2>/dev/null || true  # caught between the steps, after $now was read
    while true; do
      wait "$pid"
      status=$?
      kill -0 "$pid" 2>/dev/null || break  # wait returned for a trapped signal: srun still runs
    done
    [ -n "$step" ] || return "$status"  # no hot spares: as before, srun's status is the job's
    # A listing first: on NFS this shell's negative lookup of the marker (the rm above) may be cached for
    # acdirmax (60 s) after another node wrote it; reading the folder revalidates it (close-to-open).
    [ "$status" = 0 ] || ls -a "${!#}" >/dev/null 2>&1 || true
    [ -s "$marker" ] || return "$status"
    step=$(cat "$marker")
    rm -f "$marker"
    echo "hpc_train relay: training step ended with status $status; relaunching it inside the allocation: srun $step" >&2
  done
}
