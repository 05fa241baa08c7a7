"""Few-row bfloat16 matmuls of a CPU decode step over plain weights: the routed experts' rows
(each expert gets a few) and, in compiled steps, the dense products of 2-64 rows.

aten's bf16 matmul reorders a plain weight into oneDNN's blocked layout on every call, so at the
1-8 rows of a decode step it streams the weights at about half the rate one core reads memory
(``python -m benchmarks.peak``, one core, over runs: 3-row products over plain row-major weights
at 11.8-13.6 GB/s with aten, 17-26.6 GB/s with this kernel). oneDNN's pre-packed weights avoid
that but need a packed copy of every weight (2x the experts' memory, and the batch-1 form reads
the plain ones).
``expert_rows.c`` multiplies the rows by the weights as they are stored, in tiles of 4 rows by 6
weight rows, prefetching the weight rows two tiles ahead into L2 (without it the loads and the dot
products take turns: 8-row products 10.4 vs 11.6 GB/s, 4-row 13.9 vs 19.8, one-off). Two ops:
``ascend_graph::expert_rows_mm``, that both the eager runner and the compiled step call for the
MoE (``RoutedExperts.sorted_by_expert``), so the two modes still compute the MoE the same way;
and ``ascend_graph::rows_mm`` (one weight), that the compiled step runs for bf16 matmuls of 2 to
``backends.inductor.ROWS_MM_MAX`` rows (``DecodeMatmulPass``). From ``WIDE_MIN_ROWS`` rows the
product is bound by the dot products rather than the weight stream, and ``rows_mm`` runs the
kernel's wide form: the rows repacked in bf16 pairs, each weight pair broadcast against 16 rows
at a time, so every sum stays in its own vector lane (no reduction across a vector) and each
weight element is still read once (32 rows: 194-195 GFLOP/s against aten's 141-147, one-off).

It is built on first use with the system C compiler (``cc``, or ``$CC``) for this CPU
(``-march=native``, OpenMP where the compiler has it: ``torch.get_num_threads()`` threads). Where
there is no compiler, no AVX512-BF16, or ``ASCEND_GRAPH_EXPERT_KERNEL=0``, ``available()`` is
False and the MoE keeps ``torch._grouped_mm``.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile

import torch
from torch import Tensor

# From this many rows on, ``rows_mm`` runs the kernel's wide form (``wide_rows`` in expert_rows.c):
# one-off, GFLOP/s tiles vs wide form, [12288, 2048] / [2048, 3648] / [576, 2048]: 17 rows 113/105,
# 101/105, 100/91; 20 rows 120/123, 110/123, 107/107; 24 rows 106/146, 132/147, 110/126.
WIDE_MIN_ROWS = 21
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "expert_rows.c")


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The built kernel, or None where it cannot be built or this CPU lacks AVX512-BF16."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as d:  # the loaded library outlives its file
        lib = os.path.join(d, "expert_rows.so")
        for openmp in (["-fopenmp"], []):
            done = subprocess.run([cc, "-O3", "-march=native", *openmp, "-shared", "-fPIC", SOURCE, "-o", lib],
                                  capture_output=True, text=True)
            if done.returncode == 0:
                break
        else:
            return None
        dll = ctypes.CDLL(lib)
    if not dll.expert_rows_available():
        return None
    dll.expert_rows.restype = ctypes.c_int
    dll.expert_rows.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int]
    dll.wide_rows.restype = ctypes.c_int
    dll.wide_rows.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    return dll


@torch.compiler.assume_constant_result  # traced, the choice is made once, at compile time
def available() -> bool:
    """Whether ``expert_rows_mm`` runs here (see the module docstring)."""
    return os.environ.get("ASCEND_GRAPH_EXPERT_KERNEL", "1") != "0" and _library() is not None


@torch.library.custom_op("ascend_graph::expert_rows_mm", mutates_args=())
def expert_rows_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """``x [P, K]`` rows sorted by expert, ``w [X, N, K]`` the experts' weights, ``ends [X]``
    int32 the end of each expert's rows (``ends[-1] = P``) -> ``[P, N]``: each row times its
    expert's weight transposed, as ``torch._grouped_mm(x, w.transpose(1, 2), offs=ends)``.
    CPU, bfloat16; call only where ``available()``."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"expert_rows_mm: x and w must be bfloat16 CPU tensors, got {x.dtype}/{w.dtype} on {x.device}")
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
        raise RuntimeError(f"{name}: the kernel could not run (out of memory for the padded rows)")
    return out


@expert_rows_mm.register_fake
def _(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.custom_op("ascend_graph::rows_mm", mutates_args=())
def rows_mm(x: Tensor, w: Tensor) -> Tensor:
    """``x [M, K] @ w[N, K].T -> [M, N]``, as ``F.linear(x, w)``: the same kernel with one
    "expert". CPU, bfloat16; call only where ``available()``. The compiled decode step's dense
    products of a few rows run it (``backends.inductor.DecodeMatmulPass``)."""
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"rows_mm: x and w must be bfloat16 CPU tensors, got {x.dtype}/{w.dtype} on {x.device}")
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"rows_mm: expected x [M, K] and w [N, K]; got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.shape[0] >= WIDE_MIN_ROWS:
        x, w = x.contiguous(), w.contiguous()
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.bfloat16)
        if _library().wide_rows(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.shape[0], w.shape[0], w.shape[1],
                                torch.get_num_threads()) != 0:
            raise RuntimeError("rows_mm: the kernel could not run (out of memory for the packed rows)")
        return out
    end = ctypes.c_int32(x.shape[0])  # one "expert": no tensor for its row end on every call
    return _run("rows_mm", x, w.unsqueeze(0), ctypes.addressof(end))


@rows_mm.register_fake
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])
