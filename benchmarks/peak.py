"""One core's peak multiply-add rate, the ceiling of every compute-bound figure in the suite.

``peak.c`` (12 independent chains of one vector instruction, nothing loaded) is built with the
system C compiler for this CPU (``-march=native``) and called through ctypes: float32 fused
multiply-add and, where the CPU has AVX512-BF16, the bfloat16 pair dot product (``vdpbf16ps``)
that oneDNN's bf16 matmuls use. The best of a few runs (noise only lowers a peak).

    python -m benchmarks.peak
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import time

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peak.c")


def _build(out_dir: str) -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
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
    return dll


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
    with tempfile.TemporaryDirectory() as d:
        dll = _build(d)
        if dll is None:
            return {"fp32_fma_flops_per_s": None, "bf16_dot_flops_per_s": None, "skipped": "no C compiler"}
        return {"fp32_fma_flops_per_s": _rate(dll.fma_f32), "bf16_dot_flops_per_s": _rate(dll.dot_bf16)}


def main() -> None:
    r = measure()
    for k, v in r.items():
        print(f"{k}: {v / 1e9:.1f} GFLOP/s" if isinstance(v, float) else f"{k}: {v}")


if __name__ == "__main__":
    main()
