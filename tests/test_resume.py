"""Resume and reuse: `hpc-train resume RUN` (a stopped run again, same identity) and checkpoint.init_from
(a new run from another run's checkpoint). In-process tests use the real Saver on a 1-rank gloo group;
the rest run `hpc-train` as a user would, on the local executor."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hpc_train.checkpoint import Saver, TrainState, step_dir
from hpc_train.config import CheckpointConfig, RunConfig
from hpc_train.preempt import Unrecoverable

from conftest import HPC_TRAIN, read_events, run, submit, wait_until


@pytest.fixture(scope="module")
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def trained(seed: int, width: int = 8) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        opt.step()
    return TrainState(model, opt, step=40, tokens_seen=1234)


def source_checkpoint(tmp_path: Path) -> tuple[TrainState, Path]:
    """A committed checkpoint at step 40 of a 'source run'."""
    state = trained(seed=0)
    saver = Saver(tmp_path / "src" / "checkpoints", CheckpointConfig(), tmp_path / "drills", lambda *a, **k: None, 0.0)
    saver.save(state, "final", background=False)
    return state, step_dir(tmp_path / "src" / "checkpoints", 40)


def attempt_from(run_dir: Path, **checkpoint: Any) -> Any:
    from hpc_train.attempt import Attempt
    from hpc_train.env import RankEnv
    from hpc_train.paths import RunPaths

    env = RankEnv("local", 0, 0, 1, 1, 0, 1, ("127.0.0.1",), "127.0.0.1", 0, "1", 0)
    cfg = RunConfig(checkpoint=CheckpointConfig(**checkpoint))
    return Attempt.build(env, cfg, RunPaths(run_dir), time.time(), {})


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_init_from_loads_weights_at_step_0(tmp_path: Path, one_rank_group: Any, with_optimizer: bool) -> None:
    src, folder = source_checkpoint(tmp_path)
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    at, state = attempt_from(new_dir, init_from=str(folder), init_from_optimizer=with_optimizer), trained(seed=1)
    state.step, state.tokens_seen = 0, 0
    fresh_optim = {k: v.clone() for k, v in state.optimizer.state[state.model.weight].items()}
    assert not torch.equal(state.model.weight, src.model.weight)
    assert at.resume(state) is False  # a new run: nothing of its own resumed
    assert all(torch.equal(a, b) for a, b in zip(state.model.state_dict().values(), src.model.state_dict().values()))
    assert (state.step, state.tokens_seen) == (0, 0)
    moments = state.optimizer.state[state.model.weight]
    want = src.optimizer.state[src.model.weight] if with_optimizer else fresh_optim
    assert all(torch.equal(moments[k], want[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    start = next(e for e in read_events(new_dir) if e["event"] == "start")
    assert start["step"] == 0 and start["resumed_from"] is None
    assert start["init_from"] == {"path": str(folder), "step": 40, "optimizer": with_optimizer}


def test_init_from_refuses_other_shapes_and_a_damaged_source(tmp_path: Path, one_rank_group: Any) -> None:
    _, folder = source_checkpoint(tmp_path)
    (tmp_path / "new").mkdir()
    at = attempt_from(tmp_path / "new", init_from=str(folder))
    with pytest.raises(Unrecoverable) as e:
        at.resume(trained(seed=1, width=16))
    assert str(e.value) == (
        f"checkpoint.init_from={folder}: model.weight is [8, 8] in the checkpoint but [16, 8] here; model.bias is "
        f"[8] in the checkpoint but [16] here; build the model that checkpoint was trained with (its run's "
        f"config.yaml), or drop checkpoint.init_from")
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-1] + b"x")
    with pytest.raises(Unrecoverable, match=r"does not verify: __0_0.distcp checksum differs from the manifest; "
                                            r"submit again with another committed step folder"):
        attempt_from(tmp_path / "new", init_from=str(folder)).resume(trained(seed=1))
