"""Decode attention alone at V2-Lite's dimensions: achieved bandwidth and cost against capacity.

One step is the cache write plus absorbed MLA decode over the tuple cache (``tuple_step`` of
``attention_capacity``), eager and compiled, at two cache capacities. Achieved bandwidth is the
bytes the step must read (each row's latent and rope cache, ``w_uk`` and ``w_uv``) over its time.

``gqa_decode`` times standard attention's decode (``paged_decode``, Llama-3-8B's heads) eager and
compiled against its former form; ``python -m benchmarks.attention`` runs it alone.
"""

from __future__ import annotations

import argparse

import torch

from ascend_graph.attention import DecodeMetadata, paged_decode
from ascend_graph.attention.paged import _gathered_decode
from ascend_graph.attention.mla import product_rows
from ascend_graph.attention.paging import by_rows, gather_rows, masked_softmax, valid_slots
from ascend_graph.kv_cache import KVCache
from benchmarks import attention_capacity as ac
from benchmarks.common import interleaved_medians, with_malloc
from benchmarks.roofline import CopyProbe


LLC_FLUSH_BYTES = 128 << 20  # read before a call: four times this machine's 32 MiB last-level cache


def _floor(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv, scale):
    """The decode attention's matmuls alone, over KV gathered beforehand: a bound on the step."""
    kv = ac.gather_rows(cache.kv_c, meta.decode.block_tables).squeeze(2).contiguous()  # [B, T, C]
    pe = ac.gather_rows(cache.k_pe, meta.decode.block_tables).squeeze(2).contiguous()  # [B, T, R]

    def run():  # the products as eager MLA decode takes them (float32 where aten emulates bf16)
        q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)
        kv_in, pe_in = product_rows(kv), product_rows(pe)
        scores = by_rows("bhc,btc->bht", q_lat, kv_in, kv.dtype) + by_rows("bhr,btr->bht", q_pe, pe_in, kv.dtype)
        probs = (scores.float() * scale).softmax(-1).to(kv.dtype)
        return torch.einsum("bhc,hvc->bhv", by_rows("bht,btc->bhc", probs, kv_in, kv.dtype), w_uv)
    return run


def measure(batch: int = 32, context: int = 2048, num_blocks=(256, 32768), reps: int = 7,
            dtype: str = "bfloat16", malloc_keeps_freed: bool = True) -> dict:
    """Rows of ``attention_capacity.measure`` plus bytes and bandwidth of every row.

    Also timed in the same rounds: the copy probe; the compiled tuple step under glibc's default
    malloc behaviour (``malloc_keeps_freed`` is the suite's setting); and the floor: the same
    einsums over KV already gathered into a contiguous tensor (no gather, no allocation of it).
    """
    args = ac.parse_args(["--batch", str(batch), "--context", str(context), "--dtype", dtype, "--threads", "0",
                          "--reps", str(reps), "--num-blocks", *map(str, num_blocks)])
    probe = CopyProbe()
    floor_inputs = ac.make_inputs(args, min(num_blocks))
    step = ac.compiled(ac.tuple_step)
    probes = {"copy": probe, "floor: matmuls over pre-gathered KV (eager)": _floor(*floor_inputs)}
    small_pages = argparse.Namespace(**{**vars(args), "no_huge_pages": True})
    for n in num_blocks:  # the compiled tuple step over caches on 4 KiB pages (the runner's are on huge pages)
        probes[f"compiled, cache on 4 KiB pages, N={n}"] = (lambda i: lambda: step(*i))(ac.make_inputs(small_pages, n))
    # At N=256 the batch's 4096 block-table entries share the cache's few blocks: its 4.5 MiB
    # stay in the last-level cache between calls, where N=32768's 80 MB of KV cannot. Evicting it
    # before each call puts both capacities on the same footing.
    flush, cold = torch.ones(LLC_FLUSH_BYTES // 4), {}
    for n in num_blocks:
        name = f"compiled, last-level cache evicted before each call, N={n}"
        probes[name] = (lambda i: lambda: step(*i))(ac.make_inputs(args, n))
        cold[name] = lambda: flush.sum()
    probes["compiled, glibc default malloc"] = with_malloc(False, lambda: step(*floor_inputs), malloc_keeps_freed)
    # glibc's default returns the step's temporaries to the kernel: without a call under the
    # suite's setting after it, the next timed call would pay their page faults again
    results = ac.measure(args, probes, settle={"compiled, glibc default malloc": lambda: step(*floor_inputs)},
                         before=cold)
    copy_bw = probe.bytes / (args.probe_ms["copy"] / 1e3)
    print(ac.table(results, args), flush=True)
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
             for name, ms in args.probe_ms.items() if name != "copy"]
    for r in extra:
        print(f"  {r['step']}: {r['median_ms']:.2f} ms, {r['share_of_copy_bandwidth']:.3f} of copy bandwidth")
    return {"conditions": ac.conditions(args), "rows": results + extra, "capacity_ratio": ratios,
            "copy_bytes_per_s": copy_bw, "malloc_keeps_freed_memory": malloc_keeps_freed}


def batch_one(context: int = 16384, reps: int = 9, dtype: str = "bfloat16") -> dict:
    """One sequence at a long context: the compiled step reading the cache blocks in place against
    the same step over a gathered copy of its rows (``DecodeMatmulPass(paged_attention=False)``:
    at batch 1 aten's ``mm`` of the copy, as before the paged forms took batch 1), timed
    interleaved over the same inputs; and whether the two outputs are equal."""
    args = ac.parse_args(["--batch", "1", "--context", str(context), "--dtype", dtype, "--threads", "0"])
    num_blocks = ac.blocks_needed(args) + 64  # the sequence's blocks, and some it does not name
    args.num_blocks = [num_blocks]
    inputs = ac.make_inputs(args, num_blocks)
    fns = {"in_place": ac.compiled(ac.tuple_step), "gathered": ac.compiled(ac.tuple_step, paged=False)}
    outs = {name: fn(*inputs) for name, fn in fns.items()}  # compiles each
    t = interleaved_medians({name: (lambda f: lambda: f(*inputs))(fn) for name, fn in fns.items()}, rounds=reps,
                            calls_per_round=1, warmup=2)
    res = {"context": context, "num_blocks": num_blocks, "in_place_ms": t["in_place"] * 1e3,
           "gathered_ms": t["gathered"] * 1e3, "same_output": bool(torch.equal(outs["in_place"], outs["gathered"]))}
    print(f"  attention batch 1, context {context}: in place {res['in_place_ms']:.2f} ms, over a gathered copy "
          f"{res['gathered_ms']:.2f} ms", flush=True)
    return res


def _former_gqa_decode(q, cache, decode, scale):
    """``paged_decode`` as it was before 2026-12-01: the products over the gathered
    ``[B, T, Hk, D]`` rows, in the cache's dtype."""
    b, hq, d = q.shape
    hk = cache.k.shape[2]
    k = gather_rows(cache.k, decode.block_tables)
    v = gather_rows(cache.v, decode.block_tables)
    scores = torch.einsum("bkgd,btkd->bkgt", q.view(b, hk, hq // hk, d), k)
    mask = valid_slots(decode.context_lens, k.shape[1])[:, None, None, :]
    probs = masked_softmax(scores, mask, scale).to(v.dtype)
    return torch.einsum("bkgt,btkd->bkgd", probs, v).reshape(b, hq, d)


def gqa_decode(batch: int = 8, context: int = 1024, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
               block_size: int = 16, reps: int = 7, dtype: str = "bfloat16") -> dict:
    """Standard attention's decode (``paged_decode`` over a ``(k, v)`` tuple cache, Llama-3-8B's
    heads) eager and compiled, against its two earlier forms: over gathered rows heads first
    (``paged._gathered_decode``, its form until 2026-12-01 16:40 and still where the kernel does
    not take the products) and before that over the gathered ``[B, T, Hk, D]`` rows
    (``_former_gqa_decode``); all six timed interleaved over the same inputs; each output's
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
    exact = _former_gqa_decode(q.double(), KVCache(kc.double(), vc.double()), inputs[2], inputs[3])
    fns = {"eager": paged_decode, "gathered_eager": _gathered_decode, "former_eager": _former_gqa_decode}
    fns.update({name.replace("eager", "compiled"): ac.compiled(fn) for name, fn in list(fns.items())})
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


if __name__ == "__main__":  # the standard-attention probe alone, as the suite runs it
    from benchmarks.common import set_malloc_keeps_freed_memory

    torch.set_num_threads(1)
    set_malloc_keeps_freed_memory(True)
    gqa_decode()
