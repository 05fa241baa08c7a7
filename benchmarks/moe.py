"""One V2-Lite MoE layer's routed experts, graph vs eager, measured side by side in one run.

The layer is what the model runs: its MoE backend's decode (``ascend_graph.moe.select_moe_backend``),
eager and compiled by the runner's backend (Inductor with the decode-matmul pass). Bandwidth counts
each distinct chosen expert's weights once; the copy probe, timed in the same rounds, is the
layer's roofline (*share of copy bandwidth*).

    python -m benchmarks --parts moe
"""

from __future__ import annotations

import functools
import statistics

import torch

from ascend_graph.compile import resolve_backend
from ascend_graph.config import GraphConfig
from ascend_graph.moe import RoutedExperts, select_moe_backend
from benchmarks.common import interleaved_samples, ratio_of_rounds
from benchmarks.models import v2_lite_slice
from benchmarks.roofline import CopyProbe


def _experts(config) -> RoutedExperts:
    experts = RoutedExperts(config, torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return experts


def measure(tokens=(1, 8, 32), rounds: int = 5, calls: int = 2, config=None) -> dict:
    """Median ms and GB/s of the layer eager and compiled at every token count, and how many times
    faster the compiled layer ran, from the same rounds (``config``: the V2-Lite slice's)."""
    config = config or v2_lite_slice()
    experts, gen = _experts(config), torch.Generator().manual_seed(1)
    per_expert = 3 * config.hidden_size * config.moe_intermediate_size * 2  # gate, up, down in bf16
    backend = resolve_backend(GraphConfig(enabled=True, backend="inductor"), "cpu")
    decode = functools.partial(select_moe_backend("cpu", torch.bfloat16).decode, experts)  # a model's choice
    rows, probe = [], CopyProbe()
    for t in tokens:
        torch._dynamo.reset()  # one compile per token count, under dynamo's recompile limit
        x = torch.randn(t, config.hidden_size, generator=gen).to(torch.bfloat16)  # [T, E]
        w = torch.rand(t, config.num_experts_per_tok, generator=gen)  # [T, K]
        ex = torch.stack([torch.randperm(config.n_routed_experts, generator=gen)[:config.num_experts_per_tok]
                          for _ in range(t)])  # [T, K]
        compiled = torch.compile(decode, backend=backend, fullgraph=True, dynamic=False)
        fns = {"eager": lambda: decode(x, w, ex), "graph": lambda: compiled(x, w, ex), "copy": probe}
        with torch.no_grad():
            samples = interleaved_samples(fns, rounds=rounds, calls_per_round=calls, warmup=2)
        used = int(ex.unique().numel())
        nbytes = used * per_expert
        copy_s = statistics.median(samples["copy"])
        row = {"tokens": t, "experts_used": used, "bytes": nbytes, "copy_bytes_per_s": probe.bytes / copy_s}
        for name in ("eager", "graph"):
            s = statistics.median(samples[name])
            row[name] = {"ms": s * 1e3, "GB_per_s": nbytes / s / 1e9}
        row["graph_vs_eager"] = ratio_of_rounds(samples, "eager", "graph")
        rows.append(row)
        print(f"  MoE T={t}: eager {row['eager']['ms']:.2f} ms, graph {row['graph']['ms']:.2f} ms "
              f"({row['graph_vs_eager']['ratio']:.2f}x), {row['graph']['GB_per_s']:.1f} GB/s", flush=True)
    return {"rows": rows, "rounds": rounds, "calls_per_round": calls}
