"""Does one MLA decode step cost more when the KV cache is bigger? It should not.

Times one decode attention step (the cache write and absorbed MLA decode) at a fixed batch and
context for two cache capacities, eager and compiled (the project's Inductor backend, as the
runner compiles a CPU step), next to the same step as
vllm-ascend's old eager MLA decode wrote it: ``torch.cat([kv_c, k_pe], -1)`` of the WHOLE caches
every step, then attention over the fused tensor. The tuple step reads only the blocks in the
batch's tables, so t(big)/t(small) should stay near 1; the fused step grows with capacity.

    python benchmarks/attention_capacity.py [--json out.json] [--batch 8 --context 512 ...]

Shape legend: B batch, H heads, Dn / R / Dv / C as in ``ascend_graph.attention.mla``,
N num_blocks, S block_size, T block-table token slots.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Callable

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ascend_graph.attention import build_attention_metadata, mla_decode  # noqa: E402
from ascend_graph.attention.paging import gather_rows, masked_softmax, valid_slots  # noqa: E402
from ascend_graph.kv_cache import MLACacheSpec, allocate_kv_caches, write_slots  # noqa: E402
from benchmarks.common import conditions as machine_conditions  # noqa: E402

TARGET_RATIO = 1.15


def tuple_step(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv, scale):
    """This project's step: in-place write, attention over the two cache tensors separately."""
    write_slots(cache.kv_c, cache.k_pe, kv_c, k_pe, meta.slot_mapping)
    return mla_decode(q_nope, q_pe, cache, meta.decode, w_uk, w_uv, scale)


def fused_step(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv, scale):
    """The old eager MLA decode: concatenate both whole caches every step, attend over the result."""
    write_slots(cache.kv_c, cache.k_pe, kv_c, k_pe, meta.slot_mapping)
    fused = torch.cat([cache.kv_c, cache.k_pe], dim=-1)  # [N, S, 1, C + R]: the whole cache, copied
    c = cache.kv_c.shape[-1]
    rows = gather_rows(fused, meta.decode.block_tables).squeeze(2)  # [B, T, C + R]
    q = torch.cat([torch.einsum("bhd,hdc->bhc", q_nope, w_uk), q_pe], dim=-1)  # [B, H, C + R]
    mask = valid_slots(meta.decode.context_lens, rows.shape[1])[:, None, :]  # [B, 1, T]
    probs = masked_softmax(torch.einsum("bhk,btk->bht", q, rows), mask, scale).to(rows.dtype)
    o_lat = torch.einsum("bht,btc->bhc", probs, rows[..., :c])  # [B, H, C]
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv)


def blocks_needed(args: argparse.Namespace) -> int:
    """Distinct blocks the batch would own without sharing."""
    return args.batch * -(-args.context // args.block_size)


def make_inputs(args: argparse.Namespace, num_blocks: int) -> tuple:
    """A cache of ``num_blocks`` and a decode batch whose tables are spread over all of it.

    Block ids are drawn in random order from all live blocks; when the batch needs more blocks
    than the cache has, ids repeat across rows (as shared prefixes do), which costs the same.
    """
    dtype = getattr(torch, args.dtype)
    (cache,) = allocate_kv_caches([MLACacheSpec(args.kv_lora_rank, args.rope, dtype)], num_blocks,
                                  args.block_size, huge_pages=not args.no_huge_pages)
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-args.context // args.block_size)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = [[ids[(b * per_seq + j) % len(ids)] for j in range(per_seq)] for b in range(args.batch)]
    _, meta = build_attention_metadata(tables, [args.context - 1] * args.batch, [1] * args.batch,
                                       block_size=args.block_size, num_blocks=num_blocks,
                                       max_model_len=args.context)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    b, h, c, r = args.batch, args.heads, args.kv_lora_rank, args.rope
    return (rnd(b, h, args.qk_nope), rnd(b, h, r), rnd(b, 1, c), rnd(b, 1, r), cache, meta,
            (rnd(h, c, args.qk_nope) / c ** 0.5).transpose(1, 2),  # W_UK as the model stores it (kv_b_parts)
            rnd(h, args.v_head, c) / c ** 0.5,
            (args.qk_nope + r) ** -0.5)


def compiled(fn: Callable, paged: bool = True) -> Callable:
    """``fn`` compiled as the runner compiles a CPU decode step: the project's Inductor backend
    (C++ wrapper, the decode-matmul pass with its kernels, the generated cache write); ``paged``
    False: the pass's kernel multiplies a gathered copy of the cache rows instead of reading them
    in place (at batch 1, aten's ``mm`` does)."""
    from ascend_graph.compile.inductor import DecodeMatmulPass, make_backend
    from ascend_graph.config import GraphConfig

    backend = make_backend("inductor", GraphConfig(enabled=True, backend="inductor"), "cpu", None)
    if not paged:
        backend = dataclasses.replace(backend, config_patches={**backend.config_patches,
                                                               "post_grad_custom_post_pass": DecodeMatmulPass(
                                                                   paged_attention=False)})
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def variants(compile_too: bool, gathered: bool = False) -> list[tuple[str, str, Callable]]:
    """(step, mode, function) for every row of the table; ``gathered``: also the compiled tuple
    step over a gathered copy of the rows."""
    rows = [("tuple (kv_c, k_pe)", "eager", tuple_step), ("fused cat (old way)", "eager", fused_step)]
    if compile_too:
        rows += [(step, "compiled", compiled(fn)) for step, _, fn in rows]
        if gathered:
            rows.append(("tuple, over gathered KV", "compiled", compiled(tuple_step, paged=False)))
    return rows


def measure(args: argparse.Namespace, probes: dict[str, Callable] | None = None,
            settle: dict[str, Callable] | None = None, before: dict[str, Callable] | None = None) -> list[dict]:
    """Every variant at every capacity, side by side in this process.

    Repetitions are interleaved (one call of each variant and capacity per round), so load from
    other processes falls on all of them alike instead of on whichever ran last. ``probes``
    (name -> function) are timed in the same rounds; their medians land in ``args.probe_ms``.
    ``settle`` (probe name -> function) runs untimed right after that probe, ``before`` right
    before it.
    """
    settle, before = settle or {}, before or {}
    inputs = {n: make_inputs(args, n) for n in args.num_blocks}
    rows = variants(not args.no_compile, getattr(args, "gathered", False))
    for _, _, fn in rows:  # warm-up, which also compiles one static graph per capacity
        for n in args.num_blocks:
            for _ in range(args.warmup):
                fn(*inputs[n])
    probes = probes or {}
    times = {(step, mode, n): [] for step, mode, _ in rows for n in args.num_blocks}
    probe_times = {name: [] for name in probes}
    for _ in range(args.reps):
        for step, mode, fn in rows:
            for n in args.num_blocks:
                start = time.perf_counter()
                fn(*inputs[n])
                times[step, mode, n].append((time.perf_counter() - start) * 1e3)
        for name, fn in probes.items():
            if name in before:
                before[name]()
            start = time.perf_counter()
            fn()
            probe_times[name].append((time.perf_counter() - start) * 1e3)
            if name in settle:  # untimed: leaves the process as the next timed call expects it
                settle[name]()
    args.probe_ms = {name: statistics.median(ts) for name, ts in probe_times.items()}
    return [{"step": step, "mode": mode, "num_blocks": n, "median_ms": statistics.median(ts), "times_ms": ts}
            for (step, mode, n), ts in times.items()]


def table(results: list[dict], args: argparse.Namespace) -> str:
    """One row per (step, mode): median ms at each capacity and t(largest)/t(smallest)."""
    small, big = min(args.num_blocks), max(args.num_blocks)
    mib = lambda n: n * args.block_size * (args.kv_lora_rank + args.rope) * torch.finfo(  # noqa: E731
        getattr(torch, args.dtype)).bits / 8 / 2 ** 20
    lines = [f"{'step':<24}{'mode':<10}{f'N={small} ({mib(small):.1f} MiB)':>22}"
             f"{f'N={big} ({mib(big):.1f} MiB)':>24}{'ratio':>8}"]
    keys = dict.fromkeys((r["step"], r["mode"]) for r in results)
    for step, mode in keys:
        t = {r["num_blocks"]: r["median_ms"] for r in results if (r["step"], r["mode"]) == (step, mode)}
        ratio = t[big] / t[small]
        mark = ("  ok" if ratio <= TARGET_RATIO else "  over target") if step.startswith("tuple") else ""
        lines.append(f"{step:<24}{mode:<10}{t[small]:>19.3f} ms{t[big]:>21.3f} ms{ratio:>8.2f}{mark}")
    lines.append(f"ratio = t(N={big}) / t(N={small}); target for the tuple step <= {TARGET_RATIO}")
    shared = [n for n in args.num_blocks if blocks_needed(args) > n - 1]
    if shared:
        lines.append(f"N={', '.join(map(str, shared))}: the batch needs {blocks_needed(args)} blocks, more than "
                     "the cache's live ones, so some rows share blocks (same work per step)")
    return "\n".join(lines)


def conditions(args: argparse.Namespace) -> dict:
    """What the numbers were measured under."""
    return {**machine_conditions(),
            "dims": {k: getattr(args, k) for k in ("batch", "context", "heads", "qk_nope", "rope", "v_head",
                                                    "kv_lora_rank", "block_size", "dtype")},
            "num_blocks": args.num_blocks, "warmup": args.warmup, "reps": args.reps,
            "order": "repetitions interleaved across steps and capacities",
            "blocks_needed": blocks_needed(args),
            "statistic": "median wall time of one step (write + attention), ms"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512, help="tokens per sequence after this step")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--qk-nope", type=int, default=128)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--v-head", type=int, default=128)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, nargs="+", default=[256, 32768])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (0: torch's default); one thread is least disturbed by other load")
    p.add_argument("--no-compile", action="store_true", help="eager rows only")
    p.add_argument("--gathered", action="store_true",
                   help="also the compiled tuple step with the kernel over a gathered copy of the cache rows "
                        "(DecodeMatmulPass(paged_attention=False)), as before the paged forms")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="caches on 4 KiB pages (default: huge pages, as the GraphRunner allocates them on CPU)")
    p.add_argument("--json", help="write conditions and results here")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = measure(args)
    print(table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"conditions": conditions(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
