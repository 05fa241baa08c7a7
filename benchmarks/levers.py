"""Inductor levers on the V2-Lite slice's decode step, each measured against the default.

Every variant is a runner over the same model (its own cache), captured at one batch size and
timed interleaved with the others: the default backend (C++ wrapper, the decode-matmul pass:
2-64-row bf16 matmuls as ``ascend_graph::rows_mm``, and where ``kernels.ONE_ROW_KERNEL`` says so for
the kernel's build (AVX2 and AVX512-BF16), single-row bf16 matmuls over row-major weights as ``rows_mm``
too and one token's routed experts as ``expert_rows_mm``, elsewhere as generated reductions; the
cache write generated), with the other choice for
those single-row matmuls and that token (``ONE_ROW``), without that pass, without its split of long
reductions, with the few-row
matmuls left to aten, without the C++ wrapper, with the C++ wrapper compiled in one -O3 unit with
its kernels (``WRAPPER_WITH_KERNELS``; the default builds them apart, the wrapper at -O1), with the
cache write called as the custom op (as before ``inline_cache_writes``), with the weights of long rows row-major instead of chunk-major (``ChunkedLinear``; in
graph and in eager mode), and with Inductor's freezing (``GraphConfig.inductor.freezing_min_batch``: the weights
become graph constants, pre-packed for oneDNN). Freezing has to be on while dynamo traces, not only while Inductor compiles: passed as a
compile option alone it finds no constant to fold (parameters are graph inputs) and changes
nothing. Freezing's memory cost is measured in ``benchmarks/memory.py`` (fresh processes).
``AOTInductor package``: ``GraphConfig.inductor.aot`` (torch.export + AOTInductor, compiled
into a temporary directory; the same Inductor options as the default). ``attention products in
aten``: the pass without the kernel for batched bf16 products (``batched_rows_kernel=False``).
MLA decode's attention is one ``decode_attention`` call, which the pass leaves alone, so what this
lever still moves to aten are the heads' products by ``W_UK`` and ``W_UV``, which take the kernel
on AVX2 only (``BATCHED_LIMITS``): on AVX512-BF16 it is the default step under another name.
``attention over gathered KV``: the reference attention backend, a gathered copy of the cache rows
whose scores and values the pass gives to the kernel (``expert_rows_mm``, ``rows_bmm``), the form
before the cache was read in place; at batch 1 those products then run as aten's ``mm`` of the
gathered copy (the pass's batch-1 rewrite). Run alone, e.g. at a longer context:

    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.levers --batches 1 --context 2048 \
        --names default "attention over gathered KV"

``--toy`` runs the first lever study instead, not part of the suite: stock Inductor's option sets
(``OPTION_SETS``: the Python wrapper, ``cpp_wrapper``, ``freezing`` under ``torch.no_grad``, both)
on a small decode-like step (``ToyStep``: per layer a QKV projection, the in-place cache write,
paged decode attention over a static tuple cache, an output projection; a small LM head), each
checked against eager first, timed round robin; written to ``benchmarks/results/inductor_options.json``.

    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.levers --toy [--toy-dims hidden=64,vocab=128]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from typing import NamedTuple

import torch
from torch import nn

from ascend_graph.attention import DecodeMetadata, paged_decode
from ascend_graph.compile.inductor import InductorBackend, DecodeMatmulPass, config_patches
from ascend_graph.engine.block_manager import BlockManager
from ascend_graph.config import GraphConfig
from ascend_graph.kv_cache import KVCache, KVCacheSpec, allocate_kv_caches, write_slots
from benchmarks.common import conditions, interleaved_medians, set_malloc_keeps_freed_memory, write_json
from benchmarks.models import (build, cases, decode_batch, make_runner, with_backends,
                               with_row_major_long_rows)

ROW_MAJOR = "row-major long rows"
AOT = "AOTInductor package"
OP_WRITE = "cache write as the op's call"
FEW_ROWS = "few-row matmuls in aten"
BATCHED = "attention products in aten"
GATHERED = "attention over gathered KV"  # the reference attention backend
MOE_GATHERED = "MoE experts gathered"  # the gathered MoE backend (one token: a fused reduction)
NO_PASS = "without decode-matmul pass"
WRAPPER_WITH_KERNELS = "C++ wrapper built with its kernels"  # one -O3 unit, as before the separate build
ONE_ROW = {True: "one-row products in the kernel", False: "one-row products as reductions"}


def one_row_in_kernel() -> bool:
    """The default here: the compiled step's one-row bf16 products as ``rows_mm`` (True), or as
    generated reductions; the levers measure the other choice (``ONE_ROW``)."""
    return DecodeMatmulPass().one_row_kernel


class Variant(NamedTuple):
    """One lever: the graph config and Inductor patches, on which copy of the model, in which mode."""

    config: GraphConfig
    patches: dict
    row_major: bool = False  # on ``with_row_major_long_rows(model)``
    backends: tuple = ()  # (attention, moe) names: on ``with_backends(model, *backends)``
    mode: str = "graph"
    inline_writes: bool = True  # the cache write generated (the default on CPU), or the op called


def variants(config: GraphConfig, package_dir: str) -> dict[str, Variant]:
    """Name -> the lever's variant (``package_dir``: where the AOTInductor variant compiles to)."""
    default = config_patches(config, "cpu")
    no_pass = {k: v for k, v in default.items() if k != "post_grad_custom_post_pass"}
    frozen = replace(config, inductor=replace(config.inductor, freezing_min_batch=1))
    no_split = {**default, "post_grad_custom_post_pass": DecodeMatmulPass(split_long_reductions=False)}
    few_rows_aten = {**default, "post_grad_custom_post_pass": DecodeMatmulPass(few_rows_kernel=False)}
    batched_aten = {**default, "post_grad_custom_post_pass": DecodeMatmulPass(batched_rows_kernel=False)}
    one_row = {**default, "post_grad_custom_post_pass": DecodeMatmulPass(one_row_kernel=not one_row_in_kernel())}
    return {"default": Variant(config, default), NO_PASS: Variant(config, no_pass),
            "without long-reduction split": Variant(config, no_split),
            FEW_ROWS: Variant(config, few_rows_aten), BATCHED: Variant(config, batched_aten),
            GATHERED: Variant(config, default, backends=("reference", None)),
            MOE_GATHERED: Variant(config, default, backends=(None, "gathered")),
            ONE_ROW[not one_row_in_kernel()]: Variant(config, one_row),
            "without C++ wrapper": Variant(config, {**default, "cpp_wrapper": False}),
            WRAPPER_WITH_KERNELS: Variant(config, {**default, "cpp_wrapper_build_separate": False}),
            OP_WRITE: Variant(config, default, inline_writes=False),
            ROW_MAJOR: Variant(config, default, row_major=True), "with freezing": Variant(frozen, default),
            AOT: Variant(replace(config, inductor=replace(config.inductor, aot=True), compile_cache_dir=package_dir),
                         default),
            "eager": Variant(config, default, mode="eager"),
            f"eager, {ROW_MAJOR}": Variant(config, default, row_major=True, mode="eager")}


def check_names(names) -> None:
    """Refuse lever names that are not variants (before anything is built or timed)."""
    if names is None:
        return
    known = tuple(variants(GraphConfig(enabled=True, backend="inductor"), "unused").keys())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"names: no lever called {', '.join(map(repr, unknown))}; expected some of {known}")


def measure(batches=(1, 8), rounds: int = 5, quick: bool = False, names=None, context: int | None = None) -> dict:
    """Median step time of every variant (or of ``names``) at every batch size, at ``context``
    tokens (default: the suite's V2-Lite context)."""
    check_names(names)
    case = cases(quick)["v2_lite_slice"]
    if context is not None:
        case = replace(case, context=context)
    model, rows = build(case), []
    row_major = with_row_major_long_rows(model)
    copies = {v.backends: with_backends(model, *v.backends)
              for v in variants(GraphConfig(enabled=True, backend="inductor"), "unused").values() if v.backends}
    for n in batches:
        config = GraphConfig(enabled=True, backend="inductor", capture_sizes=(n,), max_batch_size=n)
        fns, packages = {}, tempfile.TemporaryDirectory(prefix="ag-levers-aoti-")
        for name, v in variants(config, packages.name).items():
            if names is not None and name not in names:
                continue
            # the AOTInductor variant compiles its own way
            backend = None if v.config.inductor.aot else InductorBackend(v.patches, inline_writes=v.inline_writes)
            on = row_major if v.row_major else copies[v.backends] if v.backends else model
            runner = make_runner(on, v.config, (n,), case.context, backend=backend)
            if v.mode == "graph":
                runner.capture(show_progress=False)
            entries = decode_batch(runner, BlockManager(runner.num_blocks, runner.block_size), n, case.context)
            fns[name] = (lambda r, e, m: lambda: r.execute(e, mode=m))(runner, entries, v.mode)
        t = interleaved_medians(fns, rounds=rounds, calls_per_round=1, warmup=2)
        packages.cleanup()
        rows.append({"batch": n, **{k: v * 1e3 for k, v in t.items()}})
        print(f"  levers batch {n}: " + "  ".join(f"{k} {v * 1e3:.1f} ms" for k, v in t.items()), flush=True)
    return {"model": case.name, "context": case.context, "unit": "ms per step (median)",
            "one_row_products": "kernel" if one_row_in_kernel() else "reductions", "rows": rows}


OPTION_SETS = {"eager": None, "default": {}, "cpp_wrapper": {"cpp_wrapper": True}, "freezing": {"freezing": True},
               "cpp_wrapper+freezing": {"cpp_wrapper": True, "freezing": True}}
TOY_DIMS = {"layers": 2, "hidden": 256, "heads": 4, "head_dim": 32, "vocab": 1024, "context": 64, "block_size": 16}


class ToyStep(nn.Module):
    """A few small linears, the cache write, paged attention, an LM head and a softmax."""

    def __init__(self, layers: int, hidden: int, heads: int, head_dim: int, vocab: int, **_) -> None:
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


def _toy_inputs(batch: int, d: dict, seed: int) -> tuple:
    """Hidden states, fresh static caches and decode metadata for ``batch`` rows of ``d["context"]`` tokens."""
    gen, per_row = torch.Generator().manual_seed(seed), -(-d["context"] // d["block_size"])
    caches = allocate_kv_caches([KVCacheSpec(d["heads"], d["head_dim"])] * d["layers"], 1 + batch * per_row,
                                d["block_size"])
    for cache in caches:
        for t in cache:
            t.normal_(generator=gen)
            torch._dynamo.mark_static_address(t)
    tables = torch.arange(1, 1 + batch * per_row, dtype=torch.int32).view(batch, per_row)
    pos = d["context"] - 1
    slots = tables[:, pos // d["block_size"]].long() * d["block_size"] + pos % d["block_size"]
    decode = DecodeMetadata(tables, torch.full((batch,), d["context"], dtype=torch.int32))
    return torch.randn(batch, d["hidden"], generator=gen), caches, slots, decode


def _max_diff(model, fn, batch: int, d: dict) -> float:
    """Largest difference of output and caches between eager and ``fn`` on the same inputs."""
    ref, got = _toy_inputs(batch, d, batch), _toy_inputs(batch, d, batch)
    diffs = [(model(*ref) - fn(*got)).abs().max().item()]
    diffs += [(a - b).abs().max().item() for c_ref, c_got in zip(ref[1], got[1]) for a, b in zip(c_ref, c_got)]
    return max(diffs)


def toy_options(batches=(1, 4, 8), rounds: int = 15, calls: int = 100, dims: dict | None = None) -> dict:
    """Microseconds per call of ``ToyStep`` under each of ``OPTION_SETS``, timed round robin."""
    d = {**TOY_DIMS, **(dims or {})}
    torch._dynamo.config.cache_size_limit = 256
    model = ToyStep(**d).eval()
    res = {"conditions": {**conditions(), **d, "rounds": rounds, "calls_per_round": calls},
           "per_call_us": {}, "compile_s": {}, "max_abs_diff": {}}
    with torch.no_grad():
        for batch in batches:
            fns = {}
            for name, options in OPTION_SETS.items():
                start = time.perf_counter()
                fns[name] = model if options is None else torch.compile(
                    model, backend="inductor", options=options or None, fullgraph=True, dynamic=False)
                res["max_abs_diff"][f"{name}/b{batch}"] = _max_diff(model, fns[name], batch, d)
                res["compile_s"][f"{name}/b{batch}"] = round(time.perf_counter() - start, 2)
            inputs = _toy_inputs(batch, d, 0)
            times = {name: [] for name in fns}
            for _ in range(rounds):
                for name, fn in fns.items():
                    for _ in range(3):  # re-warm after the other variants ran
                        fn(*inputs)
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(*inputs)
                    times[name].append((time.perf_counter() - start) / calls)
            for name, ts in times.items():
                res["per_call_us"][f"{name}/b{batch}"] = round(statistics.median(ts) * 1e6, 1)
                print(f"  toy step batch {batch:3d} {name:22s} {res['per_call_us'][f'{name}/b{batch}']:9.1f} us/call",
                      flush=True)
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 (--toy: 1 4 8)")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--names", nargs="+", default=None, help="variants to run (default: all)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--toy", action="store_true", help="stock Inductor options on a toy step (OPTION_SETS)")
    p.add_argument("--toy-dims", default="", help="--toy: dims other than TOY_DIMS, e.g. hidden=64,vocab=128")
    p.add_argument("--json", default=None, help="--toy: default benchmarks/results/inductor_options.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    set_malloc_keeps_freed_memory(True)
    if args.toy:
        dims = {k: int(v) for k, v in (kv.split("=") for kv in args.toy_dims.split(",") if kv)}
        res = toy_options(tuple(args.batches or (1, 4, 8)), dims=dims)
        write_json(args.json or "benchmarks/results/inductor_options.json", res)
        return
    res = measure(tuple(args.batches or (1, 8)), rounds=args.rounds, names=args.names, context=args.context)
    write_json(args.json, res)


if __name__ == "__main__":
    main()
