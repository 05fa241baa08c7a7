"""The tuple caches as a transfer engine sees them, and transfer plans over them. Pure: no transport.

A ``CacheLayout`` lists one ``Region`` per cache tensor (layer by layer, the tuple's fields in
order: ``kv_c, k_pe`` or ``k, v``): its address, block count, bytes per block and block shape.
Two processes compare layouts at handshake (``check_matches``); the ``fingerprint`` covers
everything but addresses and block counts, which differ between processes by design. A layout
for a handshake also carries the model's ``identity`` (``pd/identity.py``: each layer's attention
kind, cache family and ``k_pe`` rope layout, the config, a few weights' digests); where either
side has one, both must, and they must be equal.

``plan_transfer`` maps source block ids to destination block ids and turns them into
``Descriptor``s (source address, destination address, length), one per maximal run of blocks
consecutive on both sides, per region; descriptors go into batches of bounded count and bytes.

Shape legend: N num_blocks, S block_size, H heads per token, D dim per head.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from ..kv_cache import NULL_BLOCK, LayerCache, check_layer_cache
from .identity import ModelIdentity

REGISTRATION_ALIGN = 2 << 20  # cache tensors start 2 MiB-aligned: what Ascend's registration wants
DEFAULT_MAX_DESCRIPTORS = 512  # per batch: a TCP lane rejects much more in flight to one peer (docs/pd.md)


class LayoutMismatch(ValueError):
    """Two processes' cache layouts differ; the message names the first difference."""


def check_drafting(ours: int, theirs: int, where: str) -> None:
    """Both PD sides' ``num_speculative_tokens`` give prefill rows of one form (0: logits; 1: and a
    draft; > 1: and the MTP output hidden states), else ``LayoutMismatch`` naming both."""
    if min(ours, 2) != min(theirs, 2):
        raise LayoutMismatch(f"drafting differs: num_speculative_tokens={ours} here, {theirs} on the {where}: "
                             "start both sides with the same --num-speculative-tokens")


@dataclass(frozen=True)
class Region:
    """One cache tensor ``[N, S, H, D]``: where it lives and what one block of it is."""

    layer: int
    field: str  # the tuple field: kv_c, k_pe, k or v
    address: int  # of block 0
    num_blocks: int
    block_bytes: int
    block_shape: tuple[int, ...]  # [S, H, D]
    dtype: str  # e.g. "float32"

    def block_address(self, block: int) -> int:
        """Address of block ``block``."""
        return self.address + block * self.block_bytes

    @property
    def name(self) -> str:
        return f"layer {self.layer} {self.field}"


@dataclass(frozen=True)
class CacheLayout:
    """Every region of one process's caches, in layer order, with their common block size."""

    block_size: int
    regions: tuple[Region, ...]
    identity: Optional[ModelIdentity] = None  # the model's, for a handshake (pd/identity.py)

    @classmethod
    def of(cls, kv_caches: Sequence[LayerCache]) -> "CacheLayout":
        """The layout of a tuple of per-layer caches; each tensor must be contiguous."""
        if not kv_caches:
            raise ValueError("kv_caches is empty: a layout needs at least one layer")
        regions = []
        for i, cache in enumerate(kv_caches):
            check_layer_cache(cache, f"kv_caches[{i}]")
            for field, t in zip(cache._fields, cache):
                regions.append(_region(i, field, t))
        sizes = {r.block_shape[0] for r in regions}
        counts = {r.num_blocks for r in regions}
        if len(sizes) != 1 or len(counts) != 1:
            raise ValueError(f"every cache tensor must share num_blocks and block_size, got {sorted(counts)} "
                             f"blocks and block sizes {sorted(sizes)}")
        return cls(sizes.pop(), tuple(regions))

    @property
    def num_layers(self) -> int:
        return len({r.layer for r in self.regions})

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id stands for across all regions."""
        return sum(r.block_bytes for r in self.regions)

    @property
    def fingerprint(self) -> str:
        """A digest of what both sides must agree on (no addresses, no block counts; the identity)."""
        shape = [(r.layer, r.field, r.block_shape, r.dtype, r.block_bytes) for r in self.regions]
        identity = self.identity.to_dict() if self.identity is not None else None
        return hashlib.sha256(json.dumps([self.block_size, shape, identity], sort_keys=True).encode()).hexdigest()[:16]

    def with_identity(self, identity: ModelIdentity) -> "CacheLayout":
        """This layout with the model's identity, for a handshake."""
        return dataclasses.replace(self, identity=identity)

    def to_dict(self) -> dict:
        """JSON-safe form, for a handshake."""
        out = {"block_size": self.block_size,
               "regions": [{**asdict(r), "block_shape": list(r.block_shape)} for r in self.regions]}
        if self.identity is not None:
            out["identity"] = self.identity.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: object) -> "CacheLayout":
        """Strict: the keys ``to_dict`` writes, of the right types (a peer's layout is untrusted);
        ``LayoutMismatch`` naming what is wrong."""
        try:
            return _layout_from_dict(data)
        except (ValueError, TypeError) as e:
            raise LayoutMismatch(f"malformed layout from the peer: {e}") from None

    def check_matches(self, peer: "CacheLayout", peer_name: str = "peer") -> None:
        """Raise ``LayoutMismatch`` naming the first difference between this layout and ``peer``'s."""
        if self.num_layers != peer.num_layers:
            raise LayoutMismatch(f"layer count differs: {self.num_layers} here, {peer.num_layers} on the {peer_name}")
        if self.block_size != peer.block_size:
            raise LayoutMismatch(f"block size differs: {self.block_size} here, {peer.block_size} on the {peer_name}")
        if len(self.regions) != len(peer.regions):
            raise LayoutMismatch(f"tensor count differs: {len(self.regions)} here, {len(peer.regions)} on the "
                                 f"{peer_name}")
        for mine, theirs in zip(self.regions, peer.regions):
            for key in ("field", "dtype", "block_shape", "block_bytes"):
                a, b = getattr(mine, key), getattr(theirs, key)
                if a != b:
                    raise LayoutMismatch(f"{mine.name}: {key.replace('_', ' ')} differs: {a} here, {b} on the "
                                         f"{peer_name}")
        if (self.identity is None) != (peer.identity is None):
            raise LayoutMismatch(f"model identity: {'none' if self.identity is None else 'given'} here, "
                                 f"{'none' if peer.identity is None else 'given'} on the {peer_name}")
        if self.identity is not None:
            difference = self.identity.difference(peer.identity, peer_name)
            if difference:
                raise LayoutMismatch(difference)


_LAYOUT_KEYS = ("block_size", "regions")
_REGION_TYPES = {"layer": int, "field": str, "address": int, "num_blocks": int, "block_bytes": int,
                 "block_shape": (list, tuple), "dtype": str}


def _layout_from_dict(data: object) -> CacheLayout:
    if not isinstance(data, dict) or not {"block_size", "regions"} <= set(data) <= {*_LAYOUT_KEYS, "identity"}:
        raise ValueError("a layout is an object of block_size, regions and (optionally) identity")
    if not isinstance(data["block_size"], int) or not isinstance(data["regions"], list) or not data["regions"]:
        raise ValueError("block_size must be an int and regions a non-empty list")
    regions = []
    for i, r in enumerate(data["regions"]):
        if not isinstance(r, dict) or sorted(r) != sorted(_REGION_TYPES):
            raise ValueError(f"regions[{i}] must be an object of exactly {', '.join(_REGION_TYPES)}")
        for key, kind in _REGION_TYPES.items():
            if not isinstance(r[key], kind) or isinstance(r[key], bool):
                raise ValueError(f"regions[{i}].{key} must be {'a list' if key == 'block_shape' else kind.__name__}, "
                                 f"got {type(r[key]).__name__}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in r["block_shape"]):
            raise ValueError(f"regions[{i}].block_shape must be positive ints")
        if min(r["address"], r["num_blocks"], r["block_bytes"]) < 0:
            raise ValueError(f"regions[{i}]: address, num_blocks and block_bytes must be >= 0")
        regions.append(Region(**{**r, "block_shape": tuple(r["block_shape"])}))
    identity = ModelIdentity.from_dict(data["identity"]) if "identity" in data else None
    return CacheLayout(data["block_size"], tuple(regions), identity)


def _region(layer: int, field: str, t: Tensor) -> Region:
    if not t.is_contiguous():
        raise ValueError(f"kv_caches[{layer}].{field} must be contiguous to be transferred by address")
    block_bytes = t.stride(0) * t.element_size()
    return Region(layer, field, t.data_ptr(), t.shape[0], block_bytes, tuple(t.shape[1:]),
                  str(t.dtype).removeprefix("torch."))


class Descriptor(NamedTuple):
    """One contiguous copy: ``length`` bytes from ``src`` (source process) to ``dst`` (destination)."""

    src: int
    dst: int
    length: int


@dataclass(frozen=True)
class TransferPlan:
    """Blocks ``src_blocks[i]`` -> ``dst_blocks[i]`` of every region, as batches of descriptors."""

    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    runs: tuple[tuple[int, int, int], ...]  # (src start, dst start, count)
    batches: tuple[tuple[Descriptor, ...], ...]

    @property
    def num_bytes(self) -> int:
        return sum(d.length for batch in self.batches for d in batch)

    @property
    def num_descriptors(self) -> int:
        return sum(len(batch) for batch in self.batches)


def block_runs(src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(src start, dst start, count)`` of pairs consecutive on both sides, in order."""
    runs: list[list[int]] = []
    for s, d in zip(src_blocks, dst_blocks):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return [tuple(r) for r in runs]


def plan_transfer(src: CacheLayout, dst: CacheLayout, src_blocks: Sequence[int], dst_blocks: Sequence[int], *,
                  max_descriptors: int = DEFAULT_MAX_DESCRIPTORS,
                  max_batch_bytes: Optional[int] = None) -> TransferPlan:
    """The descriptors that copy ``src_blocks`` of ``src`` into ``dst_blocks`` of ``dst``.

    Both lists have one id per block, never the null block, within each side's block count; the
    destination ids are distinct. A batch holds at most ``max_descriptors`` descriptors and, when
    ``max_batch_bytes`` is given, at most that many bytes (a run longer than that is split at
    block boundaries; a single block is never split). Raises ``LayoutMismatch`` / ``ValueError``.
    """
    dst.check_matches(src, "source")
    src_blocks, dst_blocks = tuple(src_blocks), tuple(dst_blocks)
    _check_blocks("src_blocks", src_blocks, src.num_blocks)
    _check_blocks("dst_blocks", dst_blocks, dst.num_blocks)
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"src_blocks has {len(src_blocks)} ids, dst_blocks {len(dst_blocks)}: one each per block")
    if len(set(dst_blocks)) != len(dst_blocks):
        raise ValueError(f"dst_blocks repeats a block: {list(dst_blocks)}")
    if max_descriptors < 1:
        raise ValueError(f"max_descriptors must be >= 1, got {max_descriptors}")
    if max_batch_bytes is not None and max_batch_bytes < max(r.block_bytes for r in src.regions):
        raise ValueError(f"max_batch_bytes={max_batch_bytes} is less than one block of the largest region "
                         f"({max(r.block_bytes for r in src.regions)} bytes)")
    runs = block_runs(src_blocks, dst_blocks)
    pieces = [Descriptor(a.block_address(s), b.block_address(d), n * a.block_bytes)
              for a, b in zip(src.regions, dst.regions)
              for s, d, n in _split_runs(runs, a.block_bytes, max_batch_bytes)]
    return TransferPlan(src_blocks, dst_blocks, tuple(runs), _batches(pieces, max_descriptors, max_batch_bytes))


def _check_blocks(name: str, blocks: tuple[int, ...], num_blocks: int) -> None:
    for i, b in enumerate(blocks):
        if isinstance(b, bool) or not isinstance(b, int) or not NULL_BLOCK < b < num_blocks:
            raise ValueError(f"{name}[{i}]={b!r} is not a usable block id: expected an int in "
                             f"[{NULL_BLOCK + 1}, {num_blocks}) (block {NULL_BLOCK} is the null block)")


def _split_runs(runs: list[tuple[int, int, int]], block_bytes: int,
                max_bytes: Optional[int]) -> list[tuple[int, int, int]]:
    if max_bytes is None:
        return runs
    per = max(1, max_bytes // block_bytes)
    return [(s + k, d + k, min(per, n - k)) for s, d, n in runs for k in range(0, n, per)]


def _batches(pieces: list[Descriptor], max_descriptors: int,
             max_bytes: Optional[int]) -> tuple[tuple[Descriptor, ...], ...]:
    batches: list[list[Descriptor]] = []
    size = 0
    for piece in pieces:
        full = batches and (len(batches[-1]) == max_descriptors or
                            (max_bytes is not None and size + piece.length > max_bytes))
        if not batches or full:
            batches.append([])
            size = 0
        batches[-1].append(piece)
        size += piece.length
    return tuple(tuple(b) for b in batches)



class BlockMap:
    """One process's addresses back to whole blocks: which region, which block, how many."""

    def __init__(self, layout: CacheLayout) -> None:
        self._regions = sorted(enumerate(layout.regions), key=lambda x: x[1].address)
        self._starts = [r.address for _, r in self._regions]

    def locate(self, address: int, length: int) -> Optional[tuple[int, int, int]]:
        """``(region index in the layout, first block, block count)`` where ``[address, +length)`` is
        whole blocks of one region, else None."""
        k = bisect.bisect_right(self._starts, address) - 1
        if k < 0:
            return None
        index, r = self._regions[k]
        offset = address - r.address
        if (offset % r.block_bytes or length <= 0 or length % r.block_bytes
                or offset + length > r.num_blocks * r.block_bytes):
            return None
        return index, offset // r.block_bytes, length // r.block_bytes
