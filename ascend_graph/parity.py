"""Parity: run one step as a graph and eagerly on the same caches, and compare everything.

The check snapshots the blocks the step writes, runs eager, restores them, runs the graph (so the
caches end as after a normal graph step), then compares the logits and the written blocks per
layer and element, and verifies that no other live block changed (padded rows write only into
the null block).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

import torch
from torch import Tensor

from .kv_cache import NULL_BLOCK

if TYPE_CHECKING:  # pragma: no cover
    from .runner import GraphRunner, PreparedStep, SequenceStep

# (atol, rtol) per dtype: float32 graphs differ from eager only by operation order;
# half types by a few units in the last place of the stored values. rtol is relative to the largest
# |value| of each row (a token's logits, a cached token's vector), not to each element: rounding
# errors of a product scale with its terms, so a logit near zero errs as much as the row's
# largest. Measured (ascend-graph parity --model small-v3 --dtype bfloat16, 32 steps, logits up to
# 3.2): against a float64 run of the same weights and caches, graph logits erred by up to 0.049
# (median 0.024) and eager's by up to 0.045 (median 0.030), leaving out 2 steps where both picked
# other experts than float64 (a routing near-tie); graph and eager, erring apart, differed by up
# to 0.064, which the former per-element rule (0.05 + 0.02 |value|) failed at 2 steps, on CPU
# and on CUDA alike. The row rule allows 0.10-0.11 there.
DEFAULT_TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (5e-2, 2e-2), torch.float16: (1e-2, 1e-2)}


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """``(atol, rtol)`` for values computed in ``dtype`` (float32's for any other dtype)."""
    return DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES[torch.float32])


def allowed_difference(eager: Tensor, atol: float, rtol: float) -> Tensor:
    """The largest graph-vs-eager difference accepted for each element: ``atol + rtol * max |eager|``
    over the element's row (the last dimension), broadcastable to ``eager``."""
    scale = eager.double().abs().amax(dim=-1, keepdim=True) if eager.numel() else eager.double()
    return atol + rtol * scale


def _diff(graph: Tensor, eager: Tensor) -> dict:
    g, e = graph.double(), eager.double()
    err = (g - e).abs()
    return {"max_abs": err.max().item() if err.numel() else 0.0,
            "max_rel": (err / e.abs().clamp_min(1e-6)).max().item() if err.numel() else 0.0}


def _close(graph: Tensor, eager: Tensor, atol: float, rtol: float) -> bool:
    return bool(torch.isfinite(graph).all()) and bool(
        ((graph.double() - eager.double()).abs() <= allowed_difference(eager, atol, rtol)).all())


@dataclass
class ParityReport:
    """Result of one graph-vs-eager comparison."""

    ok: bool
    batch_size: int
    logits: dict
    caches: list = field(default_factory=list)  # per layer: {element: {"max_abs", "max_rel"}}
    untouched_ok: Optional[bool] = None  # None when not checked
    graph_logits: Optional[Tensor] = None

    def summary(self) -> str:
        """One line for logs."""
        worst = max((d["max_abs"] for layer in self.caches for d in layer.values()), default=0.0)
        return (f"batch {self.batch_size}: {'OK' if self.ok else 'MISMATCH'}; logits max abs "
                f"{self.logits['max_abs']:.3g}; caches max abs {worst:.3g}; "
                f"untouched blocks {'unchecked' if self.untouched_ok is None else self.untouched_ok}")

    def to_dict(self) -> dict:
        """A JSON-safe copy (without the logits tensor)."""
        return {"ok": self.ok, "batch_size": self.batch_size, "logits": self.logits,
                "caches": self.caches, "untouched_ok": self.untouched_ok}


def compare_step(runner: "GraphRunner", seqs: Sequence["SequenceStep"], **kwargs) -> ParityReport:
    """Validate ``seqs`` and compare their step in graph and eager mode (see ``compare_prepared``)."""
    return compare_prepared(runner, runner.prepare(seqs), **kwargs)


def compare_prepared(runner: "GraphRunner", step: "PreparedStep", *, atol: Optional[float] = None,
                     rtol: Optional[float] = None, check_untouched: bool = True) -> ParityReport:
    """Run ``step`` eagerly and as a graph from the same cache state and compare.

    ``check_untouched`` also snapshots the whole cache to prove that no block other than the
    step's own changed (costs a copy of the cache; the runner's sampling turns it off).
    """
    caches = runner.kv_caches
    dtype = caches[0][0].dtype
    d_atol, d_rtol = tolerances(dtype)
    atol, rtol = atol if atol is not None else d_atol, rtol if rtol is not None else d_rtol
    live = sorted({s // runner.block_size for s in step.meta.slot_mapping.tolist() if s >= 0})
    written = torch.tensor(sorted({*live, NULL_BLOCK}), device=runner.device)
    before = _blocks(caches, written)
    full = [[t.clone() for t in cache] for cache in caches] if check_untouched else None

    eager_logits = runner.run_prepared(step, "eager")
    eager_blocks = _blocks(caches, written)
    _restore(caches, written, before)
    graph_logits = runner.run_prepared(step, "graph")
    graph_blocks = _blocks(caches, written)

    live_rows = [i for i, b in enumerate(written.tolist()) if b != NULL_BLOCK]
    layer_diffs, ok = [], _close(graph_logits, eager_logits, atol, rtol)
    for cache, g_layer, e_layer in zip(caches, graph_blocks, eager_blocks):
        diffs = {}
        for name, g, e in zip(cache._fields, g_layer, e_layer):
            diffs[name] = _diff(g[live_rows], e[live_rows])
            ok &= _close(g[live_rows], e[live_rows], atol, rtol)
        layer_diffs.append(diffs)
    untouched_ok = None if full is None else _untouched(caches, full, written)
    return ParityReport(ok=ok and untouched_ok is not False, batch_size=len(step.order),
                        logits=_diff(graph_logits, eager_logits), caches=layer_diffs,
                        untouched_ok=untouched_ok, graph_logits=graph_logits)


def _blocks(caches: tuple, blocks: Tensor) -> list[list[Tensor]]:
    return [[t[blocks].clone() for t in cache] for cache in caches]


def _restore(caches: tuple, blocks: Tensor, saved: list[list[Tensor]]) -> None:
    for cache, layer in zip(caches, saved):
        for t, s in zip(cache, layer):
            t[blocks] = s  # in place: the addresses stay


def _untouched(caches: tuple, full: list[list[Tensor]], written: Tensor) -> bool:
    keep = torch.ones(caches[0][0].shape[0], dtype=torch.bool, device=written.device)
    keep[written] = False
    return all(torch.equal(t[keep], s[keep]) for cache, layer in zip(caches, full) for t, s in zip(cache, layer))
