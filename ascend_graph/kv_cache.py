"""Tuple KV caches: specs, allocation, the one in-place write, and validation.

This module is the only code that allocates or writes KV caches.

Shape legend: N num_blocks, S block_size, T tokens written in one step, Hk kv heads,
D head size, C kv_lora_rank, R qk_rope_head_dim.

Block ``NULL_BLOCK`` (0) of every cache is reserved: no sequence ever owns it. Padded rows of a
decode batch read it and write to it (their slot is negative), so they never touch a live block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence, Union

import torch
from torch import Tensor

from .runtime import huge_page_buffer, huge_pages_supported

NULL_BLOCK = 0


class MLACache(NamedTuple):
    """Per-layer MLA cache: the compressed latent and the decoupled rope key, kept apart."""

    kv_c: Tensor  # [N, S, 1, C]
    k_pe: Tensor  # [N, S, 1, R]


class KVCache(NamedTuple):
    """Per-layer MHA/GQA cache: keys and values, kept apart."""

    k: Tensor  # [N, S, Hk, D]
    v: Tensor  # [N, S, Hk, D]


LayerCache = Union[MLACache, KVCache]


@dataclass(frozen=True)
class MLACacheSpec:
    """What one MLA layer stores per token: a latent of ``kv_lora_rank`` and a rope key."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype = torch.float32

    @property
    def cache_type(self) -> type:
        return MLACache

    def token_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-token shape of each tuple element (everything after ``[N, S]``)."""
        return (1, self.kv_lora_rank), (1, self.qk_rope_head_dim)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one MHA/GQA layer stores per token: ``num_kv_heads`` keys and values."""

    num_kv_heads: int
    head_size: int
    dtype: torch.dtype = torch.float32

    @property
    def cache_type(self) -> type:
        return KVCache

    def token_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-token shape of each tuple element (everything after ``[N, S]``)."""
        return (self.num_kv_heads, self.head_size), (self.num_kv_heads, self.head_size)


CacheSpec = Union[MLACacheSpec, KVCacheSpec]


# ---------------------------------------------------------------------------------------------
# Byte accounting


def bytes_per_block(specs: Sequence[CacheSpec], block_size: int) -> int:
    """Bytes one block costs across all layers (both tuple elements of every layer)."""
    itemsize = lambda dt: torch.empty((), dtype=dt).element_size()  # noqa: E731
    return sum(
        block_size * math.prod(shape) * itemsize(spec.dtype)
        for spec in specs
        for shape in spec.token_shapes()
    )


def blocks_for_budget(specs: Sequence[CacheSpec], block_size: int, budget_bytes: int) -> int:
    """How many blocks (the null block included) fit in ``budget_bytes``."""
    per_block = bytes_per_block(specs, block_size)
    if budget_bytes < 2 * per_block:
        raise ValueError(
            f"budget_bytes={budget_bytes} is too small: at least 2 blocks "
            f"({2 * per_block} bytes, the null block and one usable block) are needed"
        )
    return budget_bytes // per_block


# ---------------------------------------------------------------------------------------------
# Allocation


def _aligned_empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                   align_bytes: int, huge_pages: bool = False) -> Tensor:
    """A zeroed tensor in its own allocation whose first byte is ``align_bytes``-aligned; on
    CPU with ``huge_pages``, on transparent huge pages, every page faulted in now."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    if huge_pages and device.type == "cpu" and huge_pages_supported():
        return huge_page_buffer(nbytes, max(align_bytes, 1)).zero_().view(dtype).view(shape)
    if align_bytes <= 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.zeros(nbytes + align_bytes, dtype=torch.uint8, device=device)
    offset = (-raw.data_ptr()) % align_bytes
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def allocate_kv_caches(
    specs: Sequence[CacheSpec],
    num_blocks: int,
    block_size: int,
    device: torch.device | str = "cpu",
    align_bytes: int = 0,
    huge_pages: bool = False,
) -> tuple[LayerCache, ...]:
    """Allocate the caches of all layers: a tuple of per-layer ``MLACache``/``KVCache``.

    Every tensor is its own allocation (never a view of one shared buffer), zero-filled, so graph
    backends can take each as a static input. ``align_bytes`` (a power of two, e.g. 2 MiB) aligns
    each tensor's start address, as transfer engines that register memory require. ``huge_pages``
    (CPU, Linux): each tensor on transparent huge pages, so that reading blocks scattered over a
    large cache misses the TLB less (the GraphRunner asks for it on CPU; the suite's attention
    part times the step over caches on 4 KiB pages beside it).
    """
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block {NULL_BLOCK} is reserved), got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if align_bytes < 0 or (align_bytes & (align_bytes - 1)):
        raise ValueError(f"align_bytes must be 0 or a power of two, got {align_bytes}")
    device = torch.device(device)
    caches = []
    for spec in specs:
        tensors = [
            _aligned_empty((num_blocks, block_size, *shape), spec.dtype, device, align_bytes, huge_pages)
            for shape in spec.token_shapes()
        ]
        caches.append(spec.cache_type(*tensors))
    return tuple(caches)


# ---------------------------------------------------------------------------------------------
# The in-place write


# Registered through torch.library.Library rather than the custom_op decorator: the schema's
# alias annotations (a!)/(b!) declare the mutation just the same (torch.compile keeps the op in
# the graph and writes in place), and a call costs less (docs/cpu-kernels.md). It runs once per
# layer per step, inside the graphs too.
_LIB = torch.library.Library("ascend_graph", "DEF")
_LIB.define("write_slots(Tensor(a!) cache_a, Tensor(b!) cache_b, Tensor a, Tensor b, Tensor slot_mapping) -> ()")


def write_slots_aten(cache_a: Tensor, cache_b: Tensor, a: Tensor, b: Tensor, slot_mapping: Tensor) -> None:
    """The op's body in aten ops: its kernel, and what a graph compiler that generates the write
    itself traces instead of calling the op (``compile.inductor.inline_cache_writes``)."""
    idx = slot_mapping.clamp(min=0)  # [T]; padding lands in slot 0 of NULL_BLOCK
    cache_a.view(-1, *cache_a.shape[2:]).index_copy_(0, idx, a.to(cache_a.dtype))
    cache_b.view(-1, *cache_b.shape[2:]).index_copy_(0, idx, b.to(cache_b.dtype))


_LIB.impl("write_slots", write_slots_aten, "CompositeExplicitAutograd")


@torch.library.register_fake("ascend_graph::write_slots")
def _write_slots_fake(cache_a: Tensor, cache_b: Tensor, a: Tensor, b: Tensor, slot_mapping: Tensor) -> None:
    return None


def write_slots(cache_a: Tensor, cache_b: Tensor, a: Tensor, b: Tensor, slot_mapping: Tensor) -> None:
    """Write token ``i``'s entries ``a[i]``, ``b[i]`` into both cache tensors at ``slot_mapping[i]``.

    The op ``torch.ops.ascend_graph.write_slots``. A slot is ``block_id * block_size + offset``.
    Negative slots (padding) are redirected into the reserved null block, so no live block
    changes. No checks here: this runs inside captured graphs; ``write_kv_cache`` is the checked
    entry point.
    """
    torch.ops.ascend_graph.write_slots(cache_a, cache_b, a, b, slot_mapping)


def write_kv_cache(cache: LayerCache, a: Tensor, b: Tensor, slot_mapping: Tensor) -> None:
    """Checked in-place write of new tokens into one layer's tuple cache.

    ``a``/``b`` are ``(kv_c, k_pe)`` for an ``MLACache`` (shapes ``[T, 1, C]``, ``[T, 1, R]``)
    and ``(k, v)`` for a ``KVCache`` (``[T, Hk, D]`` each). Raises before writing anything.
    """
    check_layer_cache(cache, "cache")
    num_slots = cache[0].shape[0] * cache[0].shape[1]
    for name, src, dst in zip(cache._fields, (a, b), cache):
        if src.shape[1:] != dst.shape[2:] or src.dim() != dst.dim() - 1:
            raise ValueError(f"{name} must have shape [T, {', '.join(map(str, dst.shape[2:]))}], "
                             f"got {list(src.shape)}")
        if src.device != dst.device:
            raise ValueError(f"{name} is on {src.device}, the cache is on {dst.device}")
    if a.shape[0] != b.shape[0] or slot_mapping.shape != (a.shape[0],):
        raise ValueError(f"slot_mapping must have shape [{a.shape[0]}] (one slot per token), "
                         f"got {list(slot_mapping.shape)} for {a.shape[0]} and {b.shape[0]} tokens")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must hold integers (int32 or int64), got {slot_mapping.dtype}")
    check_slots(slot_mapping.tolist(), num_slots, cache[0].shape[1])
    write_slots(cache[0], cache[1], a, b, slot_mapping.to(device=cache[0].device, dtype=torch.int64))


# ---------------------------------------------------------------------------------------------
# Validation (host side, before anything is written)


def check_slots(slots: Sequence[int], num_slots: int, block_size: int, name: str = "slot_mapping") -> None:
    """Every slot is padding (negative) or lies in a live block (not the null block), and no live
    slot is written twice in one step (which write would win is undefined)."""
    seen: dict[int, int] = {}
    for i, slot in enumerate(slots):
        if slot >= 0 and seen.setdefault(slot, i) != i:
            raise ValueError(f"{name}[{i}]={slot} is also {name}[{seen[slot]}]: two tokens would write one slot")
        if slot >= num_slots:
            raise ValueError(f"{name}[{i}]={slot} is out of range: the cache has {num_slots} slots")
        if 0 <= slot < (NULL_BLOCK + 1) * block_size:
            raise ValueError(f"{name}[{i}]={slot} lies in the reserved null block {NULL_BLOCK}; "
                             "use a negative slot for padding")


def check_layer_cache(cache: object, name: str) -> None:
    """A layer cache is an ``MLACache``/``KVCache`` of two 4-d tensors with matching [N, S]."""
    if not isinstance(cache, (MLACache, KVCache)):
        raise TypeError(f"{name} must be an MLACache or KVCache, got {type(cache).__name__}")
    for field, t in zip(cache._fields, cache):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name}.{field} must be a 4-d tensor [num_blocks, block_size, heads, dim]")
    first, second = cache
    if first.shape[:2] != second.shape[:2] or first.device != second.device:
        raise ValueError(f"{name}: both tensors must share [num_blocks, block_size] and device, got "
                         f"{list(first.shape)} on {first.device} and {list(second.shape)} on {second.device}")
    if isinstance(cache, MLACache) and first.shape[2] != 1:
        raise ValueError(f"{name}.kv_c must have one head (shape [N, S, 1, C]), got {list(first.shape)}")


def check_kv_caches(kv_caches: object, specs: Sequence[CacheSpec], num_blocks: int, block_size: int,
                    device: torch.device | str | None = None) -> None:
    """The whole tuple-of-tuples matches ``specs``: length, types, shapes, dtypes and device."""
    if not isinstance(kv_caches, tuple):
        raise TypeError(f"kv_caches must be a tuple of per-layer caches, got {type(kv_caches).__name__}")
    if len(kv_caches) != len(specs):
        raise ValueError(f"kv_caches has {len(kv_caches)} layers, expected {len(specs)}")
    for i, (cache, spec) in enumerate(zip(kv_caches, specs)):
        name = f"kv_caches[{i}]"
        check_layer_cache(cache, name)
        if not isinstance(cache, spec.cache_type):
            raise TypeError(f"{name} must be a {spec.cache_type.__name__}, got {type(cache).__name__}")
        for field, t, shape in zip(cache._fields, cache, spec.token_shapes()):
            expected = (num_blocks, block_size, *shape)
            if tuple(t.shape) != expected:
                raise ValueError(f"{name}.{field} has shape {list(t.shape)}, expected {list(expected)}")
            if t.dtype != spec.dtype:
                raise ValueError(f"{name}.{field} has dtype {t.dtype}, expected {spec.dtype}")
            if device is not None and not _on_device(t, torch.device(device)):
                raise ValueError(f"{name}.{field} is on {t.device}, expected {device}")


def _on_device(t: Tensor, device: torch.device) -> bool:
    """``device`` without an index (``"cuda"``) accepts any index; CPU tensors carry none (``0``)."""
    return t.device.type == device.type and (device.index is None or (t.device.index or 0) == device.index)
