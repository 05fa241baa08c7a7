"""Shared tools of the benchmarks: interleaved timing, ratios of the same rounds, machine
conditions and key, JSON, markdown tables."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import tempfile
import time
from typing import Callable

from ascend_graph.runtime import machine

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


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


def ratio_of_rounds(samples: dict[str, list[float]], slow: str, fast: str) -> dict:
    """How many times faster ``fast`` ran than ``slow``: the ratio of their medians over the same
    rounds, and the range of the per-round ratios (each round timed the two back to back)."""
    a, b = samples[slow], samples[fast]
    if len(a) != len(b):
        raise ValueError(f"{slow} and {fast} were not timed in the same rounds ({len(a)} vs {len(b)} samples)")
    rounds = [x / y for x, y in zip(a, b)]
    return {"ratio": statistics.median(a) / statistics.median(b), "min": min(rounds), "max": max(rounds),
            "rounds": len(rounds)}


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


def _amd_core(cpu_id: str, flags: list[str]) -> str | None:
    """AMD's core generation from ``cpu_id`` ("AuthenticAMD family 25 model 17"), where Linux lists it."""
    words = cpu_id.split()
    if words[0] != "AuthenticAMD" or len(words) < 5:
        return None
    family, model = int(words[2]), int(words[4])
    if family == 23:
        return "zen2" if model >= 0x30 else "zen1"
    if family == 25:
        return "zen4" if "avx512f" in flags else "zen3"
    return {26: "zen5"}.get(family)


def machine_key(c: dict) -> str:
    """A short name for the machine of ``conditions()`` ``c`` (``results/<key>.json``): the GPU's
    name, or the CPU's with its core generation where ``cpu_id`` gives it, else its widest
    vector instructions."""
    if c.get("device", "cpu") != "cpu":
        name, tail = c["device"], None
    else:
        flags = c.get("cpu_flags") or []
        isa = next((f for f in ("avx512_bf16", "avx512f", "avx2") if f in flags), None)
        name, tail = c.get("cpu", "cpu"), (c.get("cpu_id") and _amd_core(c["cpu_id"], flags)) or isa
    words = re.sub(r"\(.*?\)|processor|cpu", " ", name, flags=re.I).lower()
    return "-".join(re.sub(r"[^a-z0-9]+", " ", words).split()[:3] + ([tail] if tail else []))


def dumps(data, depth: int = 2, _at: int = 0) -> str:
    """``data`` as JSON with the dicts of the first ``depth`` levels one key a line, deeper values
    on one line each (small files that diff part by part)."""
    if not isinstance(data, dict) or _at >= depth or not data:
        return json.dumps(data)
    pad = " " * (_at + 1)
    body = ",\n".join(f"{pad}{json.dumps(k)}: {dumps(v, depth, _at + 1)}" for k, v in data.items())
    return "{\n" + body + "\n" + " " * _at + "}"


def write_json(path: str | None, data: dict) -> None:
    """Write ``data`` to ``path`` (``dumps``; no-op when ``path`` is None)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(dumps(data) + "\n")
    print(f"wrote {path}")


def results_path(c: dict, quick: bool = False) -> str:
    """This machine's results file (``conditions()`` ``c``): ``benchmarks/results/<machine>.json``,
    a temporary file for a ``--quick`` run."""
    name = f"{machine_key(c)}{'-quick' if quick else ''}.json"
    return os.path.join(tempfile.gettempdir() if quick else RESULTS, name)


def merge_part(part: str, data: dict, quick: bool = False) -> str:
    """Put ``data`` under ``part`` in this machine's results file, keeping its other parts; a new
    file gets this machine's conditions and key, as ``python -m benchmarks`` writes them."""
    found = conditions()
    path = results_path(found, quick)
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            out = json.load(f)
    out.setdefault("conditions", {**found, "quick": quick})
    out.setdefault("machine", machine_key(found))
    out[part] = data
    write_json(path, out)
    return path


def fmt(v, digits: int = 2) -> str:
    """``v`` with ``digits`` decimals, "—" for None."""
    return "—" if v is None else f"{v:.{digits}f}"


def table(head: list[str], rows: list[list]) -> list[str]:
    """A markdown table."""
    return ([f"| {' | '.join(head)} |", "|" + " --- |" * len(head)]
            + [f"| {' | '.join(str(c) for c in r)} |" for r in rows])
