# Run every rank inside an Apptainer/Singularity image; needs template_vars.image (the .sif path).
# Pair with cluster.launcher=[apptainer,exec,--nv,<the .sif path>] so srun starts python in the image.
# Template variables are substituted shell-quoted: use them as whole words, never inside "...".
module load apptainer 2>/dev/null || true
export APPTAINERENV_PYTHONUNBUFFERED=1
test -r $image || { echo hpc_train: cannot read the container image $image >&2; exit 1; }
