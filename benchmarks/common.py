"""Shared measuring tools of the benchmarks: interleaved timing, machine conditions, JSON."""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from typing import Callable

from ascend_graph.runtime import machine


def interleaved_medians(fns: dict[str, Callable[[], object]], rounds: int = 20,
                        calls_per_round: int = 5, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each function, timed round robin so machine drift hits all alike."""
    samples = interleaved_samples(fns, rounds, calls_per_round, warmup)
    return {name: statistics.median(s) for name, s in samples.items()}


def interleaved_samples(fns: dict[str, Callable[[], object]], rounds: int = 20,
                        calls_per_round: int = 5, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds per call of each function in each round, the functions timed round robin: the
    i-th samples of two functions were taken back to back."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls_per_round):
                fn()
            samples[name].append((time.perf_counter() - start) / calls_per_round)
    return samples


def linear_fit(xs: list[float], ys: list[float]) -> dict:
    """The least-squares line ``y = intercept + slope * x``; its residuals (y - line), their root
    mean square, the largest as a share of the line's value there, and r2."""
    slope, intercept = statistics.linear_regression(xs, ys)
    fitted = [intercept + slope * x for x in xs]
    residuals = [y - f for y, f in zip(ys, fitted)]
    mean = statistics.fmean(ys)
    total = sum((y - mean) ** 2 for y in ys)
    ss_res = sum(r * r for r in residuals)
    return {"slope": slope, "intercept": intercept, "residuals": residuals,
            "rms_residual": math.sqrt(ss_res / len(xs)),
            "max_relative_residual": max(abs(r) / abs(f) if f else math.inf for r, f in zip(residuals, fitted)),
            "r2": 1 - ss_res / total if total else 1.0}


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
_GLIBC_DEFAULT_MMAP_THRESHOLD = 128 * 1024


def set_malloc_keeps_freed_memory(keep: bool) -> bool:
    """glibc: serve large allocations from the heap and keep freed memory (``keep``), or not.

    By default glibc maps every allocation over 128 KiB (dynamic threshold, up to 32 MiB) fresh
    from the kernel and unmaps it on free, so a step that allocates a large temporary pays a page
    fault per 4 KiB page on every call. Keeping freed memory makes later steps reuse it. Returns
    False where mallopt is unavailable (not glibc).
    """
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mmap_threshold = 1 << 30 if keep else _GLIBC_DEFAULT_MMAP_THRESHOLD
    trim_threshold = (1 << 31) - 1 if keep else 2 * _GLIBC_DEFAULT_MMAP_THRESHOLD
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def with_malloc(keep: bool, fn: Callable[[], object], restore: bool) -> Callable[[], object]:
    """``fn`` run under the malloc setting ``keep``, then ``restore`` set again.

    ``keep=False`` is glibc's behaviour with a fixed 128 KiB mmap threshold (the default
    threshold is dynamic but never above 32 MiB, so large temporaries are mapped fresh either way).
    """
    def run() -> object:
        set_malloc_keeps_freed_memory(keep)
        try:
            return fn()
        finally:
            set_malloc_keeps_freed_memory(restore)
    return run


def conditions(device: str = "cpu") -> dict:
    """What the figures were measured on (``runtime.machine``; ``device``'s name as ``device``
    where it is a GPU) and when."""
    found = machine(device)
    gpu = found.pop("gpu", None)
    return {**found, "when": time.strftime("%Y-%m-%d %H:%M:%S"), **({"device": gpu} if gpu else {})}


def write_json(path: str | None, data: dict) -> None:
    """Write ``data`` as indented JSON to ``path`` (no-op when ``path`` is None)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {path}")
