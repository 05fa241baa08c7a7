"""Shared measuring tools of the benchmarks: interleaved timing, machine conditions, JSON."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from typing import Callable

import torch


def interleaved_medians(fns: dict[str, Callable[[], object]], rounds: int = 20,
                        calls_per_round: int = 5, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each function, timed round robin so machine drift hits all alike."""
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
    return {name: statistics.median(s) for name, s in samples.items()}


def conditions() -> dict:
    """What the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu,
            "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "when": time.strftime("%Y-%m-%d %H:%M:%S")}


def write_json(path: str | None, data: dict) -> None:
    """Write ``data`` as indented JSON to ``path`` (no-op when ``path`` is None)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {path}")
