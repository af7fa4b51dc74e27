#!/usr/bin/env bash
# Every wheel the job side needs except torch, in one folder, for a GPU machine without internet access
# that has torch already (docs/gpu.md). Run it where pip reaches an index; carry the folder over.
#
#     bash benchmarks/gpu_wheels.sh                 # -> wheels/ (about 25 MB; git ignores it)
#     bash benchmarks/gpu_wheels.sh DIR             # elsewhere
#     PYTHON=/path/to/python3.12 bash benchmarks/gpu_wheels.sh   # numpy and PyYAML are built per Python:
#                                                  # gather with the GPU machine's Python version
# There, with no index:
#     python -m venv --system-site-packages venv    # sees the machine's torch
#     venv/bin/pip install --no-index --find-links wheels hpc_train
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-wheels}
python=${PYTHON:-.venv/bin/python}
[ -x "$python" ] || python=python3
mkdir -p "$dir"
# The package's own dependencies, torch left out (the GPU machine's CUDA build is the one to use); pip
# wheel resolves their dependencies too and builds the one sdist among them (antlr4-python3-runtime 4.9.3).
mapfile -t reqs < <("$python" - <<'EOF'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.match(r"[A-Za-z0-9_.-]+", d).group(0).lower() != "torch"))
EOF
)
"$python" -m pip wheel --quiet --wheel-dir "$dir" "${reqs[@]}"
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$dir" .   # hpc_train itself
rm -f "$dir"/torch-*.whl                                          # in case a find-links folder offered it
ls -1 "$dir"
du -sh "$dir"
