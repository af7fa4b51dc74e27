# hpc_train signal relay. Slurm sends some signals to this batch shell only (--signal=B:, scancel
# --batch, preemption under preempt_send_user_signal); untrapped, USR2 or TERM would kill bash and the
# job before any rank saves, and a trap cannot run while srun runs in the foreground. So srun runs in
# the background and this shell relays both signals to it; srun forwards them to every task.
srun() {
  command srun "$@" &
  local pid=$! status
  trap "kill -USR2 $pid 2>/dev/null" USR2
  trap "kill -TERM $pid 2>/dev/null" TERM
  while true; do
    wait "$pid"
    status=$?
    kill -0 "$pid" 2>/dev/null || break  # wait returned for a trapped signal: srun still runs
  done
  return "$status"
}
