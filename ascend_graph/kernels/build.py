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
of 2 to ``compile.inductor.ROWS_MM_MAX`` rows; and ``ascend_graph::rows_bmm``, the kernel's
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
import os
import platform
import shutil
import subprocess
import tempfile

import torch

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "expert_rows.c")


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
