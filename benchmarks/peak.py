"""One core's peak multiply-add rate, the ceiling of every compute-bound figure in the suite.

``peak.c`` (12 independent chains of one vector instruction, nothing loaded) is built with the
system C compiler for this CPU (``-march=native``) and called through ctypes: float32 fused
multiply-add and, where the CPU has AVX512-BF16, the bfloat16 pair dot product (``vdpbf16ps``)
that oneDNN's bf16 matmuls use. The best of a few runs (noise only lowers a peak).

``python -m benchmarks.peak`` also prints how fast one core streams a bfloat16 weight through a
one-row product (a hand-written kernel, weights on huge pages) by row length and layout: the
measurement behind ``runtime.LONG_REDUCTION`` and ``layers.ChunkedLinear``; and, for 1 to
32 rows, aten's ``F.linear`` against the project's few-row kernel (``rows_mm``) on the same
row-major weights (``few_rows_streams``): the measurement behind ``ascend_graph/kernels/`` and
``compile.inductor.ROWS_MM_MAX``.

    python -m benchmarks.peak
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
import time

from ascend_graph import kernels

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak.c")


def _build(out_dir: str) -> ctypes.CDLL | None:
    cc = kernels.compiler()
    if cc is None:
        return None
    lib = os.path.join(out_dir, "peak.so")
    done = subprocess.run([cc, "-O2", "-march=native", "-shared", "-fPIC", SOURCE, "-o", lib],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return None
    dll = ctypes.CDLL(lib)
    for name in ("fma_f32", "dot_bf16"):
        getattr(dll, name).restype, getattr(dll, name).argtypes = ctypes.c_double, [ctypes.c_long]
    dll.row_times_matrix.restype = ctypes.c_double
    dll.row_times_matrix.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_int]
    dll.read_f32.restype = ctypes.c_double
    dll.read_f32.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    dll.vector_bits.restype, dll.vector_bits.argtypes = ctypes.c_int, []
    return dll


def library() -> ctypes.CDLL | None:
    """``peak.c`` built and loaded, or None without a C compiler. Built in a temporary directory;
    the loaded library outlives it."""
    with tempfile.TemporaryDirectory() as d:
        return _build(d)


def vector_isa() -> str | None:
    """The vector instructions ``peak.c`` is built with on this CPU: "AVX-512", "AVX2" or None."""
    dll = library()
    return None if dll is None else {512: "AVX-512", 256: "AVX2"}.get(dll.vector_bits())


def _rate(fn, seconds: float = 0.2, runs: int = 5) -> float | None:
    if fn(1) == 0.0:
        return None  # this CPU lacks the instruction
    n = 1 << 16
    while True:  # size a run to about ``seconds``
        t = time.perf_counter()
        fn(n)
        if time.perf_counter() - t > seconds / 4:
            break
        n *= 2
    n = int(n * seconds / max(time.perf_counter() - t, 1e-9))
    best = 0.0
    for _ in range(runs):
        t = time.perf_counter()
        flops = fn(n)
        best = max(best, flops / (time.perf_counter() - t))
    return best


def measure() -> dict:
    """``{"fp32_fma_flops_per_s", "bf16_dot_flops_per_s"}`` of one core (None: not measurable here)."""
    dll = library()
    if dll is None:
        return {"fp32_fma_flops_per_s": None, "bf16_dot_flops_per_s": None, "skipped": "no C compiler"}
    return {"fp32_fma_flops_per_s": _rate(dll.fma_f32), "bf16_dot_flops_per_s": _rate(dll.dot_bf16)}


def row_streams(weight_mib: int = 48, runs: int = 9) -> list[dict]:
    """GB/s of weight read by a one-row product, median of ``runs``, per (row length, chunk, layout)."""
    import torch

    from ascend_graph.runtime import huge_page_buffer

    shapes = [(2048, 2048, False), (3648, 3648, False), (7168, 7168, False), (10944, 10944, False),
              (10944, 3648, False), (10944, 3648, True)]
    rows, dll = [], library()
    if dll is None:
        return rows
    buf = huge_page_buffer(3 * weight_mib << 20).view(torch.bfloat16)
    buf.normal_()
    x, out = torch.ones(16384), torch.empty(1 << 16)
    for k, chunk, chunk_major in shapes:
        n = (weight_mib << 20) // (2 * k)
        times = []
        for r in range(runs):  # three weights in turn: none is in the last-level cache
            w = buf[(r % 3) * (weight_mib << 19):]
            t = time.perf_counter()
            nbytes = dll.row_times_matrix(w.data_ptr(), x.data_ptr(), out.data_ptr(), n, k, chunk, chunk_major)
            times.append(time.perf_counter() - t)
        if nbytes == 0.0:
            return []
        rows.append({"row": k, "chunk": chunk, "chunk_major": chunk_major,
                     "bytes_per_s": nbytes / sorted(times)[runs // 2]})
    return rows


def few_rows_streams(weight_mib: int = 48, k: int = 2048, rows=(1, 2, 3, 4, 8, 16, 24, 32, 64),
                     runs: int = 9) -> list[dict]:
    """GB/s of bfloat16 weight read by an ``r``-row product on one core, median of ``runs``, per
    row count: aten's ``F.linear`` against the project's kernel (``rows_mm``; the MoE's
    ``expert_rows_mm`` is the same kernel; from 5 rows, on AVX2 from 16, it runs its wide forms) on the same
    row-major weights. The compiled step runs its dense products of
    2 to ``ROWS_MM_MAX`` rows in the kernel. The calls take turns over four weights, so each weight
    was last read three calls (three times the last-level cache) before. Empty where the kernel
    does not run here."""
    import torch
    import torch.nn.functional as F

    from ascend_graph import kernels
    from ascend_graph.runtime import huge_page_buffer

    if not kernels.available():
        return []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n = (weight_mib << 20) // (2 * k)
        buf = huge_page_buffer(4 * n * k * 2).view(torch.bfloat16)
        buf.normal_()
        weights = [buf[i * n * k:(i + 1) * n * k].view(n, k) for i in range(4)]
        found, calls_made = [], 0
        for r in rows:
            x = torch.randn(r, k, dtype=torch.bfloat16)
            calls = {"kernel": lambda w: torch.ops.ascend_graph.rows_mm(x, w), "aten": lambda w: F.linear(x, w)}
            times = {name: [] for name in calls}
            for _ in range(runs):
                for name, call in calls.items():
                    w = weights[calls_made % 4]
                    calls_made += 1
                    t = time.perf_counter()
                    call(w)
                    times[name].append(time.perf_counter() - t)
            rate = {name: n * k * 2 / sorted(ts)[runs // 2] for name, ts in times.items()}
            found.append({"rows": r, "aten_bytes_per_s": rate["aten"], "kernel_bytes_per_s": rate["kernel"]})
        return found
    finally:
        torch.set_num_threads(threads)


def main() -> None:
    r = measure()
    for k, v in r.items():
        print(f"{k}: {v / 1e9:.1f} GFLOP/s" if isinstance(v, float) else f"{k}: {v}")
    for row in row_streams():
        layout = "chunk-major" if row["chunk_major"] else "row-major"
        piece = "whole rows" if row["chunk"] == row["row"] else f"chunks of {row['chunk']}"
        print(f"one-row product, rows of {row['row']:5d}, {piece:15s}, {layout:11s}: "
              f"{row['bytes_per_s'] / 1e9:.1f} GB/s")
    for row in few_rows_streams():
        print(f"{row['rows']}-row product, rows of 2048, row-major: aten {row['aten_bytes_per_s'] / 1e9:.1f} GB/s, "
              f"rows_mm {row['kernel_bytes_per_s'] / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
