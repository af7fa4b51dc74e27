# hpc_train signal relay. Slurm sends some signals to this batch shell only (--signal=B:, scancel
# --batch, preemption under preempt_send_user_signal); untrapped, USR2 or TERM would kill bash and the
# job before any rank saves, and a trap cannot run while srun runs in the foreground. So srun runs in
# the background and this shell relays both signals to it as USR2, which srun forwards to every task.
# TERM goes on as USR2 because srun (22.05, _srun_signal_mgr) answers its own SIGTERM with SIGKILL to
# every task. The ranks then read the USR2 by the clock (job.py stop_reason): near the time limit a
# "time_limit" (a site's --signal=B:TERM@lead), else a "preempt" (someone asked a live job to stop), with
# signal_lead_s to save; when Slurm itself ends the job it TERMs the tasks and srun directly as well.
srun() {
  command srun "$@" &
  local pid=$! status
  trap "kill -USR2 $pid 2>/dev/null" USR2
  trap "kill -USR2 $pid 2>/dev/null && echo 'hpc_train relay: batch shell got SIGTERM; sent SIGUSR2 to srun (srun would turn TERM into SIGKILL for every task)' >&2" TERM
  while true; do
    wait "$pid"
    status=$?
    kill -0 "$pid" 2>/dev/null || break  # wait returned for a trapped signal: srun still runs
  done
  return "$status"
}
