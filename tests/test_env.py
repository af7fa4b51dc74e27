"""Rank facts as pure functions of an environment mapping, tested with plain dicts."""

from __future__ import annotations

import pytest

from hpc_train.env import from_env, parse_nodelist, rendezvous_port, torchrun_vars


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        # The examples of Slurm's man pages (scontrol "show hostnames", sbatch --nodelist).
        ("tux[1-3]", ["tux1", "tux2", "tux3"]),
        ("lx[10-20]", [f"lx{i}" for i in range(10, 21)]),
        ("linux[00-07]", [f"linux0{i}" for i in range(8)]),
        ("tux[2,1-2]", ["tux2", "tux1", "tux2"]),
        ("tux1,tux2", ["tux1", "tux2"]),
        ("node[1,3]", ["node1", "node3"]),
        ("gpu[008-010],cpu1", ["gpu008", "gpu009", "gpu010", "cpu1"]),
        ("rack[1-2]-node[1-2]", ["rack1-node1", "rack1-node2", "rack2-node1", "rack2-node2"]),
        ("single", ["single"]),
    ],
)
def test_parse_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert parse_nodelist(nodelist) == hosts


SLURM = {
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_NTASKS_PER_NODE": "2(x4)",
    "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "node[3-4,7-8]",
    "SLURM_JOB_ID": "1234",
}


def test_from_slurm_env() -> None:
    env = from_env(SLURM)
    assert (env.executor, env.rank, env.local_rank, env.world_size, env.local_world_size) == ("slurm", 5, 1, 8, 2)
    assert env.node_rank == 2 and env.num_nodes == 4 and env.master_addr == "node3"
    assert env.job_id == "1234" and env.restart_count == 0
    assert torchrun_vars(env) == {
        "RANK": "5",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node3",
        "MASTER_PORT": str(env.master_port),
    }


def test_tasks_placed_unevenly_say_why() -> None:
    """srun ignores --ntasks-per-node when an inherited SLURM_NTASKS disagrees with the node count: no
    SLURM_NTASKS_PER_NODE, 2 tasks on 2 nodes where 4 were meant. A clear error, not a KeyError."""
    uneven = {k: v for k, v in SLURM.items() if k != "SLURM_NTASKS_PER_NODE"} | {
        "SLURM_NTASKS": "6",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2),1(x2)",
    }
    with pytest.raises(RuntimeError, match=r"srun started 6 tasks on 4 nodes \(2\(x2\),1\(x2\) per node\)"):
        from_env(uneven)
    with pytest.raises(RuntimeError, match=r"\? per node"):
        from_env({k: v for k, v in SLURM.items() if k != "SLURM_NTASKS_PER_NODE"})
    assert (
        from_env(
            {k: v for k, v in SLURM.items() if k != "SLURM_NTASKS_PER_NODE"} | {"SLURM_STEP_TASKS_PER_NODE": "2(x4)"}
        ).local_world_size
        == 2
    )


def test_array_task_requeues_itself_and_each_attempt_gets_a_new_port() -> None:
    first = from_env({**SLURM, "SLURM_ARRAY_JOB_ID": "1200", "SLURM_ARRAY_TASK_ID": "34"})
    again = from_env({**SLURM, "SLURM_ARRAY_JOB_ID": "1200", "SLURM_ARRAY_TASK_ID": "34", "SLURM_RESTART_COUNT": "1"})
    assert (
        first.job_id == "1200_34"
    )  # `scontrol requeue 1234` would requeue the right task too, but this is what squeue shows
    assert again.restart_count == 1 and again.master_port != first.master_port
    assert 20000 <= rendezvous_port("1200_34", 7) < 30000


def test_from_local_env() -> None:
    env = from_env(
        {
            "SUBMITIT_LOCAL_JOB_ID": "999",
            "SUBMITIT_LOCAL_NTASKS": "3",
            "SUBMITIT_LOCAL_GLOBALID": "2",
            "SUBMITIT_LOCAL_LOCALID": "2",
            "HPC_TRAIN_ATTEMPT": "4",
        }
    )
    assert (env.executor, env.rank, env.world_size, env.master_addr, env.restart_count) == (
        "local",
        2,
        3,
        "127.0.0.1",
        4,
    )


def test_outside_a_job_says_how_to_run() -> None:
    with pytest.raises(RuntimeError, match="hpc-train submit"):
        from_env({})


def test_master_override() -> None:
    env = from_env({**SLURM, "HPC_TRAIN_MASTER_ADDR": "node3-ib", "HPC_TRAIN_MASTER_PORT": "29400"})
    assert (env.master_addr, env.master_port) == ("node3-ib", 29400)
