"""hpc_train: Slurm-native multi-node PyTorch training that survives preemption."""

import os

__version__ = "0.1.0"  # pyproject.toml reads it from here; code.json records it at submit


def shipped_dir(name: str) -> str:
    """conf/ or sbatch_templates/: inside the package in an installed wheel (pyproject.toml maps them in),
    beside it in a source checkout or an editable install. os.path, not pathlib: start.py imports this
    package before its signal handlers go in, so it stays cheap."""
    here = os.path.dirname(os.path.abspath(__file__))
    inside = os.path.join(here, name)
    return inside if os.path.isdir(inside) else os.path.join(os.path.dirname(here), name)
