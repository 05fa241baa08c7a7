"""Decode attention alone, and the decode step against the block table's width and live context.

- ``mla``: one step of the model's MLA decode attention (the cache write, then absorbed MLA by the
  backend a model chooses: ``ascend_graph::decode_attention`` reading each row's live blocks where
  the CPU kernel runs), eager and compiled as the runner compiles a CPU step, at two cache
  capacities; the copy probe and the op alone (each row's live latent and rope rows, bf16 and
  float32) in the same rounds. *capacity ratio* t(N=32768) / t(N=256) should stay near 1.
- ``gqa``: standard attention's decode (``paged_decode`` over a ``(k, v)`` cache, Llama-3-8B's
  heads), the backend a model chooses, graph vs eager, each output against a float64 oracle.
- ``live_context``: the runner's graph step (``execute``, host preparation included) with one
  runner per max_model_len over the same cache blocks (t(L) / t(256), goal <= 1.15), and the widest
  runner at live contexts 64 .. 4096: a least-squares line whose slope is what one more token of
  context costs, its bytes over the slope beside the copy bandwidth. The caches hold seeded random
  entries (``models.filled_tables``), one per row and layer, so the MoE layers choose the same
  experts at every context.

    python -m benchmarks --parts attention live_context

Shape legend: B batch, H heads, Dn / R / Dv / C as in ``ascend_graph.attention.mla``, N num_blocks,
S block_size, T block-table token slots.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch

from ascend_graph.attention import DecodeMetadata, build_attention_metadata, paged_decode
from ascend_graph.attention.cpu import CpuMLA, CpuPaged
from ascend_graph.attention.reference import ReferenceMLA
from ascend_graph.config import GraphConfig
from ascend_graph.engine.block_manager import BlockManager
from ascend_graph.kv_cache import KVCache, MLACacheSpec, allocate_kv_caches
from benchmarks.common import interleaved_medians, interleaved_samples, linear_fit, ratio_of_rounds
from benchmarks.models import ModelCase, build, cases, decode_rows, filled_tables, make_runner, v2_lite_slice
from benchmarks.roofline import CopyProbe

STEP = "tuple (kv_c, k_pe)"  # the step's row name: the write and attention over the two cache tensors


@dataclasses.dataclass(frozen=True)
class Dims:
    """One MLA decode batch at V2-Lite's attention dimensions (``models.v2_lite_slice``)."""
    batch: int
    context: int
    dtype: str
    block_size: int = 16

    @property
    def mla(self):
        """The model's attention dimensions (a ``DeepseekConfig``)."""
        return v2_lite_slice()

    @property
    def blocks_needed(self) -> int:
        return self.batch * -(-self.context // self.block_size)

    def as_dict(self) -> dict:
        c = self.mla
        return {"batch": self.batch, "context": self.context, "heads": c.num_attention_heads,
                "qk_nope": c.qk_nope_head_dim, "rope": c.qk_rope_head_dim, "v_head": c.v_head_dim,
                "kv_lora_rank": c.kv_lora_rank, "block_size": self.block_size, "dtype": self.dtype}


def mla_step(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv, scale):
    """The model's step: the cache write, then decode by the backend a model chooses for the cache."""
    backend = CpuMLA() if CpuMLA.supports(cache.kv_c.device, cache.kv_c.dtype) else ReferenceMLA()
    backend.write(cache, kv_c, k_pe, meta.slot_mapping)
    return backend.decode(q_nope, q_pe, cache, meta.decode, w_uk, w_uv, scale)


def make_inputs(d: Dims, num_blocks: int) -> tuple:
    """A cache of ``num_blocks`` and a decode batch whose tables are spread over all of it (ids
    repeat across rows, as shared prefixes do, when the batch needs more blocks than it has)."""
    dtype, m = getattr(torch, d.dtype), d.mla
    (cache,) = allocate_kv_caches([MLACacheSpec(m.kv_lora_rank, m.qk_rope_head_dim, dtype)], num_blocks, d.block_size,
                                  huge_pages=True)
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-d.context // d.block_size)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = [[ids[(b * per_seq + j) % len(ids)] for j in range(per_seq)] for b in range(d.batch)]
    _, meta = build_attention_metadata(tables, [d.context - 1] * d.batch, [1] * d.batch, block_size=d.block_size,
                                       num_blocks=num_blocks, max_model_len=d.context)
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    b, h, c, r, dn = d.batch, m.num_attention_heads, m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim
    return (rnd(b, h, dn), rnd(b, h, r), rnd(b, 1, c), rnd(b, 1, r), cache, meta,
            (rnd(h, c, dn) / c ** 0.5).transpose(1, 2),  # W_UK as the model stores it: [H, Dn, C]
            rnd(h, m.v_head_dim, c) / c ** 0.5, (dn + r) ** -0.5)


def compiled(fn: Callable) -> Callable:
    """``fn`` compiled as the runner compiles a CPU decode step (the project's Inductor backend)."""
    from ascend_graph.compile.inductor import make_backend

    backend = make_backend("inductor", GraphConfig(enabled=True, backend="inductor"), "cpu", None)
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def _op_alone(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv, scale):
    """``ascend_graph::decode_attention`` alone on the step's latent query."""
    q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w_uk).to(cache.kv_c.dtype)  # [B, H, C]
    return lambda: torch.ops.ascend_graph.decode_attention(q_lat, q_pe, cache.kv_c, cache.k_pe, cache.kv_c,
                                                           meta.decode.block_tables, meta.decode.context_lens, scale)


def mla(batch: int = 32, context: int = 2048, num_blocks=(256, 32768), reps: int = 7,
        dtype: str = "bfloat16") -> dict:
    """The MLA step eager and compiled at each capacity, the op alone and the copy probe, in one
    set of rounds; bytes are each row's latent and rope cache plus ``w_uk`` and ``w_uv``."""
    d = Dims(batch, context, dtype)
    inputs = {n: make_inputs(d, n) for n in num_blocks}
    step = compiled(mla_step)
    fns = {(mode, n): (lambda f, i: lambda: f(*i))(fn, inputs[n])
           for mode, fn in (("eager", mla_step), ("compiled", step)) for n in num_blocks}
    fns = {f"{mode}/{n}": fn for (mode, n), fn in fns.items()}
    ops = [dt for dt in dict.fromkeys((dtype, "float32")) if CpuMLA.supports(torch.device("cpu"), getattr(torch, dt))]
    for dt in ops:  # over blocks all distinct (the batch's and 64 more), as at N=32768
        fns[f"op/{dt}"] = _op_alone(*make_inputs(dataclasses.replace(d, dtype=dt), d.blocks_needed + 64))
    probe = CopyProbe()
    fns["copy"] = probe
    samples = interleaved_samples(fns, rounds=reps, calls_per_round=1, warmup=2)
    t = {k: statistics.median(v) for k, v in samples.items()}
    copy_bw = probe.bytes / t["copy"]
    item = getattr(torch, dtype).itemsize
    m = d.mla
    latent = m.kv_lora_rank + m.qk_rope_head_dim
    nbytes = (batch * context * latent + 2 * m.num_attention_heads * m.qk_nope_head_dim * m.kv_lora_rank) * item
    rows = [{"step": STEP, "mode": mode, "num_blocks": n, "median_ms": t[f"{mode}/{n}"] * 1e3, "bytes": nbytes,
             "bytes_per_s": nbytes / t[f"{mode}/{n}"], "share_of_copy_bandwidth": nbytes / t[f"{mode}/{n}"] / copy_bw}
            for mode in ("eager", "compiled") for n in num_blocks]
    small, big = min(num_blocks), max(num_blocks)
    capacity = {f"{STEP}/{mode}": t[f"{mode}/{big}"] / t[f"{mode}/{small}"] for mode in ("eager", "compiled")}
    op = {}
    for dt in ops:
        live = batch * context * latent * getattr(torch, dt).itemsize
        op[dt] = {"ms": t[f"op/{dt}"] * 1e3, "live_cache_bytes": live, "copy_bytes_per_s": copy_bw,
                  "bytes_per_s": live / t[f"op/{dt}"], "share_of_copy_bandwidth": live / t[f"op/{dt}"] / copy_bw}
    print(f"  MLA decode attention, batch {batch}, context {context}: compiled {t[f'compiled/{small}'] * 1e3:.2f} ms, "
          f"capacity ratio {capacity[f'{STEP}/compiled']:.2f}, graph vs eager "
          f"{ratio_of_rounds(samples, f'eager/{small}', f'compiled/{small}')['ratio']:.2f}x", flush=True)
    return {"conditions": {"dims": d.as_dict(), "num_blocks": list(num_blocks), "reps": reps},
            "rows": rows, "capacity_ratio": capacity, "copy_bytes_per_s": copy_bw, "op_alone": op,
            "graph_vs_eager": ratio_of_rounds(samples, f"eager/{small}", f"compiled/{small}")}


def gqa(batch: int = 8, context: int = 1024, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
        block_size: int = 16, reps: int = 7, dtype: str = "bfloat16") -> dict:
    """Standard attention's decode, the backend a model chooses, eager and compiled over the same
    inputs in the same rounds; each output's largest difference from a float64 oracle."""
    gen = torch.Generator().manual_seed(0)
    per = context // block_size
    num_blocks = batch * per + 4
    kc, vc = (torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(getattr(torch, dtype))
              for _ in range(2))  # [N, S, Hk, D]
    tables = torch.randperm(num_blocks, generator=gen)[:batch * per].view(batch, per).int()
    lens = torch.randint(1, context + 1, (batch,), generator=gen).int()
    q = torch.randn(batch, heads, head_dim, generator=gen).to(kc.dtype)  # [B, H, D]
    inputs = (q, KVCache(kc, vc), DecodeMetadata(tables, lens), head_dim ** -0.5)
    exact = paged_decode(q.double(), KVCache(kc.double(), vc.double()), inputs[2], inputs[3])
    chosen = CpuPaged().decode if CpuPaged.supports(kc.device, kc.dtype) else paged_decode
    fns = {"eager": chosen, "compiled": compiled(chosen)}
    errors = {name: (fn(*inputs).double() - exact).abs().max().item() for name, fn in fns.items()}
    samples = interleaved_samples({name: (lambda f: lambda: f(*inputs))(fn) for name, fn in fns.items()},
                                  rounds=reps, calls_per_round=1, warmup=1)
    ratio = ratio_of_rounds(samples, "eager", "compiled")
    res = {"batch": batch, "context": context, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
           "dtype": dtype, **{f"{name}_ms": statistics.median(s) * 1e3 for name, s in samples.items()},
           "max_abs_error": errors, "graph_over_eager": ratio["ratio"], "graph_vs_eager": ratio}
    print(f"  GQA decode, batch {batch}, context {context}: eager {res['eager_ms']:.1f} ms, compiled "
          f"{res['compiled_ms']:.1f} ms", flush=True)
    return res


WIDTHS = (256, 4096, 32768)
CONTEXTS = (64, 128, 256, 512, 1024, 2048, 4096)
CASES = ("small_float32", "small_bfloat16", "v2_lite_slice_bfloat16")
SAMPLE_SECONDS = 0.02  # calls per round: enough for the fastest variant's sample to last this long


class Runners:
    """One graph runner per table width over one model, each with the same cache blocks holding
    the same random entries: ``rows`` sequences of ``longest`` tokens."""

    def __init__(self, case: ModelCase, widths: tuple[int, ...], sizes: tuple[int, ...], rows: int,
                 longest: int, block_size: int = 16) -> None:
        model, self.block_size = build(case), block_size
        num_blocks = 1 + rows * -(-longest // block_size)
        config = GraphConfig(enabled=True, backend="inductor", capture_sizes=sizes, max_batch_size=max(sizes))
        self.runners, self.tables = {}, {}
        for width in widths:
            runner = make_runner(model, config, sizes, longest, num_blocks=num_blocks, block_size=block_size,
                                 max_model_len=width)
            runner.capture(show_progress=False)
            self.runners[width] = runner
            self.tables[width] = filled_tables(runner, BlockManager(num_blocks, block_size), rows, longest)

    def step_fn(self, width: int, n: int, context: int):
        """One graph decode step of ``n`` rows at ``context`` tokens in the runner ``width`` wide."""
        runner = self.runners[width]
        steps = decode_rows(self.tables[width][:n], context, self.block_size, runner.model.config.vocab_size)
        return lambda: runner.execute(steps, mode="graph")


def _timed(fns: dict, rounds: int, pace: str) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Medians and samples of ``fns`` in the same rounds, as many calls a round as ``pace`` takes
    for ``SAMPLE_SECONDS``."""
    for fn in fns.values():
        fn(), fn()
    start = time.perf_counter()
    fns[pace]()
    calls = max(1, round(SAMPLE_SECONDS / (time.perf_counter() - start)))
    samples = interleaved_samples(fns, rounds=rounds, calls_per_round=calls, warmup=0)
    return {k: statistics.median(s) for k, s in samples.items()}, samples


def live_context_case(case: ModelCase, widths=WIDTHS, context: int = 256, sizes=(1, 8), contexts=CONTEXTS,
                      context_batch: int = 8, rounds: int = 9) -> dict:
    """Both sweeps for one model case (module docstring)."""
    captured, wide = tuple(sorted({*sizes, context_batch})), max(contexts)
    r = Runners(case, tuple(sorted({*widths, wide})), captured, max(captured), max(wide, context))
    width_rows, base = [], str(min(widths))
    for n in sizes:
        t, samples = _timed({str(w): r.step_fn(w, n, context) for w in widths}, rounds, base)
        width_rows.append({"batch": n, "step_s": t, "ratio": {k: v / t[base] for k, v in t.items()},
                           "rounds": {k: ratio_of_rounds(samples, k, base) for k in t if k != base}})
        print(f"  {case.name} {case.dtype_name} batch {n}, context {context}: "
              + "  ".join(f"max_model_len {w} {t[str(w)] * 1e3:.2f} ms" for w in widths), flush=True)
    t, _ = _timed({str(c): r.step_fn(wide, context_batch, c) for c in contexts}, rounds, str(min(contexts)))
    fit = linear_fit(list(contexts), [t[str(c)] for c in contexts])
    per_token = sum(x[0, 0].numel() * x.element_size() for cache in r.runners[wide].kv_caches for x in cache)
    probe = CopyProbe()  # after the sweep, not in its rounds: its 256 MiB would evict the step's weights
    copy_bw = probe.bytes / interleaved_medians({"copy": probe}, rounds=rounds, calls_per_round=1, warmup=1)["copy"]
    fit.update(cache_bytes_per_token=per_token, copy_bytes_per_s=copy_bw,
               context_bytes_per_s=context_batch * per_token / fit["slope"] if fit["slope"] > 0 else None)
    print(f"  {case.name} {case.dtype_name} batch {context_batch}: slope {fit['slope'] * 1e6:.3f} µs/token, "
          f"r2 {fit['r2']:.4f}", flush=True)
    return {"model": case.name, "dtype": case.dtype_name, "width": width_rows,
            "context": {"batch": context_batch, "max_model_len": wide, "step_s": t, "fit": fit}}


def live_context(names=CASES, widths=WIDTHS, context: int = 256, sizes=(1, 8), contexts=CONTEXTS,
                 context_batch: int = 8, rounds: int = 9, quick: bool = False) -> dict:
    """``live_context_case`` for every case in ``names`` (``<model>_<dtype>``)."""
    out = {"widths": list(widths), "context": context, "sizes": list(sizes), "contexts": list(contexts),
           "context_batch": context_batch, "rounds": rounds, "block_size": 16, "cases": {}}
    for name in names:
        model, dtype = name.rsplit("_", 1)
        case = dataclasses.replace(cases(quick)[model], dtype=getattr(torch, dtype))
        out["cases"][name] = live_context_case(case, widths, context, sizes, contexts, context_batch, rounds)
    return out
