"""The routed-expert forms of one V2-Lite MoE layer, eager and compiled: before/after figures.

``gathered`` (each token's experts' weights indexed, einsum) was the only decode form before;
``sorted_by_expert`` (rows sorted by expert, one grouped matmul) reads each chosen expert once
without a host sync, its matmuls by ``torch._grouped_mm`` before and by the project's
``expert_rows_mm`` now where that runs (``ascend_graph/kernels/ops.py``); ``decode (now)`` is
what the model now runs (its MoE backend, ``ascend_graph.moe.backend``). Compiled forms go through the runner's
backend (Inductor with the single-row matmul pass). Bandwidth counts each distinct chosen
expert's weights once; the copy bandwidth is timed in the same rounds (the MoE's roofline).

``eager oneDNN pre-packed (not used)`` is a bound, not a model form: ``grouped``'s loop (one
linear pair per chosen expert, host-side counts) on weights packed for oneDNN the way Inductor's
freezing packs a linear's. It shows what the same matmuls reach without aten's per-call handling
of plain weights. The model does not use it: it needs a packed copy of every expert, as the plain
weights feed the fused batch-1 reduction and every other backend.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ascend_graph.compile import resolve_backend
from ascend_graph.config import GraphConfig
from ascend_graph import kernels
from ascend_graph.moe import RoutedExperts, select_moe_backend
from benchmarks.common import interleaved_medians
from benchmarks.compute import onednn_linear, onednn_packs, pack_for_onednn
from benchmarks.models import v2_lite_slice
from benchmarks.roofline import CopyProbe


PREPACKED = "eager oneDNN pre-packed (not used)"


class PrepackedExperts(RoutedExperts):
    """``RoutedExperts`` sharing another's weights, each expert's pair also packed for oneDNN."""

    def __init__(self, experts: RoutedExperts, rows_hint: int = 4) -> None:
        nn.Module.__init__(self)
        self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        with torch.no_grad():
            self.packed = [(pack_for_onednn(gu, rows_hint), pack_for_onednn(d, rows_hint))
                           for gu, d in zip(self.gate_up_proj, self.down_proj)]

    def expert_mlp(self, rows: Tensor, expert: int) -> Tensor:
        if not rows.shape[0]:
            return rows.new_empty(0, self.down_proj.shape[1])
        gate_up, down = self.packed[expert]
        gate, up = onednn_linear(rows, gate_up).chunk(2, dim=-1)
        return onednn_linear(F.silu(gate) * up, down)


def measure(tokens=(1, 8, 32), rounds: int = 5, calls: int = 2, config=None) -> dict:
    """Median ms and GB/s of every form at every token count (``config``: the V2-Lite slice's)."""
    config = config or v2_lite_slice()
    experts = RoutedExperts(config, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    x_, k = config.n_routed_experts, config.num_experts_per_tok
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * 2
    backend = resolve_backend(GraphConfig(enabled=True, backend="inductor"), "cpu")
    rows, probe = [], CopyProbe()
    prepacked = PrepackedExperts(experts) if onednn_packs(torch.bfloat16) else None
    for t in tokens:
        # the compiled partials share dynamo's one wrapper code object: a fresh cache per token count
        # keeps their compiles under its recompile limit
        torch._dynamo.reset()
        x = torch.randn(t, config.hidden_size, generator=gen).to(torch.bfloat16)
        w = torch.rand(t, k, generator=gen)
        ex = torch.stack([torch.randperm(x_, generator=gen)[:k] for _ in range(t)])
        grouped_mm = functools.partial(experts.sorted_by_expert, kernel=False)
        chosen = functools.partial(select_moe_backend("cpu", torch.bfloat16).decode, experts)  # a model's choice
        fns = {"eager gathered (before)": lambda: experts.gathered(x, w, ex),
               "eager sorted_by_expert, _grouped_mm (before)": lambda: grouped_mm(x, w, ex),
               "eager sorted_by_expert (now)": lambda: chosen(x, w, ex)}
        for name, form in (("compiled gathered (before)", experts.gathered),
                           ("compiled decode, _grouped_mm (before)", grouped_mm),
                           ("compiled sorted_by_expert",
                            functools.partial(experts.sorted_by_expert, kernel=kernels.available())),
                           ("compiled decode (now)", chosen)):
            fns[name] = (lambda f: lambda: f(x, w, ex))(torch.compile(form, backend=backend, fullgraph=True,
                                                                      dynamic=False))
        if prepacked is not None:
            with torch.no_grad():
                diff = (prepacked.grouped(x, w, ex) - experts.grouped(x, w, ex)).abs().max().item()
            if diff > 0.05:  # same sums (bf16 rows); a mis-packed expert would be far off
                raise AssertionError(f"pre-packed experts differ from the plain ones by {diff} at T={t}")
            fns[PREPACKED] = lambda: prepacked.grouped(x, w, ex)
        fns["copy"] = probe
        with torch.no_grad():
            times = interleaved_medians(fns, rounds=rounds, calls_per_round=calls, warmup=2)
        copy_s = times.pop("copy")
        nbytes = int(ex.unique().numel()) * per_expert
        rows.append({"tokens": t, "experts_used": int(ex.unique().numel()), "bytes": nbytes,
                     "copy_bytes_per_s": probe.bytes / copy_s,
                     **{name: {"ms": s * 1e3, "GB_per_s": nbytes / s / 1e9} for name, s in times.items()}})
        print(f"  MoE T={t}: " + "  ".join(f"{n} {s * 1e3:.1f} ms" for n, s in times.items()), flush=True)
    return {"rows": rows}
