"""Per-call time of a small decode-like step under Inductor option sets, measured side by side.

Compares, on CPU, Inductor's default Python wrapper with ``cpp_wrapper=True`` and with
``freezing=True`` (weights folded as constants; applied only under ``torch.no_grad``), and both.
The step is what the runner compiles per capture size, shrunk: per layer a QKV projection, the
in-place cache write (``write_slots`` through ``write_kv_cache``'s op), paged decode attention
over the tuple cache, an output projection; then a small LM head and a softmax. Caches are graph
inputs, marked static, and mutated in place every call.

Variants run interleaved (round robin over many rounds), so drift in the machine's speed hits
them alike. Each variant's output and cache writes are checked against eager first.

    TORCHINDUCTOR_COMPILE_THREADS=1 python benchmarks/inductor_options.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ascend_graph.attention import DecodeMetadata, paged_decode  # noqa: E402
from ascend_graph.kv_cache import KVCache, KVCacheSpec, allocate_kv_caches, write_slots  # noqa: E402
from benchmarks.common import conditions as machine_conditions  # noqa: E402

VARIANTS = {
    "eager": None,
    "default": {},
    "cpp_wrapper": {"cpp_wrapper": True},
    "freezing": {"freezing": True},
    "cpp_wrapper+freezing": {"cpp_wrapper": True, "freezing": True},
}


class DecodeStep(nn.Module):
    """A few small linears, the cache write, paged attention, an LM head and a softmax."""

    def __init__(self, layers: int, hidden: int, heads: int, head_dim: int, vocab: int):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.ModuleList(nn.Linear(hidden, 3 * heads * head_dim) for _ in range(layers))
        self.out = nn.ModuleList(nn.Linear(heads * head_dim, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, x, kv_caches: tuple[KVCache, ...], slot_mapping, decode: DecodeMetadata):
        b = x.shape[0]
        for qkv, out, cache in zip(self.qkv, self.out, kv_caches):
            q, k, v = qkv(x).view(b, 3, self.heads, self.head_dim).unbind(1)  # [B, H, D] each
            write_slots(cache.k, cache.v, k, v, slot_mapping)
            x = x + out(paged_decode(q, cache, decode, self.head_dim ** -0.5).reshape(b, -1))
        return self.head(x).softmax(-1)


def make_inputs(batch: int, args, gen: torch.Generator):
    """Hidden states, fresh caches, and decode metadata for ``batch`` rows of ``args.context`` tokens."""
    spec = KVCacheSpec(args.heads, args.head_dim)
    blocks_per_row = -(-args.context // args.block_size)
    caches = allocate_kv_caches([spec] * args.layers, 1 + batch * blocks_per_row, args.block_size)
    for cache in caches:
        for t in cache:
            t.normal_(generator=gen)
            torch._dynamo.mark_static_address(t)
    tables = torch.arange(1, 1 + batch * blocks_per_row, dtype=torch.int32).view(batch, blocks_per_row)
    pos = args.context - 1
    slots = (tables[:, pos // args.block_size].long() * args.block_size + pos % args.block_size)
    decode = DecodeMetadata(tables, torch.full((batch,), args.context, dtype=torch.int32))
    x = torch.randn(batch, args.hidden, generator=gen)
    return x, caches, slots, decode


def per_call_seconds(fn, inputs, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn(*inputs)
    return (time.perf_counter() - start) / calls


def check_against_eager(model, compiled, batch, args) -> float:
    """Max abs difference of output and caches between eager and the compiled step."""
    ref = make_inputs(batch, args, torch.Generator().manual_seed(batch))
    got = make_inputs(batch, args, torch.Generator().manual_seed(batch))
    out_ref, out_got = model(*ref), compiled(*got)
    diffs = [(out_ref - out_got).abs().max().item()]
    for c_ref, c_got in zip(ref[1], got[1]):
        diffs += [(a - b).abs().max().item() for a, b in zip(c_ref, c_got)]
    return max(diffs)


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 256
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 256
    model = DecodeStep(args.layers, args.hidden, args.heads, args.head_dim, args.vocab).eval()
    results = {"conditions": conditions(args), "per_call_us": {}, "compile_s": {}, "max_abs_diff": {}}
    with torch.no_grad():
        for batch in args.batches:
            compiled, timings = {}, {name: [] for name in VARIANTS}
            for name, options in VARIANTS.items():
                t0 = time.perf_counter()
                fn = model if options is None else torch.compile(
                    model, backend="inductor", options=options or None, fullgraph=True, dynamic=False)
                results["max_abs_diff"][f"{name}/b{batch}"] = check_against_eager(model, fn, batch, args)
                results["compile_s"][f"{name}/b{batch}"] = round(time.perf_counter() - t0, 2)
                compiled[name] = fn
            inputs = make_inputs(batch, args, torch.Generator().manual_seed(0))
            for _ in range(args.rounds):
                for name, fn in compiled.items():
                    per_call_seconds(fn, inputs, 3)  # re-warm after the other variants ran
                    timings[name].append(per_call_seconds(fn, inputs, args.calls))
            for name, ts in timings.items():
                us = statistics.median(ts) * 1e6
                results["per_call_us"][f"{name}/b{batch}"] = round(us, 1)
                print(f"batch {batch:3d}  {name:22s} {us:9.1f} us/call  "
                      f"(min {min(ts) * 1e6:.1f}, max {max(ts) * 1e6:.1f})", flush=True)
    return results


def conditions(args) -> dict:
    return {
        **machine_conditions(), "threads": args.threads, "layers": args.layers,
        "hidden": args.hidden, "heads": args.heads, "head_dim": args.head_dim, "vocab": args.vocab,
        "context": args.context, "block_size": args.block_size, "rounds": args.rounds,
        "calls_per_round": args.calls, "statistic": "median over rounds of the mean per call",
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/inductor_options.json")
    args = p.parse_args()
    results = run(args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
