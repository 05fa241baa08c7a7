"""Decisions the ranks take together, on the host, over the state's gloo group, each within a
deadline: ``agree`` (the max / min / sum of a few ints across ranks: a batch's padded size, the
number of cache blocks, graph or eager) and ``all_or_none`` (a section that fails on one rank
raises on every rank, instead of leaving the others waiting in their next collective).

After a deadline passes, the group's ranks are out of step: the state must be destroyed.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from .state import ParallelState, get_parallel_state

_OPS = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "sum": dist.ReduceOp.SUM}


class AgreementTimeout(TimeoutError):
    """The other ranks did not reach an agreement within its deadline."""


class RankFailure(RuntimeError):
    """A section guarded by ``all_or_none`` failed on other ranks (``failed_ranks``) than this one."""

    def __init__(self, what: str, failed_ranks: list[int]) -> None:
        super().__init__(f"{what} failed on rank(s) {failed_ranks}")
        self.failed_ranks = failed_ranks


def agree(values: Sequence[int], op: str = "max", state: Optional[ParallelState] = None,
          timeout_s: Optional[float] = None, what: str = "agreement") -> list[int]:
    """``values`` reduced elementwise by ``op`` ("max", "min", "sum") across every rank; each rank
    passes as many values. Raises ``AgreementTimeout`` when the others are not there within
    ``timeout_s`` (the state's timeout when None). One process: ``values`` as they are."""
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    state = state or get_parallel_state()
    values = [int(v) for v in values]
    if state.host.size == 1:
        return values
    t = torch.tensor(values, dtype=torch.int64)
    wait_within(dist.all_reduce(t, op=_OPS[op], group=state.host.pg, async_op=True), state, what, timeout_s)
    return t.tolist()


def wait_within(work: dist.Work, state: ParallelState, what: str, timeout_s: Optional[float] = None) -> None:
    """Wait for an asynchronous collective ``work`` of the host group; ``AgreementTimeout`` naming
    ``what`` when the other ranks are not there within ``timeout_s`` (the state's when None) or left."""
    timeout_s = state.timeout_s if timeout_s is None else timeout_s
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise AgreementTimeout(f"{what}: rank {state.rank} waited {timeout_s:g} s for the other ranks "
                               f"({e})") from e


@contextmanager
def all_or_none(what: str, state: Optional[ParallelState] = None,
                timeout_s: Optional[float] = None) -> Iterator[None]:
    """Run the ``with`` body on every rank, then agree on whether it failed anywhere: the rank that
    failed re-raises its own exception, every other rank raises ``RankFailure`` naming it. A rank
    that never arrives makes the others raise ``AgreementTimeout`` within ``timeout_s``."""
    state = state or get_parallel_state()
    failure: Optional[Exception] = None
    try:
        yield
    except Exception as e:  # noqa: BLE001  (re-raised below, after the other ranks know)
        failure = e
    flags = [0] * state.host.size
    flags[state.host.rank] = int(failure is not None)
    try:
        failed = agree(flags, "max", state, timeout_s, what=f"{what} (did every rank succeed?)")
    except AgreementTimeout as e:
        if failure is not None:
            raise failure from e
        raise
    if failure is not None:
        raise failure
    if any(failed):
        raise RankFailure(what, [state.host.ranks[i] for i, f in enumerate(failed) if f])
