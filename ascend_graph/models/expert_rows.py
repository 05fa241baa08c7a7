"""Few-row bfloat16 matmuls of a CPU decode step over plain weights: the routed experts' rows
(each expert gets a few) and, in compiled steps, the dense products of 2-64 rows.

aten's bf16 matmul reorders a plain weight into oneDNN's blocked layout on every call, so at the
1-8 rows of a decode step it streams the weights at about half the rate one core reads memory
(``python -m benchmarks.peak``, one core, over runs: 3-row products over plain row-major weights
at 11.8-13.6 GB/s with aten, 17-26.6 GB/s with this kernel). oneDNN's pre-packed weights avoid
that but need a packed copy of every weight (2x the experts' memory, and the batch-1 form reads
the plain ones).
``expert_rows.c`` multiplies the rows by the weights as they are stored. Up to 4 rows of one
weight it takes tiles of 4 rows by 6 weight rows, prefetching the weight rows two tiles ahead into
L2 (without it the loads and the dot products take turns: 8-row products 10.4 vs 11.6 GB/s, 4-row
13.9 vs 19.8, one-off). From 5 rows, where the tiles' loads and their sums reduced across a
vector bound the time, it repacks the rows once per call and broadcasts each weight element
against them, every sum in its own vector lane: 8 rows by 2 bf16 pairs per vector up to 8 rows,
16 rows by 1 pair from 9 (figures in ``expert_rows.c``; one-off, 8 rows 1.19-1.34x and 16 rows
1.31-1.38x faster than the tiles; 32 rows 194-195 GFLOP/s against aten's 141-147, one core's peak
being 234). The MoE's experts get a few rows each at decode (at most 12 of a V2-Lite layer's at
64 tokens) and stream at the memory's rate either way.
Five ops: ``ascend_graph::expert_rows_mm``, that both the eager runner and the compiled step
call for the MoE (``RoutedExperts.sorted_by_expert``), so the two modes still compute the MoE the
same way, and that the compiled MLA decode step runs for its attention scores (one "expert" per
sequence); ``ascend_graph::rows_mm`` (one weight), that the compiled step runs for bf16 matmuls
of 2 to ``backends.inductor.ROWS_MM_MAX`` rows; and ``ascend_graph::rows_bmm``, the kernel's
``[K, N]`` form (matrices stored with the reduced dimension first), that the compiled MLA decode
step runs for the probabilities times the latent cache rows (``DecodeMatmulPass``: graph mode
only; the eager runner keeps aten's ``bmm`` there); and ``paged_rows_mm`` and ``paged_rows_bmm``,
the two attention forms over a paged cache read through the block table, each block where it
lies, which the compiled step runs instead where the rows are the cache's gathered rows: no
gathered copy is made (batch 32, context 2048, one interleaved run: MLA decode attention 19.9
against 30.3 ms; the copies took 13.3 of those 30.3 ms, profiled). Head by head (``x [B, Hk, M,
*]`` over a ``[NB, S, Hk, D]`` cache) they take standard attention's decode products, eager and
compiled, where aten emulates bf16 (``attention.paged.paged_decode``).

It is built on first use with the system C compiler (``cc``, or ``$CC``) for this CPU
(``-march=native``, OpenMP where the compiler has it: ``torch.get_num_threads()`` threads), about
2 s here, and kept in ``cache_dir()`` for later processes, by a key over the source, the compiler,
its flags and the CPU. It is written for AVX512-BF16; on a CPU with AVX2 and FMA only (Zen 3,
most x86 servers before 2022), where aten's bf16 matmul runs at about 10 GFLOP/s, the row-major
products (``expert_rows_mm``, ``rows_mm``, ``paged_rows_mm``) run forms of their own on 256-bit
vectors, widening bf16 to float32 (a tile of dot products, and a wide form for whole chunks of 16
rows), and the ``[K, N]`` products the same source with each 512-bit vector as two 256-bit ones
and the bf16 pair dot product as two float32 fused multiply-adds (``expert_rows.c``): one Zen 3
core, a [12288, 2048] weight, 4 / 32 / 64 rows at 53.6 / 77.5 / 73.9 GFLOP/s (aten about 10;
float32 FMA peak 102). ``isa()`` says which. Where
there is no compiler, neither instruction set, or ``ASCEND_GRAPH_EXPERT_KERNEL=0``,
``available()`` is False and the MoE keeps ``torch._grouped_mm``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile

import torch
from torch import Tensor

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expert_rows.c")


def cache_dir() -> str:
    """Where built kernels are kept between processes: ``$ASCEND_GRAPH_KERNEL_CACHE``, else
    ``ascend_graph`` under ``$XDG_CACHE_HOME`` (default ``~/.cache``)."""
    return os.environ.get("ASCEND_GRAPH_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ascend_graph")


def _build_key(cc: str, flags: list[str]) -> str:
    """A digest of what the built library depends on: the source, the compiler and its flags,
    and this CPU (``-march=native``; a cache directory may be shared between machines)."""
    h = hashlib.sha256()
    with open(SOURCE, "rb") as f:
        h.update(f.read())
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    h.update(repr((os.path.realpath(cc), version, flags, platform.machine())).encode())
    try:
        with open("/proc/cpuinfo") as f:
            h.update(next((line for line in f if line.startswith(("flags", "Features"))), "").encode())
    except OSError:
        h.update(platform.processor().encode())
    return h.hexdigest()[:32]


def _built(cc: str) -> str | None:
    """The library's path, built by an earlier process (kept in ``cache_dir()``) or now; None
    where it does not compile, with OpenMP or without."""
    for openmp in (["-fopenmp"], []):
        flags = ["-O3", "-march=native", *openmp, "-shared", "-fPIC"]
        path = os.path.join(cache_dir(), f"expert_rows-{_build_key(cc, flags)}.so")
        if os.path.exists(path) or (path := _compile(cc, flags, path)):
            return path
    return None


def _compile(cc: str, flags: list[str], path: str) -> str | None:
    """Build into ``path`` under a temporary name, then rename (a concurrent process never loads
    half a file); where its directory cannot be written, into a temporary directory of its own
    (the caller loads and removes it). None where it does not compile."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    except OSError:
        path = None
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=tempfile.mkdtemp(prefix="ascend_graph-kernel-"))
    os.close(fd)
    if subprocess.run([cc, *flags, SOURCE, "-o", tmp], capture_output=True).returncode != 0:
        if path is None:
            shutil.rmtree(os.path.dirname(tmp), ignore_errors=True)
        else:
            os.unlink(tmp)
        return None
    if path is None:
        return tmp
    os.replace(tmp, path)
    return path


def compiler() -> str | None:
    """The system C compiler's path: ``$CC`` (default ``cc``), else ``gcc``; None where there is none."""
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built or this CPU has neither AVX512-BF16 nor AVX2 and FMA."""
    cc = compiler()
    lib = cc and _built(cc)
    if not lib:
        return None
    dll = ctypes.CDLL(lib)
    if os.path.dirname(lib) != cache_dir():  # a temporary build: the loaded library outlives its file
        shutil.rmtree(os.path.dirname(lib), ignore_errors=True)
    return _bind(dll) if dll.expert_rows_available() else None


def _bind(dll: ctypes.CDLL) -> ctypes.CDLL:
    """``dll`` (a build of ``expert_rows.c``) with its entry points' argument types set."""
    dll.expert_rows.restype = ctypes.c_int
    dll.expert_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    dll.kn_rows.restype = ctypes.c_int
    dll.kn_rows.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_int]
    for paged in (dll.paged_rows, dll.paged_kn):
        paged.restype = ctypes.c_int
        paged.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 7 + [ctypes.c_int]
    return dll


def isa() -> str | None:
    """The instructions the kernel runs here: "AVX512-BF16", "AVX2" (its 256-bit forms, see the
    module docstring), or None where it does not run."""
    if not available():
        return None
    return {512: "AVX512-BF16", 256: "AVX2"}[_library().expert_rows_available()]


@torch.compiler.assume_constant_result  # traced, the choice is made once, at compile time
def available() -> bool:
    """Whether ``expert_rows_mm`` runs here (see the module docstring)."""
    return os.environ.get("ASCEND_GRAPH_EXPERT_KERNEL", "1") != "0" and _library() is not None


# One-row bf16 products over row-major weights run the kernel in compiled steps where its build is
# named here True (``one_row_kernel``): the dense ones as ``rows_mm`` (``DecodeMatmulPass``) and
# the routed experts of one token as ``expert_rows_mm`` (``RoutedExperts.decode``), instead of
# Inductor's generated reductions. AVX2 (Zen 3, one core, [N, K] weights streamed from memory,
# one-off, interleaved, GB/s, reduction / kernel / a read loop): [10944, 2048] 10.8 / 14.1 / 17.8,
# [2048, 10944] 8.9 / 15.7 / 18.4, [102400, 2048] 11.6 / 14.6 / 16.1. The generated loop issues no
# prefetch; the same loop prefetching 4 KiB ahead read 15.9 (in C, one-off). One V2-Lite MoE
# layer at 1 token (6 experts, 104 MB, weights on 2 MiB pages, one-off, interleaved): gathered
# reduction 7.13 ms, the kernel 5.64 ms, the read loop at 20.9 GB/s. AVX512-BF16: not measured side
# by side; there the batch-1 step's reductions stream at 0.90 of the read loop's rate (README), and
# the ``levers`` benchmark times the other choice.
ONE_ROW_KERNEL = {"AVX2": True, "AVX512-BF16": False}


@torch.compiler.assume_constant_result  # traced (RoutedExperts.decode), a compile-time choice
def one_row_kernel() -> bool:
    """Whether compiled steps run one-row bf16 products in the kernel here (``ONE_ROW_KERNEL``)."""
    return ONE_ROW_KERNEL.get(isa(), False)


def _check_bf16_cpu(name: str, x: Tensor, w: Tensor) -> None:
    """The kernel's ops take bfloat16 CPU tensors only."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(f"{name}: x and w must be bfloat16 CPU tensors, got {x.dtype}/{w.dtype} on {x.device}/{w.device}")


@torch.library.custom_op("ascend_graph::expert_rows_mm", mutates_args=())
def expert_rows_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """``x [P, K]`` rows sorted by expert, ``w [X, N, K]`` the experts' weights, ``ends [X]``
    int32 the end of each expert's rows (``ends[-1] = P``) -> ``[P, N]``: each row times its
    expert's weight transposed, as ``torch._grouped_mm(x, w.transpose(1, 2), offs=ends)``.
    CPU, bfloat16; call only where ``available()``."""
    _check_bf16_cpu("expert_rows_mm", x, w)
    if x.dim() != 2 or w.dim() != 3 or w.shape[2] != x.shape[1] or ends.shape != (w.shape[0],):
        raise ValueError(f"expert_rows_mm: expected x [P, K], w [X, N, K], ends [X]; got {tuple(x.shape)}, "
                         f"{tuple(w.shape)}, {tuple(ends.shape)}")
    if x.shape[0] and int(ends[-1]) != x.shape[0]:
        raise ValueError(f"expert_rows_mm: ends[-1] must be the row count {x.shape[0]}, got {int(ends[-1])}")
    ends = ends.to(torch.int32).contiguous()
    return _run("expert_rows_mm", x, w, ends.data_ptr())


def _run(name: str, x: Tensor, w: Tensor, ends: int) -> Tensor:
    """The C kernel on checked arguments: ``x [P, K]``, ``w [X, N, K]``, ``ends`` the address of
    X int32 row ends (kept alive by the caller)."""
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.bfloat16)
    status = _library().expert_rows(x.data_ptr(), w.data_ptr(), ends, out.data_ptr(),
                                    w.shape[0], w.shape[1], w.shape[2], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"{name}: the kernel could not run (out of memory for the copied rows)")
    return out


@expert_rows_mm.register_fake
def _(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("ascend_graph::rows_mm", mutates_args=())
def rows_mm(x: Tensor, w: Tensor) -> Tensor:
    """``x [M, K] @ w[N, K].T -> [M, N]``, as ``F.linear(x, w)``: the same kernel with one
    "expert". CPU, bfloat16; call only where ``available()``. The compiled decode step's dense
    products of a few rows run it (``backends.inductor.DecodeMatmulPass``)."""
    _check_bf16_cpu("rows_mm", x, w)
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"rows_mm: expected x [M, K] and w [N, K]; got {tuple(x.shape)}, {tuple(w.shape)}")
    end = ctypes.c_int32(x.shape[0])  # one "expert": no tensor for its row end on every call
    return _run("rows_mm", x, w.unsqueeze(0), ctypes.addressof(end))


@rows_mm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.custom_op("ascend_graph::rows_bmm", mutates_args=())
def rows_bmm(x: Tensor, w: Tensor) -> Tensor:
    """``x [X, M, K] @ w [X, K, N] -> [X, M, N]``, as ``torch.bmm``, over matrices stored with
    the reduced dimension first (``w[e]`` row-major ``[K, N]``; the entries may lie apart, as
    per-head slices of one weight do): the kernel's ``[K, N]`` form
    (``expert_rows.c``, ``kn_rows``). CPU, bfloat16; call only where ``available()``. The
    compiled MLA decode step runs it for the attention's probabilities times the latent cache
    rows (``backends.inductor.DecodeMatmulPass``)."""
    _check_bf16_cpu("rows_bmm", x, w)
    if x.dim() != 3 or w.dim() != 3 or w.shape[0] != x.shape[0] or w.shape[1] != x.shape[2]:
        raise ValueError(f"rows_bmm: expected x [X, M, K] and w [X, K, N]; got {tuple(x.shape)}, {tuple(w.shape)}")
    return _run_kn(x, w)


def _run_kn(x: Tensor, w: Tensor) -> Tensor:
    """The kernel's ``[K, N]`` form on checked arguments ``x [X, M, K]``, ``w [X, K, N]``."""
    x = x.contiguous()
    if w.stride(2) != 1 or w.stride(1) != w.shape[2]:
        w = w.contiguous()
    experts, rows, k = x.shape
    n = w.shape[2]
    out = torch.empty(experts, rows, n, dtype=torch.bfloat16)
    status = _library().kn_rows(x.data_ptr(), w.data_ptr(), w.stride(0), out.data_ptr(), experts, rows, k, n,
                                torch.get_num_threads())
    if status != 0:
        raise RuntimeError("rows_bmm: the kernel could not run (out of memory for the packed rows)")
    return out


@rows_bmm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], x.shape[1], w.shape[2])


@torch.library.custom_op("ascend_graph::paged_rows_mm", mutates_args=())
def paged_rows_mm(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    """``x [B, M, K]`` by each sequence's cached tokens, read in place through its block table:
    ``out[b, m, t] = x[b, m] . token t of sequence b``, ``[B, M, T]`` with ``T = W * S``. ``cache
    [NB, S, ..., K]`` holds S token rows of K per block (each block contiguous), ``block_tables
    [B, W]`` block ids; as ``bmm(x, gather_rows(cache, block_tables).view(B, T, K).transpose(1, 2))``
    without the gathered copy. Head by head: ``x [B, H, M, K]`` against a cache ``[NB, S, H, K]``
    (standard attention's keys, H kv heads) -> ``[B, H, M, T]``, ``out[b, h, m, t] = x[b, h, m] .
    head h of token t``. CPU, bfloat16; call only where ``available()``. The compiled MLA decode
    step runs it for its attention scores (``backends.inductor.DecodeMatmulPass``), standard
    attention's decode for its own (``attention.paged_decode``)."""
    _check_bf16_cpu("paged_rows_mm", x, cache)
    bs, heads, tables = _check_paged("paged_rows_mm", x, cache, block_tables)
    if x.shape[-1] != cache.shape[-1]:
        raise ValueError(f"paged_rows_mm: x [B, (H,) M, K] must end in the cache's row width {cache.shape[-1]}, "
                         f"got {tuple(x.shape)}")
    return _run_paged("paged_rows_mm", x, cache, tables, bs, heads, tables.shape[1] * bs)


@paged_rows_mm.register_fake
def _(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    rows = cache.shape[1] if x.dim() == 4 else _rows_per_block(cache)
    return x.new_empty(*x.shape[:-1], block_tables.shape[1] * rows)


@torch.library.custom_op("ascend_graph::paged_rows_bmm", mutates_args=())
def paged_rows_bmm(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    """``x [B, M, T]`` times each sequence's cached tokens ``[T, N]`` (``T = W * S``), read in place
    through its block table: as ``bmm(x, gather_rows(cache, block_tables).view(B, T, N))`` without
    the gathered copy (``cache``, ``block_tables`` as for ``paged_rows_mm``). Head by head: ``x [B,
    H, M, T]`` times head h's rows of a cache ``[NB, S, H, N]`` -> ``[B, H, M, N]``. CPU, bfloat16;
    call only where ``available()``. The compiled MLA decode step runs it for the attention's
    probabilities times the latent cache rows, standard attention's decode for its values."""
    _check_bf16_cpu("paged_rows_bmm", x, cache)
    bs, heads, tables = _check_paged("paged_rows_bmm", x, cache, block_tables)
    if x.shape[-1] != tables.shape[1] * bs:
        raise ValueError(f"paged_rows_bmm: x [B, (H,) M, T] needs T = {tables.shape[1]} blocks x {bs} rows = "
                         f"{tables.shape[1] * bs}, got {tuple(x.shape)}")
    return _run_paged("paged_rows_bmm", x, cache, tables, bs, heads, cache.shape[-1])


@paged_rows_bmm.register_fake
def _(x: Tensor, cache: Tensor, block_tables: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], cache.shape[-1])


def _rows_per_block(cache: Tensor) -> int:
    return math.prod(cache.shape[1:-1])


def _check_paged(name: str, x: Tensor, cache: Tensor, block_tables: Tensor) -> tuple[int, int, Tensor]:
    """Rows per block (per head), the heads read one by one (1 for ``x [B, M, *]``) and the table
    as contiguous int32, or ValueError naming what is off: the shapes, a block not laid out as
    its rows one after another, an id outside the cache."""
    by_head = x.dim() == 4 and cache.dim() == 4 and cache.shape[2] == x.shape[1]
    by_rows = x.dim() == 3 and cache.dim() >= 3
    if not (by_head or by_rows) or block_tables.dim() != 2 or block_tables.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: expected x [B, M, *] with cache [NB, S, ..., width], or x [B, H, M, *] with "
                         f"cache [NB, S, H, width], and block_tables [B, W]; got "
                         f"{tuple(x.shape)}, {tuple(cache.shape)}, {tuple(block_tables.shape)}")
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.device.type != "cpu":
        raise ValueError(f"{name}: block_tables must be int32 or int64 on the CPU, got {block_tables.dtype} "
                         f"on {block_tables.device}")
    if not cache[:1].is_contiguous():
        raise ValueError(f"{name}: each cache block must hold its rows one after another (strides "
                         f"{tuple(cache.stride())} for shape {tuple(cache.shape)})")
    if block_tables.numel() and not 0 <= int(block_tables.min()) <= int(block_tables.max()) < cache.shape[0]:
        raise ValueError(f"{name}: block_tables ids must lie in [0, {cache.shape[0]}), got "
                         f"{int(block_tables.min())}..{int(block_tables.max())}")
    tables = block_tables.to(torch.int32).contiguous()
    return (cache.shape[1], x.shape[1], tables) if by_head else (_rows_per_block(cache), 1, tables)


def _run_paged(name: str, x: Tensor, cache: Tensor, tables: Tensor, bs: int, heads: int, n: int) -> Tensor:
    """The kernel's paged forms on checked arguments; ``n`` the output's last dimension."""
    x = x.contiguous()
    rows = x.shape[-2]
    out = torch.empty(*x.shape[:-1], n, dtype=torch.bfloat16)
    kernel = _library().paged_rows if name == "paged_rows_mm" else _library().paged_kn
    if out.numel():
        status = kernel(x.data_ptr(), cache.data_ptr(), tables.data_ptr(), out.data_ptr(), x.shape[0] * heads,
                        tables.shape[1], bs, cache.stride(0), rows, cache.shape[-1], heads, torch.get_num_threads())
        if status != 0:
            raise RuntimeError(f"{name}: the kernel could not run (out of memory for the packed rows)")
    return out
