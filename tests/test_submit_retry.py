"""sbatch retries: the helper on its own (no cluster needed)."""

from __future__ import annotations

import pytest
from conftest import names

from hpc_train.slurm import SlurmError
from hpc_train.submit import _sbatch_with_retry


def test_retries_then_succeeds_and_reports_each_failure(capsys: pytest.CaptureFixture[str]) -> None:
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("sbatch: error: Batch job submission failed: Unable to contact slurm controller")
        return "queued"

    assert _sbatch_with_retry(flaky, "trials 0..9", backoff_s=0.01) == "queued"
    assert len(calls) == 3
    err = capsys.readouterr().err
    retried = [line for line in err.splitlines() if "trials 0..9" in line]
    assert len(retried) == 2 and all(names(line, "sbatch failed", "Unable to contact", "retrying") for line in retried)


def test_gives_up_with_what_to_do() -> None:
    def down() -> None:
        raise RuntimeError("Unable to contact slurm controller")

    with pytest.raises(SlurmError, match=r"sbatch failed 4 times for trials 3..4 of /s \(rerun"):
        _sbatch_with_retry(down, "trials 3..4 of /s (rerun the same command with --sweep-dir /s)", backoff_s=0.001)
