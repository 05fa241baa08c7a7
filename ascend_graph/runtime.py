"""Small runtime services of the runner: static-address tracking, memory readings, compile cache
outcomes, huge-page weights, progress; and the CPU row length that a matrix-vector product streams best at."""

from __future__ import annotations

import mmap
import os
import platform
import sys
from collections import Counter
from typing import Optional

import torch
from torch import Tensor


class StaticAddressError(RuntimeError):
    """A tensor that graphs captured by address has moved."""


class StaticAddresses:
    """Remembers the address of each static graph input and checks that none has moved."""

    def __init__(self) -> None:
        self._entries: list[tuple[str, Tensor, int]] = []

    def track(self, named: dict[str, Tensor]) -> None:
        """Record the current address of each named tensor."""
        self._entries.extend((name, t, t.data_ptr()) for name, t in named.items())

    def check(self) -> None:
        """Raise ``StaticAddressError`` naming the first tensor whose address changed."""
        for name, t, ptr in self._entries:
            if t.data_ptr() != ptr:
                raise StaticAddressError(
                    f"{name} moved from {ptr:#x} to {t.data_ptr():#x}; captured graphs read the old "
                    "address. Write into the cache in place (copy_, index_copy_), never rebind it.")


def memory_in_use(device: torch.device) -> int:
    """Bytes in use: the device allocator's reservation, or the process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    if device.type == "npu" and hasattr(torch, "npu"):
        return torch.npu.memory_reserved(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def compile_cache_counts() -> Counter:
    """Inductor's compile cache lookups in this process so far, by outcome (``hit``, ``miss``,
    ``bypass``): its FX graph cache, which AOTAutograd's cache counts on its hits too."""
    from torch._dynamo.utils import counters

    found = counters["inductor"]
    return Counter({k: found[f"fxgraph_cache_{k}"] for k in ("hit", "miss", "bypass")})


def compile_cache_outcome(before: Counter) -> Optional[str]:
    """What the compile cache did since ``compile_cache_counts()`` gave ``before``: ``"miss"``
    (something was compiled), else ``"bypass"`` (not cacheable), else ``"hit"``; ``None`` when
    nothing was looked up (no Inductor compile: the debug backends, torchair)."""
    done = compile_cache_counts() - before
    return next((k for k in ("miss", "bypass", "hit") if done[k]), None)


def progress(done: int, total: int, label: str, width: int = 24) -> None:
    """A one-line progress bar on stderr."""
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}\033[K{end}")
    sys.stderr.flush()


# A one-row matmul on CPU streams its weight at the memory's rate only while its input row stays
# in L1 beside the weight stream (``python -m benchmarks --parts compute``; docs/cpu-kernels.md).
# Inductor also accumulates CPU reductions over more than 4096 elements through its
# cascade-summation helper (torch/_inductor/codegen/cpp.py, need_use_acc_helper), whose
# accumulator lives in memory. ``DecodeMatmulPass`` splits such reductions; models store such
# weights chunk-major.
LONG_REDUCTION = 4096


def reduction_chunks(k: int) -> int:
    """The fewest equal chunks of at most ``LONG_REDUCTION`` that ``k`` splits into (1: no split)."""
    if not isinstance(k, int) or k <= LONG_REDUCTION:
        return 1
    for chunks in range(-(-k // LONG_REDUCTION), k // 32 + 1):
        if k % chunks == 0:
            return chunks
    return 1


HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int, align: int = HUGE_PAGE) -> Tensor:
    """``nbytes`` of CPU memory (uint8, zero) in a private anonymous mapping of its own, aligned
    to ``align`` (a power of two, at least 2 MiB) and advised ``MADV_HUGEPAGE`` before any page
    is touched; the tensor keeps the mapping alive. Pages are faulted in on first write."""
    align = max(align, HUGE_PAGE)
    # private: an anonymous shared mapping is shmem, which follows shmem_enabled, not madvise
    region = mmap.mmap(-1, -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE + align,
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = (-raw.data_ptr()) % align
    return raw[start:start + nbytes]


def anon_huge_page_bytes() -> int:
    """Bytes of this process's anonymous memory on huge pages (``/proc/self/smaps_rollup``; 0 where unreadable)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("AnonHugePages:")), 0)
    except OSError:
        return 0


def huge_pages_supported() -> bool:
    """Whether this platform's mmap has ``MADV_HUGEPAGE`` (Linux)."""
    return hasattr(mmap, "MADV_HUGEPAGE")


def on_huge_pages(t: Tensor) -> Tensor:
    """A copy of CPU tensor ``t`` on huge pages (``huge_page_buffer``), with ``t``'s strides when
    ``t`` is dense (a chunk-major weight stays chunk-major), else contiguous."""
    strides = torch.empty_like(t, device="meta").stride()  # preserve_format: t's own when dense
    out = huge_page_buffer(t.numel() * t.element_size()).view(t.dtype).as_strided(t.shape, strides)
    out.copy_(t)
    return out


def weights_on_huge_pages(model: torch.nn.Module, min_bytes: int = HUGE_PAGE) -> int:
    """Move every CPU parameter, and every derived weight form (a non-persistent buffer, such as
    MLA's ``W_UK`` / ``W_UV``), of ``min_bytes`` or more onto transparent huge pages; the bytes
    moved. A decode step streams the weights.
    Call it before building a runner: the parameters are new tensors (same values), which
    graphs compiled before would see as a change. A parameter shared by several modules (tied
    embeddings) is moved once and stays shared. Needs Linux with transparent huge pages set
    to ``madvise`` or ``always``; elsewhere it moves nothing and returns 0.
    """
    if not huge_pages_supported():
        return 0
    moved, new = 0, {}  # id(old parameter) -> its moved parameter
    with torch.no_grad():
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None or p.device.type != "cpu" or p.numel() * p.element_size() < min_bytes:
                    continue
                if id(p) not in new:
                    new[id(p)] = torch.nn.Parameter(on_huge_pages(p.data), requires_grad=p.requires_grad)
                    moved += p.numel() * p.element_size()
                module._parameters[name] = new[id(p)]
            for name in module._non_persistent_buffers_set:
                b = module._buffers.get(name)
                if b is not None and b.device.type == "cpu" and b.numel() * b.element_size() >= min_bytes:
                    module._buffers[name] = on_huge_pages(b)
                    moved += b.numel() * b.element_size()
    return moved


# x86 flags (as /proc/cpuinfo names them) that decide which CPU paths run: the project's kernel
# needs avx512_bf16; oneDNN's bf16 packing avx512 or avx_ne_convert; AMX tiles oneDNN uses where present
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx_ne_convert", "amx_bf16")


def machine(device: str = "cpu") -> dict:
    """What figures are measured on: torch and Python versions, the CPU's model name, its cores,
    torch's threads, the CPU's ``CPU_FLAGS`` it has (``cpu_flags``: two machines of one model
    name may differ), its vendor, family and model numbers where Linux lists them (``cpu_id``: a
    virtual machine may name every generation alike), and where ``device`` is a CUDA device its
    name (``gpu``)."""
    cpu, flags, cpu_id = platform.processor() or platform.machine(), [], None
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
        field = lambda name: next((line.split(":", 1)[1].strip() for line in lines  # noqa: E731
                                   if line.split(":", 1)[0].strip() == name), None)
        cpu = field("model name") or cpu
        flags = [f for f in CPU_FLAGS if f in set((field("flags") or "").split())]
        if field("cpu family") is not None:
            cpu_id = f"{field('vendor_id')} family {field('cpu family')} model {field('model')}"
    except OSError:
        pass
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu, "cpu_flags": flags,
            **({"cpu_id": cpu_id} if cpu_id else {}), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            **({"gpu": torch.cuda.get_device_name(device)} if torch.device(device).type == "cuda" else {})}
