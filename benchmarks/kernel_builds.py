"""Two builds of the native kernels (``ascend_graph/kernels/csrc/``) side by side in one process:
the sources at a git revision (the split sources, or the single ``expert_rows.c`` of revisions
before the split, under ``ascend_graph/kernels/csrc/`` or ``ascend_graph/models/``) against the
working tree's, for measuring a change to the kernels before and after. ``--isa avx2`` builds both
for AVX2 and FMA (``-march=native -mno-avx512f``: the AVX2 forms, tuned for this CPU), so a
machine with AVX512-BF16 times the AVX2 forms too.

Each call is timed in the thread's CPU time (``time.thread_time``), the builds' order swapped
every run: on a shared machine a call descheduled for other jobs would otherwise count the wait
(docs/cpu-kernels.md); contention for caches and memory still counts.

- ``rows``: GFLOP/s of ``expert_rows`` (one weight, ``r`` rows, what ``rows_mm`` runs) over a
  [12288, 2048] weight streamed from memory (four weights on 2 MiB pages taken in turn), bf16 or
  (``--dtype float32``) float32, on ``--threads`` threads, both builds interleaved, medians; each
  result checked against a float64 product.
- ``--moe``: ms of each build's ``expert_rows`` over V2-Lite's 64 routed gate/up weights at 1 and
  8 tokens (top-6, random distinct experts), 2 OpenMP threads, wall time, interleaved, medians;
  each output checked against float64.
- ``--attention``: ms of each build's ``decode_attention`` (``attention_run``) for MLA
  decode at V2-Lite's dimensions (batch 32, context 2048, 16 heads, latent 512 + rope 64, blocks of
  16, bfloat16), both builds interleaved, each output checked against float64 attention. A
  revision before ``decode_attention`` is refused for it (its ``rows`` still run).

A whole step before and after a change to the kernels: ``benchmarks.before_after`` (two
checkouts; the ops' kernels are linked into the build the package loads, so one process cannot
swap them).

    python -m benchmarks.kernel_builds --old 09f01da [--isa avx2] [--rows 1,2,4,8,16,32,64]
        [--dtype float32] [--threads 2] [--moe] [--attention]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ascend_graph import kernels  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# Compiler flags per --isa: the native build, and the AVX2 forms on a CPU that has AVX-512 too.
ISA_FLAGS = {"native": ["-march=native"], "avx2": ["-march=native", "-mno-avx512f"]}
OLD_PATHS = ("ascend_graph/kernels/csrc/expert_rows.c", "ascend_graph/models/expert_rows.c")


def build(sources: dict[str, str], out_dir: str, name: str, isa: str = "native") -> ctypes.CDLL:
    """``sources`` (file name -> C text: every ``.c`` and ``.h`` of one revision) built as
    ``kernels.build`` builds them (with ``ISA_FLAGS[isa]``), and bound (the entry points it has)."""
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    for file, text in sources.items():
        with open(os.path.join(d, file), "w") as f:
            f.write(text)
    cc = kernels.compiler()
    if cc is None:
        raise RuntimeError("kernel_builds: no C compiler ($CC, cc or gcc)")
    lib = os.path.join(out_dir, f"{name}.so")
    units = [os.path.join(d, file) for file in sorted(sources) if file.endswith(".c")]
    done = subprocess.run([cc, "-O3", *ISA_FLAGS[isa], "-fopenmp", "-shared", "-fPIC", *units, "-o", lib],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"kernel_builds: {name} does not build:\n{done.stderr}")
    dll = kernels.build._bind(ctypes.CDLL(lib), required=False)  # an older revision lacks later entry points
    if not dll.expert_rows_available():
        raise RuntimeError(f"kernel_builds: {name} has no kernel for this CPU")
    return dll


def sources_now() -> dict[str, str]:
    """The working tree's sources and headers (``kernels.build.source_files()``)."""
    found = {}
    for path in kernels.build.source_files():
        with open(path) as f:
            found[os.path.basename(path)] = f.read()
    return found


def sources_at(rev: str) -> dict[str, str]:
    """The sources and headers as git revision ``rev`` has them: every ``.c`` and ``.h`` under
    ``ascend_graph/kernels/csrc/`` where it has more than ``expert_rows.c``, else that one file
    where it lies (``OLD_PATHS``)."""
    def show(path: str) -> str:
        return subprocess.run(["git", "-C", REPO, "show", f"{rev}:{path}"], capture_output=True, text=True,
                              check=True).stdout

    listed = subprocess.run(["git", "-C", REPO, "ls-tree", "--name-only", rev, "ascend_graph/kernels/csrc/"],
                            capture_output=True, text=True).stdout.split()
    files = [p for p in listed if p.endswith((".c", ".h"))]
    if files and files != [OLD_PATHS[0]]:
        return {os.path.basename(p): show(p) for p in files}
    for path in OLD_PATHS:
        if subprocess.run(["git", "-C", REPO, "cat-file", "-e", f"{rev}:{path}"], capture_output=True).returncode == 0:
            return {"expert_rows.c": show(path)}
    raise RuntimeError(f"kernel_builds: no kernel sources at {rev}")


def alternating(dlls: dict[str, ctypes.CDLL], run: int) -> list[tuple[str, ctypes.CDLL]]:
    """The builds in order on even runs, reversed on odd ones: neither always runs second."""
    order = list(dlls.items())
    return order[::-1] if run % 2 else order


def rows_rates(dlls: dict[str, ctypes.CDLL], rows=(1, 2, 4, 8, 16, 32, 64), n: int = 12288, k: int = 2048,
               runs: int = 7, dtype: torch.dtype = torch.bfloat16, threads: int = 1) -> list[dict]:
    """Per row count, GFLOP/s of each build's ``expert_rows`` (``expert_rows_f32`` for float32) on
    ``threads`` OpenMP threads, medians of ``runs`` interleaved: one thread's CPU time, or wall time
    for more; each output within one bf16 rounding (float32: the float32 error bound of K products)
    of the float64 product (else ValueError). The weights lie on 2 MiB pages, as the runner puts a
    model's."""
    from ascend_graph.runtime import huge_page_buffer

    size = torch.finfo(dtype).bits // 8
    buf = huge_page_buffer(4 * n * k * size).view(dtype)
    buf.normal_()
    weights = [buf[i * n * k:(i + 1) * n * k].view(n, k) for i in range(4)]
    clock = time.thread_time if threads == 1 else time.perf_counter
    found, made = [], 0
    for r in rows:
        x, ends = torch.randn(r, k).to(dtype), torch.tensor([r], dtype=torch.int32)
        times: dict[str, list[float]] = {name: [] for name in dlls}
        for run in range(runs):
            for name, dll in alternating(dlls, run):
                w, out = weights[made % 4], torch.empty(r, n, dtype=dtype)
                entry = dll.expert_rows_f32 if dtype == torch.float32 else dll.expert_rows
                made += 1
                start = clock()
                entry(x.data_ptr(), w.data_ptr(), ends.data_ptr(), out.data_ptr(), 1, n, k, threads)
                times[name].append(clock() - start)
                exact = x.double() @ w.double().T
                if dtype == torch.float32:
                    bound = (x.double().abs() @ w.double().abs().T) * k * 2 ** -23
                else:
                    bound = exact.abs() * 2 ** -8 + 1e-3
                if not ((out.double() - exact).abs() <= bound).all():
                    raise ValueError(f"kernel_builds: {name} at {r} rows is not within one rounding")
        found.append({"rows": r, **{name: 2 * r * n * k / statistics.median(t) / 1e9 for name, t in times.items()}})
    return found


def moe_times(dlls: dict[str, ctypes.CDLL], tokens=(1, 8), experts: int = 64, top_k: int = 6, n: int = 2816,
              k: int = 2048, threads: int = 2, runs: int = 15) -> list[dict]:
    """Per token count, median ms (wall time: ``threads`` OpenMP threads) of each build's
    ``expert_rows`` over V2-Lite's routed gate/up weights (``experts`` x [n, k] bf16 on 2 MiB pages),
    each token's ``top_k`` distinct experts drawn at random, the rows sorted by expert as the MoE
    runs them; each output within one bf16 rounding of the float64 products (else ValueError)."""
    from ascend_graph.runtime import huge_page_buffer

    w = huge_page_buffer(experts * n * k * 2).view(torch.bfloat16).view(experts, n, k)
    w.normal_()
    gen, found = torch.Generator().manual_seed(0), []
    for t in tokens:
        chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(t)]).flatten().sort().values
        ends = torch.bincount(chosen, minlength=experts).cumsum(0).to(torch.int32)
        x = torch.randn(len(chosen), k).to(torch.bfloat16)
        exact = torch.cat([x[i:i + 1].double() @ w[e].double().T for i, e in enumerate(chosen.tolist())])
        times: dict[str, list[float]] = {name: [] for name in dlls}
        for run in range(runs):
            for name, dll in alternating(dlls, run):
                out = torch.empty(len(chosen), n, dtype=torch.bfloat16)
                start = time.perf_counter()
                dll.expert_rows(x.data_ptr(), w.data_ptr(), ends.data_ptr(), out.data_ptr(), experts, n, k, threads)
                times[name].append(time.perf_counter() - start)
                if not ((out.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all():
                    raise ValueError(f"kernel_builds: {name}'s experts at {t} tokens are not within one rounding")
        found.append({"tokens": t, "distinct": int(chosen.unique().numel()),
                      **{name: statistics.median(v) * 1e3 for name, v in times.items()}})
    return found


def require_entry(dlls: dict[str, ctypes.CDLL], entry: str) -> None:
    """ValueError naming the builds that lack ``entry`` (sources from before it), if any."""
    missing = [name for name, dll in dlls.items() if not hasattr(dll, entry)]
    if missing:
        raise ValueError(f"kernel_builds: the {' and '.join(missing)} build has no {entry} (its sources predate it); "
                         f"pick a later --old revision to time {entry}")


def mla_attention_oracle(q: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                         tables: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA decode in float64 over each row's whole table (``q [B, H, C]``, ``q_pe [B, H,
    R]``, ``kv_c [N, S, 1, C]``, ``k_pe [N, S, 1, R]``) -> the output ``[B, H, C]`` and the
    probabilities times ``|kv_c|`` (the scale of the values' rounding error), row by row."""
    out, spread = [], []
    for b in range(q.shape[0]):
        ids = tables[b].long()
        c, r = kv_c[ids].flatten(0, 2).double(), k_pe[ids].flatten(0, 2).double()  # [T, C], [T, R]
        p = torch.softmax((q[b].double() @ c.T + q_pe[b].double() @ r.T) * scale, -1)  # [H, T]
        out.append(p @ c)
        spread.append(p @ c.abs())
    return torch.stack(out), torch.stack(spread)


def attention_run(dll: ctypes.CDLL, q: torch.Tensor, q_rope: torch.Tensor | None, k_cache: torch.Tensor,
                  rope_cache: torch.Tensor | None, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, scale: float, hk: int, g: int, threads: int) -> torch.Tensor:
    """The ``decode_attention`` entry of the build ``dll`` (bound: ``kernels.build._bind``) on
    arguments that ``ascend_graph::decode_attention`` accepts, with ``hk`` kv heads of ``g`` query
    heads each: its index conversion and output allocation, then the C call."""
    q = q.contiguous()
    q_rope = q_rope.contiguous() if q_rope is not None else None
    tables, ctx = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype)
    rope = rope_cache if rope_cache is not None else k_cache
    strides = (ctypes.c_long * 9)(*(s for t in (k_cache, rope, v_cache) for s in t.stride()[:3]))
    status = dll.decode_attention(
        q.data_ptr(), q_rope.data_ptr() if q_rope is not None else None, k_cache.data_ptr(), rope.data_ptr(),
        v_cache.data_ptr(), tables.data_ptr(), ctx.data_ptr(), out.data_ptr(), q.shape[0], hk, g, q.shape[2],
        q_rope.shape[-1] if q_rope is not None else 0, out.shape[-1], strides, tables.shape[1], k_cache.shape[1],
        float(scale), int(q.dtype == torch.bfloat16), threads)
    if status != 0:
        raise RuntimeError("kernel_builds: decode_attention could not run (out of memory for its work list)")
    return out


def attention_times(dlls: dict[str, ctypes.CDLL], batch: int = 32, context: int = 2048, heads: int = 16,
                    latent: int = 512, rope: int = 64, block: int = 16, runs: int = 15) -> dict[str, float]:
    """Median ms of each build's ``decode_attention`` (one thread), MLA absorbed over bf16 caches
    in shuffled blocks, every row at ``context``; each output within 2^-7 (|out| + p . |kv_c|) of
    float64 attention (its one rounding, the probabilities' rounding to bf16 for the values and
    the float32 softmax stay well inside), else ValueError; so too for a build without it."""
    require_entry(dlls, "decode_attention")
    per = context // block
    kv_c = torch.randn(batch * per + 8, block, 1, latent).to(torch.bfloat16)
    k_pe = torch.randn(kv_c.shape[0], block, 1, rope).to(torch.bfloat16)
    tables = torch.randperm(kv_c.shape[0])[:batch * per].view(batch, per).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q, q_pe = torch.randn(batch, heads, latent).to(torch.bfloat16), torch.randn(batch, heads, rope).to(torch.bfloat16)
    scale = (128 + rope) ** -0.5  # V2-Lite's query head: 128 + rope
    exact, spread = mla_attention_oracle(q, q_pe, kv_c, k_pe, tables, scale)
    bound = (exact.abs() + spread) * 2 ** -7
    times: dict[str, list[float]] = {name: [] for name in dlls}
    for i in range(runs):
        for name, dll in alternating(dlls, i):
            start = time.thread_time()
            out = attention_run(dll, q, q_pe, kv_c, k_pe, kv_c, tables, lens, scale, 1, heads, 1)
            times[name].append(time.thread_time() - start)
            if not ((out.double() - exact).abs() <= bound).all():
                raise ValueError(f"kernel_builds: {name}'s decode_attention is not within its rounding of float64")
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="git revision whose kernel sources are the 'before'")
    parser.add_argument("--isa", choices=sorted(ISA_FLAGS), default="native", help="build both for this ISA")
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--weight", default="12288,2048", help="the rows' weight N,K (default: streamed from memory)")
    parser.add_argument("--runs", type=int, default=7, help="interleaved runs per row count (medians)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="the rows' weights and rows")
    parser.add_argument("--threads", type=int, default=1, help="the rows' OpenMP threads (more than 1: wall time)")
    parser.add_argument("--attention", action="store_true",
                        help="time decode_attention (MLA, batch 32, context 2048, bf16)")
    parser.add_argument("--moe", action="store_true",
                        help="time the routed experts (V2-Lite gate/up, 1 and 8 tokens top-6, 2 threads)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        dlls = {"old": build(sources_at(args.old), d, "old", args.isa),
                "now": build(sources_now(), d, "now", args.isa)}
    print(f"builds: {args.isa}, {dlls['now'].expert_rows_available()}-bit forms", flush=True)
    if args.attention:
        try:
            require_entry(dlls, "decode_attention")  # before the other parts run
        except ValueError as e:
            parser.error(str(e).removeprefix("kernel_builds: "))
    n, k = (int(v) for v in args.weight.split(","))
    for row in rows_rates(dlls, tuple(int(r) for r in args.rows.split(",")), n=n, k=k, runs=args.runs,
                          dtype=getattr(torch, args.dtype), threads=args.threads):
        print(f"{row['rows']:3d} rows: old {row['old']:6.1f} GFLOP/s, now {row['now']:6.1f}, "
              f"now/old {row['now'] / row['old']:.2f}", flush=True)
    if args.moe:
        for row in moe_times(dlls, runs=2 * args.runs + 1):
            print(f"experts, {row['tokens']} token(s), {row['distinct']} distinct: old {row['old']:.2f} ms, "
                  f"now {row['now']:.2f} ms, old/now {row['old'] / row['now']:.2f}", flush=True)
    if args.attention:
        ms = attention_times(dlls, runs=2 * args.runs + 1)
        print(f"decode_attention (MLA, batch 32, context 2048, 16 heads x 512 + 64, bf16): old {ms['old']:.2f} ms, "
              f"now {ms['now']:.2f} ms, old/now {ms['old'] / ms['now']:.2f}", flush=True)


if __name__ == "__main__":
    main()
