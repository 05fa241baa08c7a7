"""The graph runner over several ranks: the decisions its ranks take together, on the host.

A model split over ranks holds collectives, and a collective waits until every rank of its group
reaches it: ranks that disagree on what a step runs (graph or eager, which capture size, how
many rows an eager MoE pads to) wait for each other until their deadline. So every such decision
is taken together over the parallel state's host group (``distributed.agree``), within its
deadline:

- at start-up, every rank has the same capture sizes, block size and model length;
- at capture, each compile's outcome (a size that failed on one rank fails on all, before any
  rank runs it) and then the sizes that have a graph (the intersection);
- under data parallel, each step: the most decode rows and tokens any rank brings, and whether
  every rank can run it as a graph (any prefill, a forced eager step or a mode off makes every
  rank eager). Graph steps pad to the capture size of the most rows; eager steps pad the MoE's
  rows to the most tokens (``dp_step``). A rank without sequences runs an all-padding step, its
  logits ``[0, V]``. Tensor-parallel ranks of one replica get the same batch from their caller,
  so their steps agree by construction (checked at start-up, not per step).

Parity reruns that one rank would take alone (``compare_step``'s routing near-tie swaps) are not
run when ranks run in lockstep: the step's report says a mismatch as it is.

Shape legend: n decode rows, T tokens, s capture size, V vocabulary.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..attention import AttentionMetadata, DecodeMetadata
from ..attention.metadata import DECODE_PADDING
from ..distributed import ParallelState, agree, all_or_none, dp_step
from .step import PreparedStep, SequenceStep

if TYPE_CHECKING:  # pragma: no cover
    from .graph_runner import GraphRunner


class DPPlan(NamedTuple):
    """What every data-parallel rank runs in one step: the capture size (None: eagerly) and the
    tokens an eager step's MoE pads its rows to."""

    size: Optional[int]
    tokens: int


def check_same_on_every_rank(state: ParallelState, **values) -> None:
    """``ValueError`` on every rank, naming each setting whose value differs across ranks (each
    value an int, or anything with a stable ``repr``, compared by digest)."""
    if state.host.size == 1:
        return
    ints = [v if isinstance(v, int) else zlib.crc32(repr(v).encode()) for v in values.values()]
    high = agree(ints, "max", state, what="the runner's settings")
    low = agree(ints, "min", state, what="the runner's settings")
    differ = [name for name, hi, lo in zip(values, high, low) if hi != lo]
    if differ:
        raise ValueError(f"every rank must run the same {', '.join(differ)}; rank {state.rank} has "
                         + ", ".join(f"{name}={values[name]!r}" for name in differ))


def check_same_settings(runner: "GraphRunner") -> None:
    """At start-up: every rank has the runner's graph mode, capture sizes, compile groups, block
    size and model length."""
    check_same_on_every_rank(runner.parallel, graph_mode=runner.config.enabled, capture_sizes=runner.capture_sizes,
                             compile_groups=sorted({g.label for g in runner.compile_groups.values()}),
                             block_size=runner.block_size, max_model_len=runner.max_model_len)


def drop_sizes_missing_elsewhere(runner: "GraphRunner") -> None:
    """After capture: a size with a graph here but not on another rank runs eagerly on every rank,
    counted and warned as a failed compile."""
    have = runner.graph_sizes
    for size in sorted(set(have) - common_graph_sizes(runner.parallel, runner.capture_sizes, have)):
        del runner._graphs[size]
        runner._compile_failed(size, RuntimeError("no graph of this size on another rank"),
                               f"capture size {size} runs eagerly on every rank")


def agreeing_compile(backend: Callable, state: ParallelState, what: str) -> Callable:
    """``backend`` whose every compile ends on all ranks alike: if it fails on any rank, it raises
    on every rank (the failed rank its own error, the others ``RankFailure``), before any rank
    runs the graph and waits in its collectives for a rank that will not come."""
    def compile_graph(gm: torch.fx.GraphModule, example_inputs: list, **kwargs):
        with all_or_none(f"compiling {what}", state):
            compiled = backend(gm, example_inputs, **kwargs)
        return compiled
    return compile_graph


def common_graph_sizes(state: ParallelState, capture_sizes: Sequence[int], have: Sequence[int]) -> set[int]:
    """The capture sizes that have a graph on every rank."""
    sizes = sorted(capture_sizes)
    if state.host.size == 1:
        return set(have)
    flags = agree([int(s in have) for s in sizes], "min", state, what="which capture sizes compiled")
    return {s for s, ok in zip(sizes, flags) if ok}


def agree_plan(runner: "GraphRunner", step: Optional[PreparedStep], mode: str) -> tuple[DPPlan, str]:
    """The step every data-parallel rank runs (one host all-reduce), and why it runs eagerly here
    ("" for a graph); ``step`` None: this rank is idle. ``mode="graph"`` on any rank and no graph
    for the step: ``ValueError`` on every rank."""
    n = step.meta.num_decode_tokens if step else 0
    decode_only = step is None or step.meta.is_decode_only
    if mode == "eager":
        local_reason = "forced"
    elif not decode_only:
        local_reason = "mixed" if n else "prefill"
    else:
        local_reason = "" if runner.config.enabled else "disabled"
    tokens = len(step.input_ids) if step else 1  # an idle eager step runs one padding row
    most_rows, most_tokens, someone_eager, someone_forces_graph = agree(
        [n, tokens, int(bool(local_reason)), int(mode == "graph")], "max", runner.parallel,
        what="the data-parallel step (rows, tokens, graph or eager)")
    size, reason = (None, local_reason or "dp_peer") if someone_eager else runner._graph_size(most_rows, True, "auto")
    if someone_forces_graph and size is None:
        raise ValueError(f"mode='graph' is impossible for this data-parallel step: {reason}")
    return DPPlan(size, most_tokens), reason


@contextmanager
def planned(runner: "GraphRunner", plan: DPPlan) -> Iterator[None]:
    """Within the block, ``runner.run_prepared`` runs ``plan`` (parity's eager and graph runs)."""
    runner._dp_plan = plan
    try:
        yield
    finally:
        runner._dp_plan = None


def execute_dp(runner: "GraphRunner", seqs: Sequence[SequenceStep], mode: str) -> Tensor:
    """One data-parallel step of ``runner`` (``GraphRunner.execute``'s contract; ``seqs`` may be
    empty: this rank's replica is idle and runs an all-padding step)."""
    step = runner.prepare(seqs) if seqs else None
    plan, reason = agree_plan(runner, step, mode)
    if step is None:
        return idle_step(runner, plan, runner._parity.due() if plan.size else False)
    with planned(runner, plan):
        return runner.run_counted(step, plan.size, reason)


def idle_step(runner: "GraphRunner", plan: DPPlan, compared: bool) -> Tensor:
    """This rank's part of a step its replica has no sequences for: the same collectives as the
    other ranks' step (``compared``: their parity check's eager run, then the graph), on padding
    rows that write only into the null block; ``[0, V]`` logits."""
    runner.stats.idle_steps += 1
    runner._addresses.check()
    if plan.size is None or compared:
        with dp_step(plan.tokens):
            logits = runner._run_eager(padding_step(runner, 1))[:0]
        if plan.size is None:
            return logits
    runner.static.pad(plan.size)
    return runner._call_graph(plan.size, 0, () if runner._host_lens else None)


def padding_step(runner: "GraphRunner", rows: int) -> PreparedStep:
    """``rows`` decode rows of padding (``DECODE_PADDING``): no context, slots in the null block."""
    pad = lambda name, *shape, dtype=torch.int64: torch.full(shape, DECODE_PADDING[name], dtype=dtype)  # noqa: E731
    meta = AttentionMetadata(pad("slot_mapping", rows),
                             DecodeMetadata(pad("block_tables", rows, runner.table_width, dtype=torch.int32),
                                            pad("context_lens", rows, dtype=torch.int32),
                                            (0,) * rows if runner._host_lens else None), None)
    return PreparedStep(pad("input_ids", rows), pad("positions", rows), meta, list(range(rows)),
                        torch.arange(rows))
