"""One attempt of a run: the services every training function gets, the built-in trainer included.

    hpc-train submit fn._target_=my_pkg.train.main +fn.kwargs.steps=500 cluster=dev cluster.nodes=2

    def main(at: Attempt, steps: int = 500) -> dict | None:   # called on every rank
        model = ...; optimizer = ...
        state = TrainState(model, optimizer)             # + data=<anything with state_dict()>
        at.resume(state)                                 # newest verified checkpoint, or step 0
        while state.step < steps:
            ...one optimizer step...
            state.step += 1
            if at.step_end(state, steps):                # a stop signal: saved; return, the job requeues
                return None
        return at.finish(state, final_loss=...)          # final save, summary.json

job.py builds the Attempt once torch.distributed is up (ranks placed, the hang watchdog armed), calls
the function and, when it returns stopped, asks the one requeue decision (preempt.decide) what next.
docs/lifecycle.md draws the states; docs/byo.md has a worked example.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from hpc_train import deadlines, intervals, journal, preempt, protocol
from hpc_train.checkpoint import Saver, TrainState, Writer
from hpc_train.config import AUTO, RunConfig
from hpc_train.env import RankEnv
from hpc_train.memory_tier import MemoryTier
from hpc_train.paths import RunPaths
from hpc_train.profiling import Profile
from hpc_train.reasons import Reason
from hpc_train.task import Pulse, Task

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Attempt", "TrainState"]

log = logging.getLogger(__name__)


def device_and_mesh(world_size: int, tp: int) -> tuple[torch.device, DeviceMesh]:
    """This rank's device (the GPU job.py selected, else CPU) and the (dp, tp) mesh. Ranks are
    node-contiguous (placement) and tp divides tasks_per_node, so the inner tp dimension, consecutive
    ranks, never leaves a node: TP's per-layer all-reduces stay on NVLink, FSDP's traffic crosses nodes."""
    from torch.distributed.device_mesh import init_device_mesh

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return device, init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def ddps_to_rebucket(model: torch.nn.Module) -> list[Any]:
    """The torch DDPs over `model`'s parameters (the DDP wrapping it, as docs/byo.md's loop has it, `model`
    itself, or one inside it) that still have the gradient buckets they were built with. torch 2.13 starts
    with one bucket of every parameter, records the order in which gradients become ready in the first
    backward and rebuilds its buckets in that order at the second forward, never again
    (nn/parallel/distributed.py: compute_bucket_size_limits, _pre_forward); not at all with
    find_unused_parameters (unless static_graph) or the compiled python reducer. A static graph is left
    as it is: the throwaway would be its first iteration, recording every parameter as used. Looked for among the live
    objects, since TrainState holds the module a DDP wraps, not the DDP: 0.14 s of CPU for 250k of them,
    0.36 s for 1.25M, once per resumed attempt."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    mine = {id(p) for p in model.parameters()}
    return [
        o
        for o in gc.get_objects()
        if issubclass(type(o), DDP)
        and not getattr(o, "_has_rebuilt_buckets", False)
        and not o.static_graph  # its first iteration would be the throwaway, every parameter used in it
        and not o.find_unused_parameters
        and not getattr(o, "_use_python_reducer", False)
        and isinstance(getattr(o, "module", None), torch.nn.Module)
        and any(id(p) in mine for p in o.module.parameters())
    ]


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor in a forward's output: nested dicts, lists, tuples and dataclasses (a ModelOutput)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return [t for o in obj for t in _tensors(o)] if isinstance(obj, (list, tuple)) else []


def rebucket_at_first_forward(ddp: Any, spent_s: list[float], say: Callable[[str], None]) -> None:
    """After a resume, DDP would take the first step in its initial buckets, where the uninterrupted run
    took it in the rebuilt ones; the buckets set the summation order of the gradient all-reduce, and 4
    ranks ended with other weights after 2 resumes (2 cannot: a sum of two is exact in any order). So the
    first forward that will sync gradients first runs a throwaway forward and backward on copies of the
    same inputs (the same graph, so the same order of ready gradients), and DDP rebuilds its buckets at
    the real forward that follows. Put back after it: gradients, buffers (by name: BatchNorm's statistics,
    a mask the forward fills), torch's, Python's and numpy's RNG; the optimizer is not stepped and the
    loop runs each step once. What a forward does besides its module (a hook appending to a list) happens
    twice. A 0 x p term per parameter makes every gradient arrive even where the output does not reach
    (the loss does): DDP waits for all of them. Appends the seconds it took to spent_s."""

    def throwaway(module: Any, args: Any, kwargs: Any) -> None:
        if not (torch.is_grad_enabled() and module.require_backward_grad_sync):
            return  # an evaluation or a no_sync micro-batch: the first syncing forward comes later
        handle.remove()  # before the forward below, which calls the hooks again
        t0 = time.monotonic()
        params = [p for p in module.parameters() if p.requires_grad]
        grads = [p.grad for p in params]
        buffers = {n: (b, b.detach().clone()) for n, b in module.named_buffers()}
        py_rng, np_rng = random.getstate(), _numpy_rng()
        for p in params:
            p.grad = None

        def copy(t: Any) -> Any:  # no graph of the caller's, no in-place change of its inputs
            return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            out = _tensors(module(*map(copy, args), **{k: copy(v) for k, v in kwargs.items()}))
            floats = [t.float().sum() for t in out if t.requires_grad and t.is_floating_point()]
            if not floats:  # the 0 x p terms alone: buckets in their order, not the graph's
                say(
                    "warning: no output of the DDP needs a gradient, so its buckets after this resume "
                    "may not be the uninterrupted run's: the weights may then differ in their last bits"
                )
            (sum(floats, torch.zeros(())) + sum(p.sum() * 0 for p in params)).backward()
        random.setstate(py_rng)
        if np_rng is not None:
            import numpy as np

            np.random.set_state(np_rng)
        with torch.no_grad():
            for name, _ in list(module.named_buffers()):
                if name not in buffers:  # made by the forward (registered None before)
                    owner, _, attr = name.rpartition(".")
                    module.get_submodule(owner)._buffers[attr] = None
            for name, (b, value) in buffers.items():
                owner, _, attr = name.rpartition(".")
                module.get_submodule(owner)._buffers[attr] = b
                b.copy_(value)
        for p, g in zip(params, grads):
            p.grad = g
        spent_s.append(time.monotonic() - t0)

    handle = ddp.register_forward_pre_hook(throwaway, with_kwargs=True)


def _numpy_rng() -> Any:
    try:
        import numpy as np
    except ImportError:
        return None
    return np.random.get_state()


@dataclass
class Attempt:
    env: RankEnv  # this rank after placement: rank, local_rank, world_size, node_rank, nodes
    cfg: RunConfig  # the frozen config; cfg.checkpoint drives the saves
    paths: RunPaths  # every file of the run directory
    mesh: DeviceMesh  # ("dp", "tp"); tp = train.tp, inside a node
    device: torch.device  # this rank's GPU, else CPU
    saver: Saver
    process_start: float  # Unix time this process started (launched_at)
    phases_s: dict[str, float] = field(default_factory=dict)  # start-up, phase by phase, for the start event
    stopped: bool = False  # step_end() saw a stop signal: the job requeues (or stops) when fn returns
    stop_step: int = -1  # the step it stopped at
    stop_reason: Reason = Reason.PREEMPT  # judged once, by every rank's signals, at the stop
    kill_deadline: float = float("inf")  # time.monotonic() when Slurm's SIGKILL is due, from the first signal
    end_at: float = 0.0  # Unix time of Slurm's EndTime as the attempt started (slurm.end_time); 0: unknown
    # Seconds a time-limit stop keeps after its save for the requeue decision (deadlines.decision_reserve_s): a
    # TIMEOUT job is not requeued by Slurm, so SIGKILL must not land before `scontrol requeue` answered.
    reserve_s: float = 0.0
    finished: dict[str, Any] | None = None  # the summary, once finish() ran
    memory: MemoryTier | None = None  # checkpoint.memory_every_steps: copies in node-local tmpfs (memory_tier.py)
    # This process's stop signals and heartbeat (the Task's; by default the one its signal handlers record into)
    pulse: Pulse = field(default_factory=preempt.install_handlers)
    # profile.*: torch.profiler over a window of steps, stepped by step_end (profiling.py); `profile.torch` is
    # the running torch.profiler.profile inside the window, None outside it
    profile: Profile = field(init=False)
    _built_at: float = field(default_factory=time.monotonic)
    _resumed_at: float | None = None
    _rebucket_s: list[float] = field(default_factory=list)  # the throwaway forward and backward, once taken
    _signalled: bool = False
    _last_step: int | None = None  # step_end's last_step: a return at or past it is a finish, signal or not
    # checkpoint.every_steps / memory_every_steps as this attempt saves (intervals.py chooses an "auto" one at the
    # resume and after each commit while a save's cost is unmeasured)
    every_steps: int = 0
    _provisional: bool = False
    _step_times_s: list[float] = field(default_factory=list)  # step_end to step_end, saves excluded: the step time
    _left_step_end: float | None = None
    _copies: list[tuple[float, float]] = field(default_factory=list)  # each memory copy's (blocked, background) s
    _verified_n: int = 0

    def __post_init__(self) -> None:
        self.every_steps = self.every_steps or self.cfg.checkpoint.steps("every_steps")
        self.profile = Profile(
            self.cfg.profile,
            self.paths,
            self.env.rank,
            self.env.restart_count,
            self.device.type == "cuda",
            self.say,
            self.cfg.share_with_group,
        )

    @classmethod
    def build(
        cls,
        env: RankEnv,
        cfg: RunConfig,
        paths: RunPaths,
        process_start: float,
        phases_s: dict[str, float],
        reserve_s: float = 0.0,
        task: Task | None = None,
    ) -> Attempt:
        """Collective: device, mesh, the background writer and what earlier attempts measured. `task`: the rank
        process's own state, which holds the memory tier for the failure path."""
        device, mesh = device_and_mesh(env.world_size, cfg.train.tp)
        # Rank 0 alone asks (one slurmctld call per attempt, not one per rank), in the same all-reduce.
        facts = torch.tensor(
            [journal.slowest_write_s(journal.read(paths.run_dir)), preempt.slurm_end(env.executor, env.job_id)[0]]
            if env.rank == 0
            else [0.0, 0.0],
            dtype=torch.float64,
        )
        dist.all_reduce(facts, op=dist.ReduceOp.MAX)

        def event(name: str, step: int, **fields: Any) -> None:
            if env.rank == 0:
                journal.log(paths.run_dir, name, step, env.job_id, env.restart_count, **fields)

        writer = Writer() if cfg.checkpoint.async_save else None
        pulse = task.pulse if task is not None else preempt.install_handlers()
        saver = Saver(
            paths.checkpoints,
            cfg.checkpoint,
            paths.drills,
            event,
            float(facts[0]),
            writer,
            share_with_group=cfg.share_with_group,
            alive=pulse.alive,
        )
        memory = None
        if cfg.checkpoint.memory_every_steps:
            say = log.info if env.rank == 0 else lambda line: None
            shape = (mesh["dp"].size(), mesh["tp"].size())
            timeout_s = preempt.collective_timeout_s(cfg.train.watchdog_s)  # as the training's group's
            memory = MemoryTier.build(cfg.checkpoint, env, paths.run_dir, shape, say, timeout_s)
        if task is not None:
            task.memory = memory
        return cls(
            env,
            cfg,
            paths,
            mesh,
            device,
            saver,
            process_start,
            phases_s,
            end_at=float(facts[1]),
            reserve_s=reserve_s,
            memory=memory,
            pulse=pulse,
        )

    def event(self, name: str, step: int, **fields: Any) -> None:
        """Rank 0 appends to events.jsonl; the other ranks do nothing (call it on every rank)."""
        self.saver.event(name, step, **fields)

    def say(self, line: str) -> None:
        """One line on rank 0's log (the run's console, through the `hpc_train` logger); silent elsewhere."""
        if self.env.rank == 0:
            log.info(line)

    def should_stop(self) -> bool:
        """Collective: True on every rank once any rank caught a stop signal (one 4-byte all-reduce,
        ~0.1 ms on gloo). step_end() calls it; call it yourself at other loop boundaries (evaluation)."""
        self.pulse.beat()
        flag = torch.tensor([1 if self.pulse.received else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def resume(self, state: TrainState, **start_fields: Any) -> bool:
        """Collective: load the newest checkpoint that verifies into `state` (model, optimizer, step,
        tokens, data position, this rank's RNG); writes the attempt's `start` event with its start-up
        phases. Returns False on a fresh run (state untouched, or with checkpoint.init_from the weights
        of another run's checkpoint, at step 0). `start_fields` go into the start event as they are.

        A checkpoint written by another world size (cluster.min_nodes: an elastic attempt) loads resharded
        by DCP; the event then names that size (`resharded_from`) and any rank without an RNG file of
        its own there (`fresh_rng_ranks`, they keep the seed they started with).

        With checkpoint.memory_every_steps the copies in memory come first (MemoryTier.load): when they are at
        least as new as the newest committed disk checkpoint and load on every rank, the disk is not read, and
        the event says `resumed_from: "memory step S"` and `memory: {step, own, buddy, load_s}`; else
        `memory: {skipped: why}` and the disk resume runs as without them."""
        self.phases_s["setup"] = time.monotonic() - self._built_at  # model build, parallelize
        memory = self.memory.load(state, self.saver.root) if self.memory else {}
        if "step" in memory:
            folder, verify_s, load_s = None, 0.0, memory["load_s"]
        else:
            folder, verify_s, load_s = self.saver.resume(state)
        resumed = folder is not None or "step" in memory
        source = None
        if not resumed and self.cfg.checkpoint.init_from:  # a new run, from another run's weights: step 0
            source, verify_s, load_s = self.saver.init_from(state)
        self.phases_s.update(verify=verify_s, load=load_s)
        saved = self.saver.saved_world_size
        resharded = (
            {}
            if folder is None or saved == self.env.world_size
            else {"resharded_from": saved, "fresh_rng_ranks": list(range(saved, self.env.world_size))}
        )
        if resharded:
            self.say(
                f"{folder} was written by {saved} ranks; resharded to {self.env.world_size}"
                + (
                    f"; ranks {saved}..{self.env.world_size - 1} keep a fresh RNG seed"
                    if saved < self.env.world_size
                    else ""
                )
            )
        # whether each rank computes on a GPU: benchmarks refuse a "GPU" figure that a CPU produced
        pids = protocol.gather_ints(self.env, [os.getpid(), self.device.type == "cuda"])
        protocol.start_event(
            self.env,
            self.paths,
            state.step,
            target=self.cfg.fn._target_ or "hpc_train.train.main",
            launched_at=self.process_start,
            pids=[p[0] for p in pids],
            resumed_from=f"memory step {memory['step']}" if "step" in memory else str(folder) if folder else None,
            init_from=source,
            mesh={"dp": self.mesh["dp"].size(), "tp": self.mesh["tp"].size()},
            vocab_size=self.cfg.model.vocab_size,  # data=tokens: raised to the data's meta.json (config.py)
            devices=["cuda" if p[1] else "cpu" for p in pids],
            phases_s={k: round(v, 3) for k, v in self.phases_s.items()},
            tokens_seen=state.tokens_seen,
            data=None
            if state.data is None
            else {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in state.data.state_dict().items()},
            **resharded,
            **({"memory": memory} if memory else {}),
            **start_fields,
        )
        self.saver.retain()  # before any save: the stop path left it to this attempt, and torn folders go
        if AUTO in (self.cfg.checkpoint.every_steps, self.cfg.checkpoint.memory_every_steps):
            self._choose_intervals(state.step)
        if resumed:  # DDP's buckets as the uninterrupted run had them at this step
            for ddp in ddps_to_rebucket(state.model):
                rebucket_at_first_forward(ddp, self._rebucket_s, self.say)
        self._resumed_at = time.monotonic()
        self.pulse.beat(state.step)
        self.profile.step(state.step)  # profile.*: the window may begin with the next step
        return resumed

    def time_left_s(self) -> tuple[float, Reason]:
        """Collective: (seconds until Slurm's SIGKILL, why) from the first stop signal any rank caught, the same on
        every rank (protocol.time_left)."""
        return protocol.time_left(self.env, self.cfg.cluster, self.pulse, self.process_start, self.end_at)

    def _agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def step_end(self, state: TrainState, last_step: int) -> bool:
        """Collective, after each optimizer step. One all-reduce answers both "did any rank catch a stop
        signal" and "is the background write done on every rank" (then it commits). On a stop: save
        this step (if it fits before SIGKILL, less reserve_s before a time limit's) and return True; the
        caller returns. Else a periodic save every checkpoint.every_steps. A signal at the last step
        finishes the run instead."""
        self.pulse.beat(state.step)  # the hang watchdog (watchdog.py) restarts its clock
        self._last_step = last_step
        if self._left_step_end is not None:  # the step alone: this call's saves come after the clock reads
            self._step_times_s = [*self._step_times_s[-49:], time.monotonic() - self._left_step_end]
        if self._resumed_at is not None:  # resume -> first step done: the restart's last phase
            rebucket = {"ddp_rebucket_s": round(sum(self._rebucket_s), 4)} if self._rebucket_s else {}
            took = round(time.monotonic() - self._resumed_at, 4)  # total_steps: what status shows as the run's total
            self.event(journal.FIRST_STEP, state.step, step_time_s=took, total_steps=int(last_step), **rebucket)
            self._resumed_at = None
        flags = torch.tensor(
            [1 if self.pulse.received else 0, 0 if self.saver.written_here() else 1], dtype=torch.int32
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, unwritten = bool(flags[0]), bool(flags[1])
        self.profile.step(state.step, last_step, stop and state.step < last_step)  # profile.*; a stop drops it
        if stop and not self._signalled:
            self._signalled = True
            left, reason = self.time_left_s()
            # A preempted job is requeued by Slurm itself when it kills it at GraceTime's end: only a time
            # limit's SIGKILL (TIMEOUT, never requeued) must wait for our requeue.
            reserve = self.reserve_s if reason == Reason.TIME_LIMIT else 0.0
            protocol.signal_event(
                self.env,
                self.paths,
                state.step,
                self.pulse,
                reason,
                left,
                reserve_s=reserve,
                finishing=state.step >= last_step,
            )
            if state.step < last_step:
                self.stopped, self.stop_step, self.stop_reason = True, state.step, reason
                self.kill_deadline = time.monotonic() + left
                self.saver.stop(state, left - reserve, self._agree)
                return True
        if self.saver.pending is not None and not unwritten:
            self.saver.commit_pending()
        if state.step % self.every_steps == 0 and state.step < last_step:
            self.saver.periodic(state)
        if self.memory and self.memory.due(state.step) and state.step < last_step:
            blocked = self.memory.save(state)
            self._copies = [*self._copies[-9:], (blocked, self.memory.copy_s)]
        if self._provisional and len(self.saver.verified) > self._verified_n:  # a save measured: choose again
            self._choose_intervals(state.step)
        self._left_step_end = time.monotonic()
        return False

    def _choose_intervals(self, step: int) -> None:
        """Collective: checkpoint.every_steps / memory_every_steps=auto chosen on rank 0 (intervals.choose, from this
        run's journal, its step and save times, and the site's rates submit froze) and given to every rank; the
        choice on record (`interval`) with its inputs. A failure to choose keeps the intervals as they are."""
        mine = [self.every_steps, self.memory.every_steps if self.memory else 0, int(self._provisional), 0]
        if self.env.rank == 0:
            try:
                events = journal.read(self.paths.run_dir)
                rates = intervals.read_rates(self.paths.history, self.paths.run_dir)
                # the memory tier covers a fault only where it is on and a spare relaunches the step
                spares = bool(self.cfg.cluster.spare_nodes or self.cfg.cluster.in_process_restart)
                spares = spares and self.memory is not None and not self.memory.off
                m = intervals.measured(events, self._step_times_s, self._copies)
                budgets = intervals.stop_budgets(self.cfg.cluster, self.reserve_s)  # what a stop leaves its save
                choice = intervals.choose(self.cfg.checkpoint, m, rates, self.env.num_nodes, spares, budgets)
                mine = [choice.every_steps, choice.memory_every_steps, int(choice.provisional), 1]
            except Exception as e:  # a damaged history.json, a journal line: the run trains on as it was
                log.warning(
                    "checkpoint intervals not chosen (%s: %s); keeping every %d steps",
                    type(e).__name__,
                    e,
                    self.every_steps,
                )
        got = torch.tensor(mine, dtype=torch.int64)
        dist.broadcast(got, src=0)
        every, memory_every, provisional, chosen = (int(x) for x in got)
        self.every_steps, self._provisional = every, bool(provisional)
        self._verified_n = len(self.saver.verified)
        if self.memory and memory_every:
            self.memory.every_steps = memory_every
        if self.env.rank == 0 and chosen:
            self.event(
                journal.INTERVAL,
                step,
                every_steps=every,
                memory_every_steps=memory_every if self.memory else 0,
                provisional=bool(provisional),
                why=choice.why,
                inputs=choice.inputs,
            )
            if not provisional:
                self.say(f"checkpoint intervals (auto): {choice.why}")

    def wait_for_memory(self, timeout_s: float) -> bool:
        """The memory copy in flight, waited for up to timeout_s in 1 s slices that tell the hang watchdog this
        rank is not hung (a copy of a `1b` state takes ~10 s); True once it ended."""
        assert self.memory is not None
        deadline = time.monotonic() + timeout_s
        while not self.memory.idle.is_set() and time.monotonic() < deadline:
            self.memory.wait(min(1.0, max(0.0, deadline - time.monotonic())))
            self.pulse.alive()
        return self.memory.idle.is_set()

    def returned(self) -> None:
        """The function returned without finish(): at its own stop check (should_stop) with a stop signal pending,
        that is a stop at the step the loop reached, with the time Slurm leaves; a stop step_end saw is kept. A return
        at the last step step_end was told of is a finish, whenever the signal came (step_end finishes at it too)."""
        done = self._last_step is not None and self.pulse.step_reached >= self._last_step
        if self.finished is None and not self.stopped and not done and self.should_stop():
            left, reason = self.time_left_s()
            self.stopped, self.stop_step, self.stop_reason = True, self.pulse.step_reached, reason
            self.kill_deadline = time.monotonic() + left

    def finish(self, state: TrainState | None, **summary: Any) -> dict[str, Any]:
        """Collective: the final save (waiting for any write in flight), then the run's finish (protocol.finish:
        summary.json, the finish event)."""
        self.profile.close()  # a window the run ends inside: what it recorded, written before the final save
        if state is not None:
            self.saver.final(state)
        step = state.step if state is not None else max(self.saver.verified, default=0)
        # On record first: a memory copy stuck below (up to 130 s) must not let SIGKILL find the run unfinished
        self.finished = protocol.finish(self.env, self.paths, step, **summary)
        if self.memory:  # no relaunch will read it; the copy in flight first (every rank is here)
            if not self.wait_for_memory(deadlines.FINISH_MEMORY_WAIT_S):  # a copy stuck on a gone peer: disk has it
                log.warning("the memory copy in flight did not end within %.0f s", deadlines.FINISH_MEMORY_WAIT_S)
                self.memory.abandon()
            self.memory.clean(join_s=10.0)  # its thread ends before the process does
        return self.finished
