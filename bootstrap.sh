#!/usr/bin/env bash
# Installs what hpc_train needs, idempotently (a second run takes seconds), on Debian 12 as root:
#   ./bootstrap.sh           python3-venv if missing, .venv, torch (pinned CPU-capable wheel), hpc_train[dev,wandb,mlflow,frameworks]
#   ./bootstrap.sh --slurm   the same, plus Debian's slurm-wlm, munge, slurmdbd, mariadb-server and g++
#                            for the test cluster of tests/cluster.py
set -euo pipefail
cd "$(dirname "$0")"

need_apt=()
python3 -c "import venv, ensurepip" 2>/dev/null || need_apt+=(python3-venv python3-pip)
if [ "${1:-}" = "--slurm" ]; then
  for pkg in slurm-wlm munge slurmdbd mariadb-server g++; do  # g++: torch.compile's CPU parity test
    dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
  done
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: apt-get install ${need_apt[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need_apt[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# A fresh venv's pip (23.x) can crash on some packages' metadata: upgrade it first.
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# torch first and pinned: an unpinned `torch>=2.4` would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[dev,wandb,mlflow,frameworks]'
echo "bootstrap: ready ($(.venv/bin/python -c 'import torch, submitit, hydra; print("torch", torch.__version__, "submitit", submitit.__version__, "hydra", hydra.__version__)'))"
