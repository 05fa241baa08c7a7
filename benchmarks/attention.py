"""Decode attention alone at V2-Lite's dimensions: bandwidth, and cost against cache capacity.

One step is the cache write plus absorbed MLA decode over the tuple cache (``tuple_step``), eager
and compiled (the project's Inductor backend, as the runner compiles a CPU step), at two cache
capacities, next to the same step as vllm-ascend's old eager MLA decode wrote it
(``attention_forms.fused_step``: ``torch.cat([kv_c, k_pe], -1)`` of the whole caches every step).
The tuple step reads only the blocks in the batch's tables, so t(big) / t(small) should stay near
1; the fused step grows with capacity. Achieved bandwidth is the bytes the step must read (each
row's latent and rope cache, ``w_uk`` and ``w_uv``) over its time; ``ascend_graph::decode_attention``
alone reads the live cache (each row's latent and rope rows) at the bytes/s of those bytes over
its time, next to the copy probe in the same rounds (results from before ``d413631`` also hold
it against the products it replaced, ``op_against_before``; those ops are gone). ``batch_one``
compares the compiled step reading the blocks in place with the same step over a gathered copy;
``gqa_decode`` times standard attention's decode (``paged_decode``, Llama-3-8B's heads) against its
earlier forms.

    python -m benchmarks.attention [--batch 8 --context 512 --dtype bfloat16 ...] [--json out.json]
    python -m benchmarks.attention --gqa       # the standard-attention probe alone, as the suite runs it

Shape legend: B batch, H heads, Dn / R / Dv / C as in ``ascend_graph.attention.mla``,
N num_blocks, S block_size, T block-table token slots.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Callable

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from ascend_graph.attention import DecodeMetadata, build_attention_metadata, mla_decode, paged_decode  # noqa: E402
from ascend_graph.attention.mla import product_rows  # noqa: E402
from ascend_graph.attention.cpu import CpuMLA, CpuPaged  # noqa: E402
from ascend_graph.attention.reference import ReferenceMLA  # noqa: E402
from ascend_graph.attention.paging import by_rows, gather_rows  # noqa: E402
from ascend_graph.kv_cache import KVCache, MLACacheSpec, allocate_kv_caches, write_slots  # noqa: E402
from benchmarks.attention_forms import former_gqa_decode, fused_step, live_blocks  # noqa: E402
from benchmarks.common import conditions as machine_conditions  # noqa: E402
from benchmarks.common import interleaved_medians, set_malloc_keeps_freed_memory, with_malloc  # noqa: E402
from benchmarks.roofline import CopyProbe  # noqa: E402

LLC_FLUSH_BYTES = 128 << 20  # read before a call: four times this machine's 32 MiB last-level cache

def tuple_step(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv, scale):
    """This project's step: in-place write, attention over the two cache tensors separately, by
    the backend a model chooses for the cache (the CPU kernel reading the blocks in place where
    it runs, else the reference over gathered rows)."""
    in_place = CpuMLA.supports(cache.kv_c.device, cache.kv_c.dtype)
    backend = _BACKENDS["in_place" if in_place else "gathered"]
    backend.write(cache, kv_c, k_pe, meta.slot_mapping)
    return backend.decode(q_nope, q_pe, cache, meta.decode, w_uk, w_uv, scale)


def gathered_step(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv, scale):
    """The same step through the reference backend: the products over gathered cache rows."""
    write_slots(cache.kv_c, cache.k_pe, kv_c, k_pe, meta.slot_mapping)
    return mla_decode(q_nope, q_pe, cache, meta.decode, w_uk, w_uv, scale)


_BACKENDS = {"in_place": CpuMLA(), "gathered": ReferenceMLA()}


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


def compiled(fn: Callable) -> Callable:
    """``fn`` compiled as the runner compiles a CPU decode step: the project's Inductor backend
    (C++ wrapper, the decode-matmul pass with its kernels, the generated cache write)."""
    from ascend_graph.compile.inductor import make_backend
    from ascend_graph.config import GraphConfig

    backend = make_backend("inductor", GraphConfig(enabled=True, backend="inductor"), "cpu", None)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def variants(compile_too: bool, gathered: bool = False) -> list[tuple[str, str, Callable]]:
    """(step, mode, function) for every row of the table; ``gathered``: also the compiled tuple
    step over a gathered copy of the rows."""
    rows = [("tuple (kv_c, k_pe)", "eager", tuple_step), ("fused cat (old way)", "eager", fused_step)]
    if compile_too:
        rows += [(step, "compiled", compiled(fn)) for step, _, fn in rows]
        if gathered:
            rows.append(("tuple, over gathered KV", "compiled", compiled(gathered_step)))
    return rows


def measure_capacity(args: argparse.Namespace, probes: dict[str, Callable] | None = None,
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
    """One row per (step, mode): median ms at each capacity and t(largest) / t(smallest)."""
    small, big = min(args.num_blocks), max(args.num_blocks)
    lines = [f"{'step':<24}{'mode':<10}{f'N={small} ms':>14}{f'N={big} ms':>14}{'ratio':>8}"]
    for step, mode in dict.fromkeys((r["step"], r["mode"]) for r in results):
        t = {r["num_blocks"]: r["median_ms"] for r in results if (r["step"], r["mode"]) == (step, mode)}
        lines.append(f"{step:<24}{mode:<10}{t[small]:>14.3f}{t[big]:>14.3f}{t[big] / t[small]:>8.2f}")
    return "\n".join(lines)


def conditions(args: argparse.Namespace) -> dict:
    """What the numbers were measured under."""
    return {**machine_conditions(),
            "dims": {k: getattr(args, k) for k in ("batch", "context", "heads", "qk_nope", "rope", "v_head",
                                                    "kv_lora_rank", "block_size", "dtype")},
            "num_blocks": args.num_blocks, "warmup": args.warmup, "reps": args.reps,
            "blocks_needed": blocks_needed(args)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
                        "(the reference attention backend), as before the paged forms")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="caches on 4 KiB pages (default: huge pages, as the GraphRunner allocates them on CPU)")
    p.add_argument("--json", help="write conditions and results here")
    p.add_argument("--gqa", action="store_true", help="time standard attention's decode (gqa_decode) instead")
    return p.parse_args(argv)


def _floor(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv, scale):
    """The decode attention's matmuls alone, over KV gathered beforehand: a bound on the step."""
    kv = gather_rows(cache.kv_c, meta.decode.block_tables).squeeze(2).contiguous()  # [B, T, C]
    pe = gather_rows(cache.k_pe, meta.decode.block_tables).squeeze(2).contiguous()  # [B, T, R]

    def run():  # the products as eager MLA decode takes them (float32 where aten emulates bf16)
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)
        kv_in, pe_in = product_rows(kv), product_rows(pe)
        scores = by_rows("bhc,btc->bht", q_lat, kv_in, kv.dtype) + by_rows("bhr,btr->bht", q_pe, pe_in, kv.dtype)
        probs = (scores.float() * scale).softmax(-1).to(kv.dtype)
        return torch.einsum("bhc,hvc->bhv", by_rows("bht,btc->bhc", probs, kv_in, kv.dtype), w_uv)
    return run


def _alone(form: Callable, q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv, scale):
    """MLA decode's attention alone (``attention_forms.live_blocks``) on the step's latent query."""
    q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk).to(cache.kv_c.dtype)  # [B, H, C]
    return lambda: form(q_lat, q_pe, cache, meta.decode, scale)


def measure(batch: int = 32, context: int = 2048, num_blocks=(256, 32768), reps: int = 7,
            dtype: str = "bfloat16", malloc_keeps_freed: bool = True) -> dict:
    """Rows of ``measure_capacity`` plus bytes and bandwidth of every row.

    Also timed in the same rounds: the copy probe; the compiled tuple step under glibc's default
    malloc behaviour (``malloc_keeps_freed`` is the suite's setting); and the floor: the same
    einsums over KV already gathered into a contiguous tensor (no gather, no allocation of it).
    """
    args = parse_args(["--batch", str(batch), "--context", str(context), "--dtype", dtype, "--threads", "0",
                          "--reps", str(reps), "--num-blocks", *map(str, num_blocks)])
    probe = CopyProbe()
    floor_inputs = make_inputs(args, min(num_blocks))
    step = compiled(tuple_step)
    probes = {"copy": probe, "floor: matmuls over pre-gathered KV (eager)": _floor(*floor_inputs)}
    small_pages = argparse.Namespace(**{**vars(args), "no_huge_pages": True})
    for n in num_blocks:  # the compiled tuple step over caches on 4 KiB pages (the runner's are on huge pages)
        probes[f"compiled, cache on 4 KiB pages, N={n}"] = (lambda i: lambda: step(*i))(make_inputs(small_pages, n))
    # At N=256 the batch's 4096 block-table entries share the cache's few blocks: its 4.5 MiB
    # stay in the last-level cache between calls, where N=32768's 80 MB of KV cannot. Evicting it
    # before each call puts both capacities on the same footing.
    flush, cold = torch.ones(LLC_FLUSH_BYTES // 4), {}
    for n in num_blocks:
        name = f"compiled, last-level cache evicted before each call, N={n}"
        probes[name] = (lambda i: lambda: step(*i))(make_inputs(args, n))
        cold[name] = lambda: flush.sum()
    probes["compiled, glibc default malloc"] = with_malloc(False, lambda: step(*floor_inputs), malloc_keeps_freed)
    ops = [dt for dt in dict.fromkeys((dtype, "float32")) if CpuMLA.supports(torch.device("cpu"), getattr(torch, dt))]
    op_inputs = {dt: make_inputs(argparse.Namespace(**{**vars(args), "dtype": dt}), blocks_needed(args) + 64)
                 for dt in ops}  # over blocks all distinct (the batch's and 64 more), as at N=32768
    probes.update({f"op alone, {dt}": _alone(live_blocks, *i) for dt, i in op_inputs.items()})
    # glibc's default returns the step's temporaries to the kernel: without a call under the
    # suite's setting after it, the next timed call would pay their page faults again
    results = measure_capacity(args, probes, settle={"compiled, glibc default malloc": lambda: step(*floor_inputs)},
                         before=cold)
    copy_bw = probe.bytes / (args.probe_ms["copy"] / 1e3)
    print(table(results, args), flush=True)
    item = 2 if dtype in ("bfloat16", "float16") else 4
    kv = batch * context * (args.kv_lora_rank + args.rope) * item
    weights = 2 * args.heads * args.qk_nope * args.kv_lora_rank * item
    for r in results:
        r["bytes"] = kv + weights
        r["bytes_per_s"] = r["bytes"] / (r["median_ms"] / 1e3)
        r["share_of_copy_bandwidth"] = r["bytes_per_s"] / copy_bw
    small, big = min(num_blocks), max(num_blocks)
    ratios = {}
    for r in results:
        if r["num_blocks"] == big:
            base = next(s for s in results if (s["step"], s["mode"], s["num_blocks"]) == (r["step"], r["mode"], small))
            ratios[f"{r['step']}/{r['mode']}"] = r["median_ms"] / base["median_ms"]
    pages = [args.probe_ms[f"compiled, cache on 4 KiB pages, N={n}"] for n in (small, big)]
    ratios["tuple (kv_c, k_pe)/compiled, cache on 4 KiB pages"] = pages[1] / pages[0]
    evicted = [args.probe_ms[f"compiled, last-level cache evicted before each call, N={n}"] for n in (small, big)]
    ratios["tuple (kv_c, k_pe)/compiled, last-level cache evicted"] = evicted[1] / evicted[0]
    extra = [{"step": name, "mode": "probe", "num_blocks": int(name.rsplit("N=", 1)[1]) if "N=" in name else small,
              "median_ms": ms,
              "bytes": kv + weights, "bytes_per_s": (kv + weights) / (ms / 1e3),
              "share_of_copy_bandwidth": (kv + weights) / (ms / 1e3) / copy_bw}
             for name, ms in args.probe_ms.items() if name != "copy" and not name.startswith("op alone")]
    for r in extra:
        print(f"  {r['step']}: {r['median_ms']:.2f} ms, {r['share_of_copy_bandwidth']:.3f} of copy bandwidth")
    op = {dt: _op_row(args, dt, args.probe_ms[f"op alone, {dt}"], copy_bw) for dt in ops}
    return {"conditions": conditions(args), "rows": results + extra, "capacity_ratio": ratios,
            "copy_bytes_per_s": copy_bw, "malloc_keeps_freed_memory": malloc_keeps_freed, "op_alone": op}


def _op_row(args: argparse.Namespace, dtype: str, ms: float, copy_bw: float) -> dict:
    """The op alone in ``dtype``: its time, the live cache's bytes (what it must read) over it."""
    live = args.batch * args.context * (args.kv_lora_rank + args.rope) * getattr(torch, dtype).itemsize
    row = {"ms": ms, "live_cache_bytes": live, "copy_bytes_per_s": copy_bw, "bytes_per_s": live / (ms / 1e3),
           "share_of_copy_bandwidth": live / (ms / 1e3) / copy_bw}
    print(f"  decode_attention alone, {dtype}: {ms:.2f} ms, {row['bytes_per_s'] / 1e9:.2f} GB/s of live cache, "
          f"{row['share_of_copy_bandwidth']:.3f} of copy bandwidth", flush=True)
    return row


def batch_one(context: int = 16384, reps: int = 9, dtype: str = "bfloat16") -> dict:
    """One sequence at a long context: the compiled step reading the cache blocks in place against
    the same step over a gathered copy of its rows (``gathered_step``, the reference backend:
    at batch 1 aten's ``mm`` of the copy, as before the paged forms took batch 1), timed
    interleaved over the same inputs; and whether the two outputs are equal."""
    args = parse_args(["--batch", "1", "--context", str(context), "--dtype", dtype, "--threads", "0"])
    num_blocks = blocks_needed(args) + 64  # the sequence's blocks, and some it does not name
    args.num_blocks = [num_blocks]
    inputs = make_inputs(args, num_blocks)
    fns = {"in_place": compiled(tuple_step), "gathered": compiled(gathered_step)}
    outs = {name: fn(*inputs) for name, fn in fns.items()}  # compiles each
    t = interleaved_medians({name: (lambda f: lambda: f(*inputs))(fn) for name, fn in fns.items()}, rounds=reps,
                            calls_per_round=1, warmup=2)
    res = {"context": context, "num_blocks": num_blocks, "in_place_ms": t["in_place"] * 1e3,
           "gathered_ms": t["gathered"] * 1e3, "same_output": bool(torch.equal(outs["in_place"], outs["gathered"]))}
    print(f"  attention batch 1, context {context}: in place {res['in_place_ms']:.2f} ms, over a gathered copy "
          f"{res['gathered_ms']:.2f} ms", flush=True)
    return res


def gqa_decode(batch: int = 8, context: int = 1024, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
               block_size: int = 16, reps: int = 7, dtype: str = "bfloat16") -> dict:
    """Standard attention's decode (``paged_decode`` over a ``(k, v)`` tuple cache, Llama-3-8B's
    heads) eager and compiled, against its two earlier forms: over gathered rows heads first
    (``paged.paged_decode``, the reference backend: its second form and still where the kernel
    does not take the products) and before that over the gathered ``[B, T, Hk, D]`` rows
    (``former_gqa_decode``); all six timed interleaved over the same inputs; each output's
    largest difference from a float64 oracle."""
    gen = torch.Generator().manual_seed(0)
    per = context // block_size
    num_blocks = batch * per + 4
    kc, vc = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(getattr(torch, dtype))
              for _ in range(2))
    tables = torch.randperm(num_blocks, generator=gen)[:batch * per].view(batch, per).int()
    lens = torch.randint(1, context + 1, (batch,), generator=gen).int()
    q = torch.randn(batch, heads, head_dim, generator=gen).to(kc.dtype)
    inputs = (q, KVCache(kc, vc), DecodeMetadata(tables, lens), head_dim ** -0.5)
    exact = former_gqa_decode(q.double(), KVCache(kc.double(), vc.double()), inputs[2], inputs[3])
    chosen = CpuPaged().decode if CpuPaged.supports(kc.device, kc.dtype) else paged_decode  # a model's choice
    fns = {"eager": chosen, "gathered_eager": paged_decode, "former_eager": former_gqa_decode}
    fns.update({name.replace("eager", "compiled"): compiled(fn) for name, fn in list(fns.items())})
    errors = {name: (fn(*inputs).double() - exact).abs().max().item() for name, fn in fns.items()}
    t = interleaved_medians({name: (lambda f: lambda: f(*inputs))(fn) for name, fn in fns.items()}, rounds=reps,
                            calls_per_round=1, warmup=1)
    res = {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
           "dtype": dtype, **{f"{name}_ms": t[name] * 1e3 for name in fns},
           "max_abs_error": errors, "graph_over_eager": t["eager"] / t["compiled"]}
    print(f"  GQA decode, batch {batch}, context {context}, {heads}/{kv_heads} heads of {head_dim}: eager "
          f"{res['eager_ms']:.1f} ms, compiled {res['compiled_ms']:.1f} ms; over gathered rows heads first "
          f"{res['gathered_eager_ms']:.1f} / {res['gathered_compiled_ms']:.1f} ms; former form "
          f"{res['former_eager_ms']:.1f} / {res['former_compiled_ms']:.1f} ms", flush=True)
    return res


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.gqa:
        set_malloc_keeps_freed_memory(True)
        print(json.dumps(gqa_decode(), indent=2))
        return
    results = measure_capacity(args)
    print(table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"conditions": conditions(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
