#!/usr/bin/env bash
# The GPU path, end to end, on one GPU of a machine that may have no internet (docs/gpu.md): <= 8 min.
#
#     bash benchmarks/gpu_wheels.sh                  # first, where pip reaches an index: wheels/
#     bash benchmarks/gpu_check.sh OUT               # on the GPU machine (or OUT=... bash benchmarks/gpu_check.sh)
#     bash benchmarks/gpu_check.sh --dry OUT         # every step on CPU, tiny models: a syntax/import check
#
# Steps (each under its own timeout; a failed step is recorded in OUT/steps.txt and the next one runs):
#   install   hpc_train and its dependencies from wheels/ with --no-index into a venv that sees the
#             machine's torch (--system-site-packages); skipped when they import already
#   versions  python, torch, CUDA, NCCL, driver                        -> OUT/versions.json
#   smi       nvidia-smi --query-gpu (the preflight's fields), -q, the peak table's answer for the name
#   mfu       gpu_mfu.py on model=1b, FSDP2 bf16, eager then compiled -> OUT/mfu_eager/, OUT/mfu_compile/
#   resume    gpu_resume.py: SIGTERM after the first checkpoint, resume, against an uninterrupted run;
#             its first attempt's preflight event (matmul >= 100 ms by CUDA events, counters, XIDs)
#                                                                     -> OUT/resume/, OUT/resume/preflight.json
# Everything goes under OUT; the runs' checkpoints go to a scratch folder and are deleted.
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
if [ "${1:-}" = "--dry" ]; then dry=1; shift; fi
out=${1:-${OUT:-}}
[ -n "$out" ] || { echo "usage: bash benchmarks/gpu_check.sh [--dry] OUT (or set OUT)" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && python=.venv/bin/python
scratch=$(mktemp -d /tmp/gpu_check.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
started=$(date +%s)
: >"$out/steps.txt"

step() {  # step NAME TIMEOUT_S COMMAND...: runs it, its output in OUT/NAME.log, its verdict in OUT/steps.txt
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  echo "== $name (<= ${limit} s)"
  timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
  rc=$?
  tail -n 5 "$out/$name.log"
  echo "$name rc=$rc $(($(date +%s) - t0))s" | tee -a "$out/steps.txt"
}

# install: only what does not import already (torch is the machine's own and is never installed). Every
# wheel of the folder with --no-deps: pip then never resolves torch's own requirements (torch 2.13 asks for
# setuptools>=77, which an offline venv lacks). --system-site-packages sees a system torch; a .pth file
# also sees one installed in a venv or conda.
if ! "$python" -c "import submitit, hydra, omegaconf, rich" 2>/dev/null; then
  step install 60 bash -c "
    set -e
    torch_site=\$('$python' -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
    '$python' -m venv --system-site-packages '$scratch/venv'
    venv_site=\$('$scratch/venv/bin/python' -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')
    echo \"\$torch_site\" > \"\$venv_site/_machine_torch.pth\"
    PIP_CONFIG_FILE=/dev/null '$scratch/venv/bin/pip' install --quiet --no-index --no-deps wheels/*.whl
    cd /  # not this tree's hpc_train: the installed one
    '$scratch/venv/bin/python' -c 'import torch, submitit, hydra, omegaconf, rich, numpy, hpc_train; print(hpc_train.__file__)'
    # the wheel must hold this tree's code, or the check would test an older copy
    diff -rq --exclude=__pycache__ '$PWD/hpc_train' \"\$venv_site/hpc_train\" | grep -v 'Only in .*venv' \
      && { echo 'wheels/hpc_train-*.whl is not this tree: run bash benchmarks/gpu_wheels.sh again'; exit 1; } || true"
  python=$scratch/venv/bin/python
else
  echo "install skipped: the dependencies import already" | tee -a "$out/steps.txt"
fi
export PATH="$(dirname "$python"):$PATH"

step versions 30 "$python" - "$out/versions.json" <<'EOF'
import json, platform, subprocess, sys
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info.update(gpu=torch.cuda.get_device_name(), gpus=torch.cuda.device_count(),
                nccl=".".join(map(str, torch.cuda.nccl.version())), capability=torch.cuda.get_device_capability())
for mod in ("submitit", "hydra", "omegaconf", "numpy", "hpc_train"):
    try:
        info[mod] = __import__(mod).__version__
    except Exception as e:
        info[mod] = f"not importable: {e}"
try:
    info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=10).stdout.strip()
except (OSError, subprocess.TimeoutExpired) as e:
    info["driver"] = f"no nvidia-smi: {e}"
print(json.dumps(info, indent=1))
open(sys.argv[1], "w").write(json.dumps(info, indent=1) + "\n")
EOF

if [ $dry = 0 ]; then
  step smi 30 bash -c "
    nvidia-smi --query-gpu=index,name,ecc.errors.uncorrected.volatile.total,retired_pages.pending,remapped_rows.pending,remapped_rows.failure,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv > '$out/nvidia_smi.csv'
    nvidia-smi -q > '$out/nvidia_smi_q.txt'
    cat '$out/nvidia_smi.csv'
    '$python' -c 'from hpc_train.metrics import peak_tflops; import subprocess; n = subprocess.run([\"nvidia-smi\", \"--query-gpu=name\", \"--format=csv,noheader\"], capture_output=True, text=True).stdout.splitlines()[0]; print(repr(n), \"peak bf16 TFLOP/s:\", peak_tflops(n))'
    journalctl -k -q --no-pager --since=-24h -g 'NVRM: Xid' | tail -n 20 || echo 'journalctl -k: not readable here'"
  step mfu_eager 120 "$python" benchmarks/gpu_mfu.py --steps 30 --out "$out/mfu_eager"
  step mfu_compile 150 "$python" benchmarks/gpu_mfu.py --steps 30 --compile --out "$out/mfu_compile"
  step resume 90 "$python" benchmarks/gpu_resume.py --out "$out/resume"
else
  step mfu_eager 120 "$python" benchmarks/gpu_mfu.py --cpu --steps 4 --batch 2 --out "$out/mfu_eager"
  step mfu_compile 180 "$python" benchmarks/gpu_mfu.py --cpu --steps 4 --batch 2 --compile --out "$out/mfu_compile"
  step resume 240 "$python" benchmarks/gpu_resume.py --cpu --steps 8 --out "$out/resume"
fi
echo "total $(($(date +%s) - started))s" | tee -a "$out/steps.txt"
! grep -v " rc=0 " "$out/steps.txt" | grep -q " rc="
