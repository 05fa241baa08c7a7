"""What rank 0 tells the other ranks each step, and what they send back, over the host gloo group.

Only tensors travel (no pickle on any socket): a step is an int64 header ``[kind, arg, length]``
broadcast from rank 0, then ``length`` int64 values, the plan: for each data-parallel replica its
entries (``SequenceStep``: token ids, cached tokens, block table). Logits come back as float32
tensors, point to point, from each replica's tensor-parallel rank 0; reports (stats, parity) as
JSON bytes in uint8 tensors gathered from every rank. Every wait has the group's deadline
(``AgreementTimeout`` past it).

Plan layout: ``[replicas, (entries, (tokens, ids..., num_cached, blocks, block ids...)...)...]``.
"""

from __future__ import annotations

import json
from enum import IntEnum
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed import ParallelState, wait_within
from ..runner.step import SequenceStep

Plan = list[list[SequenceStep]]  # per data-parallel replica, its step's entries


class StepKind(IntEnum):
    """What the ranks do with a step (the header's first value)."""

    STOP = 0  # leave the worker loop
    RUN = 1  # runner.execute(entries)
    CHECK = 2  # compare_step(entries), arg = check_untouched; every rank reports
    EAGER = 3  # runner.execute(entries, mode="eager")
    CAPTURE = 4  # runner.capture()
    STATS = 5  # every rank reports its RunnerStats


def encode_plan(plan: Plan) -> list[int]:
    """``plan`` as a flat list of ints (layout in the module docstring)."""
    out = [len(plan)]
    for entries in plan:
        out.append(len(entries))
        for e in entries:
            out += [len(e.token_ids), *e.token_ids, e.num_cached, len(e.block_table), *e.block_table]
    return out


def decode_plan(values: Sequence[int]) -> Plan:
    """The plan ``encode_plan`` flattened."""
    it = iter(values)
    plan: Plan = []
    for _ in range(next(it)):
        entries = []
        for _ in range(next(it)):
            tokens = [next(it) for _ in range(next(it))]
            cached = next(it)
            entries.append(SequenceStep(tokens, cached, [next(it) for _ in range(next(it))]))
        plan.append(entries)
    return plan


def send_step(state: ParallelState, kind: StepKind, arg: int = 0, plan: Optional[Plan] = None) -> None:
    """Rank 0: broadcast the step's header, then its plan."""
    values = encode_plan(plan) if plan is not None else []
    header = torch.tensor([int(kind), arg, len(values)], dtype=torch.int64)
    wait_within(dist.broadcast(header, 0, group=state.host.pg, async_op=True), state, "step header")
    if values:
        payload = torch.tensor(values, dtype=torch.int64)
        wait_within(dist.broadcast(payload, 0, group=state.host.pg, async_op=True), state, "step plan")


def recv_step(state: ParallelState) -> tuple[StepKind, int, Optional[Plan]]:
    """Ranks > 0: the next step's kind, argument and plan (None when it has none)."""
    header = torch.zeros(3, dtype=torch.int64)
    wait_within(dist.broadcast(header, 0, group=state.host.pg, async_op=True), state, "step header")
    kind, arg, length = header.tolist()
    if not length:
        return StepKind(kind), arg, None
    payload = torch.zeros(length, dtype=torch.int64)
    wait_within(dist.broadcast(payload, 0, group=state.host.pg, async_op=True), state, "step plan")
    return StepKind(kind), arg, decode_plan(payload.tolist())


def send_logits(state: ParallelState, logits: Tensor) -> None:
    """A replica's tensor-parallel rank 0: its step's ``[n, V]`` float32 logits to rank 0."""
    wait_within(dist.isend(logits.float().cpu().contiguous(), 0, group=state.host.pg), state, "logits")


def recv_logits(state: ParallelState, src: int, rows: int, vocab: int) -> Tensor:
    """Rank 0: ``[rows, vocab]`` logits from rank ``src``."""
    out = torch.empty(rows, vocab, dtype=torch.float32)
    wait_within(dist.irecv(out, src, group=state.host.pg), state, "logits")
    return out


def gather_json(state: ParallelState, value) -> list:
    """Every rank's ``value`` (JSON-safe), in rank order, on every rank: lengths agreed first,
    then the JSON bytes as uint8 tensors padded to the longest."""
    data = json.dumps(value).encode()
    size = state.host.size
    lengths = torch.zeros(size, dtype=torch.int64)
    lengths[state.host.rank] = len(data)
    wait_within(dist.all_reduce(lengths, group=state.host.pg, async_op=True), state, "report lengths")
    longest = int(lengths.max())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
    wait_within(dist.all_gather(parts, mine, group=state.host.pg, async_op=True), state, "reports")
    return [json.loads(bytes(p[:n].tolist())) for p, n in zip(parts, lengths.tolist())]
