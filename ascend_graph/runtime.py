"""Small runtime services of the runner: static-address tracking, memory readings, progress."""

from __future__ import annotations

import os
import sys

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


def progress(done: int, total: int, label: str, width: int = 24) -> None:
    """A one-line progress bar on stderr."""
    filled = width * done // max(total, 1)
    end = "\n" if done >= total else ""
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}\033[K{end}")
    sys.stderr.flush()
