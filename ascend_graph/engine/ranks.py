"""The ranks of a multi-process engine: rank 0 (the engine's process) starts and drives the others.

``RankSet.start`` spawns ranks 1..W-1 on this host (multiprocessing ``spawn``), or, under an
external launcher (torchrun's ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``),
takes the rank it was given: rank 0 drives, ranks > 0 serve steps until rank 0 stops them. Every
rank forms its groups (``init_parallel``; spawned ranks rendezvous through a fresh ``file://``,
which opens no port), builds its own share of the model (``model_source``) and its own runner,
with the minimum ``num_blocks`` of all ranks.

Each step rank 0 wakes its spawned ranks (one byte on a pipe: an idle engine holds no deadline),
broadcasts the step over the host gloo group (``step_wire``), runs its own share, and receives
each data-parallel replica's logits from that replica's tensor-parallel rank 0. A rank whose step
raises reports its traceback on a queue and exits; rank 0's next wait fails, and it raises a
``RankError`` naming that rank, after stopping the others.
"""

from __future__ import annotations

import atexit
import os
import queue
import tempfile
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import multiprocessing as mp
import torch
from torch import Tensor, nn

from ..config import GraphConfig
from ..distributed import ParallelConfig, ParallelState, agree, destroy_parallel, init_parallel
from ..runner.graph_runner import GraphRunner
from ..runner.parity import compare_step
from .geometry import resolve_block_size, resolve_max_model_len, resolve_num_blocks
from .step_wire import Plan, StepKind, gather_json, recv_logits, recv_step, send_logits, send_step

INJECT_FAILURE_ENV = "ASCEND_GRAPH_FAIL_RANK"  # tests: "R" or "R:N", rank R raises at its N-th step (1st)
JOIN_DEADLINE_S = 30.0  # close(): how long a rank may take to leave before it is killed
REPORT_GRACE_S = 10.0  # after a failed wait: how long rank 0 waits for a rank's report


class RankError(RuntimeError):
    """Another rank of a multi-process engine failed (``rank``; its traceback in the message)."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass(frozen=True)
class RankSettings:
    """What every rank needs to build its runner, as the engine was given it."""

    graph_config: GraphConfig
    block_size: Optional[int]
    max_model_len: Optional[int]
    max_num_seqs: int
    num_blocks: Optional[int]
    cache_memory_bytes: Optional[int]
    cache_align_bytes: int
    device: str
    threads: int


def build_runner(model: nn.Module, s: RankSettings, state: ParallelState) -> GraphRunner:
    """This rank's runner over its share ``model``; ``num_blocks`` the least any rank can hold."""
    block_size = resolve_block_size(model, s.block_size)
    max_model_len = resolve_max_model_len(model, s.max_model_len)
    mine = resolve_num_blocks(model, block_size, max_model_len, s.max_num_seqs, s.num_blocks, s.cache_memory_bytes)
    num_blocks = agree([mine], "min", state, what="num_blocks")[0]
    return GraphRunner(model, s.graph_config, num_blocks=num_blocks, block_size=block_size,
                       max_model_len=max_model_len, device=s.device, cache_align_bytes=s.cache_align_bytes)


def _summary(rank: int, report) -> dict:
    """A ``ParityReport`` in a few JSON-safe numbers (what rank 0 keeps per rank)."""
    caches = [d["max_abs"] for layer in report.caches for d in layer.values()]
    return {"rank": rank, "batch_size": report.batch_size, "ok": bool(report.ok),
            "logits_max_abs": report.logits["max_abs"], "caches_max_abs": max(caches, default=0.0),
            "untouched_ok": report.untouched_ok, "routing_flips": len(report.routing_flips)}


def run_step(runner: GraphRunner, state: ParallelState, kind: StepKind, arg: int,
             plan: Optional[Plan]) -> tuple[Optional[Tensor], object]:
    """Run one step on this rank: ``(logits of its replica's entries or None, report)``; the
    report is every rank's summary (CHECK, STATS; gathered on every rank) or None."""
    if kind == StepKind.CAPTURE:  # arg: rank 0 shows its progress
        runner.capture(show_progress=bool(arg) and state.rank == 0)
        return None, None
    if kind == StepKind.STATS:
        return None, gather_json(state, runner.stats.to_dict())
    entries = plan[state.rank // state.config.tensor_parallel_size]
    if kind == StepKind.CHECK:  # every rank checks (an idle data-parallel replica: its padding part)
        report = compare_step(runner, entries, check_untouched=bool(arg))
        if report is None:
            return None, (None, gather_json(state, None))
        return report.graph_logits, (report, gather_json(state, _summary(state.rank, report)))
    # an idle data-parallel replica (no entries) still runs the step on padding: the collectives need it
    logits = runner.execute(entries, mode="eager" if kind == StepKind.EAGER else "auto")
    return (logits if entries else None), None


# -- ranks > 0 ------------------------------------------------------------------------------


def serve_steps(runner: GraphRunner, state: ParallelState, wake=None) -> None:
    """Ranks > 0: run rank 0's steps until it stops them (``wake``: the spawned rank's pipe;
    None under an external launcher, where STOP comes over the host group)."""
    tp = state.config.tensor_parallel_size
    sends = state.rank % tp == 0 and state.rank >= tp  # a replica's first rank, not rank 0's replica
    rank, _, step = os.environ.get(INJECT_FAILURE_ENV, "").partition(":")
    fail_at, steps = int(step or 1) if rank == str(state.rank) else None, 0
    while wake is None or _woken(wake):
        kind, arg, plan = recv_step(state)
        if kind == StepKind.STOP:
            return
        steps += plan is not None
        if steps == fail_at:
            raise RuntimeError(f"rank {state.rank}: failure injected by {INJECT_FAILURE_ENV} at step {steps}")
        logits, _ = run_step(runner, state, kind, arg, plan)
        if sends and logits is not None:
            send_logits(state, logits)


def _woken(wake) -> bool:
    try:
        return wake.recv_bytes() == b"s"
    except EOFError:  # rank 0 is gone
        return False


def worker_main(rank: int, parallel: ParallelConfig, source, settings: RankSettings, init_method: str,
                timeout_s: float, wake, errors) -> None:
    """A spawned rank's life: groups, model share, runner, steps; its failure reported to rank 0."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(settings.threads)
    try:
        state = init_parallel(parallel, rank=rank, world_size=parallel.world_size, init_method=init_method,
                              device=settings.device, timeout_s=timeout_s)
        serve_steps(build_runner(source.build(state), settings, state), state, wake)
    except BaseException:  # noqa: BLE001  (reported to rank 0, then this rank exits)
        errors.put((rank, traceback.format_exc()))
        errors.close()
        errors.join_thread()
        raise SystemExit(1)
    finally:
        destroy_parallel()


def external_rank(parallel: ParallelConfig) -> Optional[int]:
    """This process's rank under an external launcher (``RANK`` and ``WORLD_SIZE`` set), else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    if int(os.environ["WORLD_SIZE"]) != parallel.world_size:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} (the launcher's) is not tensor_parallel_size * "
                         f"data_parallel_size = {parallel.world_size}")
    return int(os.environ["RANK"])


def serve_external(parallel: ParallelConfig, source, settings: RankSettings, timeout_s: float) -> None:
    """A rank > 0 under an external launcher: serve rank 0's steps until it stops them."""
    try:
        state = init_parallel(parallel, device=settings.device, timeout_s=timeout_s)
        serve_steps(build_runner(source.build(state), settings, state), state)
    finally:
        destroy_parallel()


# -- rank 0 ---------------------------------------------------------------------------------


class RankSet:
    """Rank 0's handle on the other ranks: starts them, sends each step, stops them."""

    def __init__(self, parallel: ParallelConfig, source, settings: RankSettings, timeout_s: float) -> None:
        self.parallel, self.closed = parallel, False
        self.procs: list = []
        self.wakes: list = []
        self.errors = None
        self._store: Optional[str] = None
        if external_rank(parallel) is None:
            self._spawn(source, settings, timeout_s)
            init_method = "file://" + self._store
        else:
            init_method = None  # torchrun's MASTER_ADDR / MASTER_PORT
        atexit.register(self.close)
        with self.guard():
            self.state = init_parallel(parallel, rank=0, world_size=parallel.world_size, init_method=init_method,
                                       device=settings.device, timeout_s=timeout_s)
            self.model = source.build(self.state)
            self.runner = build_runner(self.model, settings, self.state)

    def _spawn(self, source, settings: RankSettings, timeout_s: float) -> None:
        fd, self._store = tempfile.mkstemp(prefix="ascend_graph_rendezvous_")
        os.close(fd)
        ctx = mp.get_context("spawn")
        self.errors = ctx.Queue()
        for rank in range(1, self.parallel.world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=worker_main, name=f"ascend-graph-rank-{rank}", daemon=True,
                               args=(rank, self.parallel, source, settings, "file://" + self._store, timeout_s,
                                     reader, self.errors))
            proc.start()
            reader.close()
            self.procs.append(proc)
            self.wakes.append(writer)

    def step(self, kind: StepKind, arg: int = 0, plan: Optional[Plan] = None
             ) -> tuple[Optional[list[Optional[Tensor]]], object]:
        """Run one step on every rank: each replica's logits (None for an idle one; None for a
        step without a plan) and rank 0's report (``run_step``)."""
        if self.closed:
            raise RuntimeError("this multi-process engine is closed (close(), or a rank failed earlier)")
        with self.guard():
            for wake in self.wakes:
                wake.send_bytes(b"s")
            send_step(self.state, kind, arg, plan)
            mine, report = run_step(self.runner, self.state, kind, arg, plan)
            if plan is None:
                return None, report
            tp, vocab = self.parallel.tensor_parallel_size, self.model.config.vocab_size
            logits = [mine] + [recv_logits(self.state, r * tp, len(entries), vocab) if entries else None
                               for r, entries in enumerate(plan[1:], start=1)]
            return logits, report

    @contextmanager
    def guard(self) -> Iterator[None]:
        """Any failure inside ends every rank; another rank's failure is raised as its ``RankError``."""
        try:
            yield
        except BaseException as e:
            failure = self._failed_rank()
            self.close(notify=False)
            if failure is not None:
                raise RankError(*failure) from e
            raise

    def _failed_rank(self) -> Optional[tuple[int, str]]:
        """The first spawned rank that reported a failure or exited, waiting up to ``REPORT_GRACE_S``."""
        start, grace = time.monotonic(), REPORT_GRACE_S if self.procs else 0.0
        while True:
            try:
                rank, trace = self.errors.get(timeout=0.1) if self.errors is not None else (None, "")
            except queue.Empty:
                rank = None
            if rank is not None:
                last = trace.strip().splitlines()[-1]
                return rank, f"rank {rank} failed: {last}\n--- rank {rank}'s traceback ---\n{trace}"
            waited = time.monotonic() - start
            dead = [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if p.exitcode not in (None, 0)]
            if dead and waited > 1.0:  # it had a second to report
                return dead[0][0], f"rank {dead[0][0]} exited with code {dead[0][1]} without a report"
            if waited > grace:
                return None

    def close(self, notify: bool = True) -> None:
        """Stop every other rank (join within ``JOIN_DEADLINE_S``, then kill) and end the groups;
        ``notify=False`` after a failure: externally launched ranks then leave at their deadline."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.close)
        if notify and not self.procs and hasattr(self, "state"):
            try:
                send_step(self.state, StepKind.STOP)
            except Exception:  # noqa: BLE001  (the other ranks are already gone)
                pass
        for wake in self.wakes:
            try:
                wake.send_bytes(b"x")
            except OSError:
                pass
            wake.close()
        deadline = time.monotonic() + JOIN_DEADLINE_S
        for proc in self.procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        destroy_parallel()
        if self._store is not None and os.path.exists(self._store):
            os.unlink(self._store)
