# hpc_train: the training step runs under hpc_train/relay.py, this job's supervisor. It takes the stop signals
# Slurm sends the batch shell only (--signal=B:, scancel --batch), passes them to srun as USR2 once srun can
# take them, and with hot spares relaunches the step inside the allocation (its docstring says how).
# A job submitted from a rank of a job inherits its environment (sbatch --export=ALL), not this job's: only the
# line the renderer writes below, for a job with spares, sets HPC_TRAIN_STEP_ARGS.
unset HPC_TRAIN_STEP_ARGS HPC_TRAIN_PENDING_SIGNAL
# A stop signal before the step runs (the setup below, a module load) is recorded with the time it came, for the
# step (preempt.install_handlers reads it): bash's default for USR2 and TERM would end the job unsaved.
trap '[ -n "${HPC_TRAIN_PENDING_SIGNAL:-}" ] || printf -v HPC_TRAIN_PENDING_SIGNAL "SIGUSR2@%(%s)T" -1' USR2 TERM
# The training step's srun, defined last in the setup: an srun of the site template or of cluster.setup (a
# staging step) runs Slurm's own and returns, where this one execs the relay and the job ends with it.
srun() {
  # Ignored, not trapped, until relay.py's handlers are in (~25 ms: -S, no site imports; a signal then is
  # lost): exec keeps an ignored signal ignored, while a trapped one would be back at its default there.
  trap '' USR2 TERM
  [ -x $python ] || { echo "hpc_train: $python, the python that submitted this job, is not on $(hostname)" >&2; exit 1; }
  HPC_TRAIN_PENDING_SIGNAL="${HPC_TRAIN_PENDING_SIGNAL:-}" exec $python -S -u $relay $step_end_s $step_kill_s $beat_s "$@"
}
