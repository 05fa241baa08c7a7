"""Choosing an attention backend: once, when the model is built, from the platform, the cache
dtype and what is installed; the model then calls the chosen one in eager and graph steps alike.

``ATTENTION_BACKENDS[kind]`` lists ``(name, "module:Class")`` in order of preference; the first
whose ``supports(device, dtype)`` holds and that does not refuse the layer's dimensions
(``refuses(shape)``: the NPU's fused operators take only some) is chosen. Modules are imported only when asked, so an
optional platform's backend costs nothing where it is absent.
"""

from __future__ import annotations

import importlib
from typing import Iterable, Optional

import torch

from .base import AttentionBackend, AttentionShape

ATTENTION_BACKENDS: dict[str, tuple[tuple[str, str], ...]] = {
    "mla": (("npu", "ascend_graph.attention.npu:NpuMLA"),
            ("cpu_kernel", "ascend_graph.attention.cpu:CpuMLA"),
            ("triton", "ascend_graph.attention.triton:TritonMLA"),
            ("gathered_live", "ascend_graph.attention.live:LiveMLA"),
            ("reference", "ascend_graph.attention.reference:ReferenceMLA")),
    "paged": (("npu", "ascend_graph.attention.npu:NpuPaged"),
              ("cpu_kernel", "ascend_graph.attention.cpu:CpuPaged"),
              ("triton", "ascend_graph.attention.triton:TritonPaged"),
              ("gathered_live", "ascend_graph.attention.live:LivePaged"),
              ("reference", "ascend_graph.attention.reference:ReferencePaged")),
}


def _load(path: str) -> type[AttentionBackend]:
    module, _, cls = path.partition(":")
    return getattr(importlib.import_module(module), cls)


def select_attention_backend(kind: str, device: torch.device | str, dtype: torch.dtype,
                             name: Optional[str] = None, shape: Optional[AttentionShape] = None) -> AttentionBackend:
    """The backend for ``kind`` ("mla" or "paged") over caches of ``dtype`` on ``device`` for a
    layer of ``shape`` (None: any): ``name`` if given (ValueError if it cannot run there or
    refuses the shape, naming why), else the first of ``ATTENTION_BACKENDS[kind]`` that can."""
    if kind not in ATTENTION_BACKENDS:
        raise ValueError(f"kind must be one of {sorted(ATTENTION_BACKENDS)}, got {kind!r}")
    entries = dict(ATTENTION_BACKENDS[kind])
    if name is not None and name not in entries:
        raise ValueError(f"attention backend must be one of {sorted(entries)} for {kind}, got {name!r}")
    device = torch.device(device)
    for candidate in ([name] if name is not None else list(entries)):
        cls = _load(entries[candidate])
        if not cls.supports(device, dtype):
            continue
        refusal = cls.refuses(shape)
        if refusal is None:
            return cls()
        if name is not None:
            raise ValueError(f"attention backend {name!r} cannot take this layer: {refusal}")
    raise ValueError(f"attention backend {name!r} does not run for {dtype} caches on {device.type}")


def choose_block_size(backends: Iterable[AttentionBackend], block_size: Optional[int] = None) -> int:
    """The cache block size for a model whose layers run ``backends``: ``block_size`` where every
    one takes it (ValueError naming it otherwise), else the first backend's ``default_block_size``
    (16 where there is none)."""
    backends = list(backends)
    if block_size is None:
        block_size = backends[0].default_block_size if backends else 16
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
    for b in backends:
        if not b.block_size_ok(block_size):
            raise ValueError(f"block_size={block_size} is not taken by the {b.name!r} attention backend "
                             f"(its default: {b.default_block_size})")
    return block_size


def model_attention_backends(model) -> list[AttentionBackend]:
    """The backends ``model``'s attention layers run (its ``attention_layers()``; none without it)."""
    layers = getattr(model, "attention_layers", None)
    return [] if layers is None else [layer.backend for layer in layers()]
