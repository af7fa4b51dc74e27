"""Every file of a run directory, named once (submitit's JobPaths is the model). Torch-free: the login
node (submit, status, report) and the job read and write the same names through this one object.

    runs/demo-1/
        config.yaml       the resolved config, frozen at submit; attempts re-read it, never recompose
        submission.json   executor, job id, overrides (local runs: the controller's pid and start time)
        submitit/         submitit's pickles and the per-task logs <job>_<task>_log.out
        checkpoints/      step_NNNNNN/ folders; only those with COMMITTED count
        events.jsonl      what happened, every attempt (docs/lifecycle.md lists the events)
        metrics.jsonl     loss, lr, step time per log interval
        summary.json      final_step, final_loss, params_sha256, written at the end
        placement.json    the rank order the planner chose
        drills/           fault drills armed by `hpc-train chaos` (kill-rank-during-save, slow-storage)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path

    @property
    def config(self) -> Path:
        return self.run_dir / "config.yaml"

    @property
    def submission(self) -> Path:
        return self.run_dir / "submission.json"

    @property
    def submitit(self) -> Path:
        return self.run_dir / "submitit"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def events(self) -> Path:
        return self.run_dir / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.run_dir / "summary.json"

    @property
    def placement(self) -> Path:
        return self.run_dir / "placement.json"

    @property
    def report_png(self) -> Path:
        return self.run_dir / "report.png"

    @property
    def drills(self) -> Path:
        return self.run_dir / "drills"

    def failure_claim(self, job_id: str, restart: int) -> Path:
        """Created O_EXCL by the first rank to fail in an attempt: that rank alone decides the requeue."""
        return self.run_dir / f".failed-{job_id}-{restart}"
