"""Choosing an attention backend: once, when the model is built, from the platform, the cache
dtype and what is installed; the model then calls the chosen one in eager and graph steps alike.

``ATTENTION_BACKENDS[kind]`` lists ``(name, "module:Class")`` in order of preference; the first
whose ``supports(device, dtype)`` holds is chosen. Modules are imported only when asked, so an
optional platform's backend costs nothing where it is absent.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from .base import AttentionBackend

ATTENTION_BACKENDS: dict[str, tuple[tuple[str, str], ...]] = {
    "mla": (("cpu_kernel", "ascend_graph.attention.cpu:CpuMLA"),
            ("triton", "ascend_graph.attention.triton:TritonMLA"),
            ("gathered_live", "ascend_graph.attention.live:LiveMLA"),
            ("reference", "ascend_graph.attention.reference:ReferenceMLA")),
    "paged": (("cpu_kernel", "ascend_graph.attention.cpu:CpuPaged"),
              ("triton", "ascend_graph.attention.triton:TritonPaged"),
              ("gathered_live", "ascend_graph.attention.live:LivePaged"),
              ("reference", "ascend_graph.attention.reference:ReferencePaged")),
}


def _load(path: str) -> type[AttentionBackend]:
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def select_attention_backend(kind: str, device: torch.device | str, dtype: torch.dtype,
                             name: Optional[str] = None) -> AttentionBackend:
    """The backend for ``kind`` ("mla" or "paged") over caches of ``dtype`` on ``device``: ``name``
    if given (ValueError if it cannot run there), else the first of ``ATTENTION_BACKENDS[kind]``
    that can."""
    if kind not in ATTENTION_BACKENDS:
        raise ValueError(f"kind must be one of {sorted(ATTENTION_BACKENDS)}, got {kind!r}")
    entries = dict(ATTENTION_BACKENDS[kind])
    if name is not None and name not in entries:
        raise ValueError(f"attention backend must be one of {sorted(entries)} for {kind}, got {name!r}")
    device = torch.device(device)
    for candidate in ([name] if name is not None else list(entries)):
        cls = _load(entries[candidate])
        if cls.supports(device, dtype):
            return cls()
    raise ValueError(f"attention backend {name!r} does not run for {dtype} caches on {device.type}")
