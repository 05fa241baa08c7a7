"""Per-block digests of the KV caches: which blocks a step changed, without a copy of the cache.

``block_digests(caches)`` reads each cache tensor ``[num_blocks, ...]`` as 16-bit units (bytes
for a 1-byte dtype; lane ``j`` is unit ``j`` of every element) and gives every block, per lane,
``sum_i w_i * u_i mod p`` over the block's elements ``i``: ``p = 2^31 - 1`` (prime), ``u_i`` the
unit as an unsigned value, ``w_i`` fixed weights in ``[1, 2^28)``. How strong: a change confined
to one element changes one of its lanes by ``d``, ``0 < |d| < 2^16 < p``, so that lane's digest
changes by ``w_i * d``, never ``0 mod p``: every single-element change is caught (NaN payloads
and signed zeros included: the bits are compared, not the values). Changes of several elements
escape only where they cancel mod ``p``: for changes that do not depend on the weights, a chance
of at most ``2^-28`` per lane. Cost: one read of the cache as int64, a chunk of blocks at a time
(``CHUNK_UNITS``); the digests are ``num_blocks * lanes`` int64 per cache tensor.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

PRIME = 2**31 - 1
WEIGHT_BITS = 28  # products < 2^44: a block of up to 2^19 elements sums without overflow
CHUNK_UNITS = 1 << 22  # 16-bit units read as int64 at once (32 MiB)


@functools.lru_cache(maxsize=8)
def _weights(n: int, device: torch.device) -> Tensor:
    """``[n, 1]`` int64 weights in ``[1, 2^WEIGHT_BITS)``, the same in every process."""
    gen = torch.Generator().manual_seed(0x5EED)
    return torch.randint(1, 2**WEIGHT_BITS, (n, 1), generator=gen, dtype=torch.int64).to(device)


def units(t: Tensor) -> tuple[torch.dtype, int]:
    """The unsigned-readable unit ``t``'s bits are compared in, and how many make one element."""
    unit = torch.int16 if t.element_size() % 2 == 0 else torch.uint8
    return unit, t.element_size() // unit.itemsize


def tensor_digest(t: Tensor) -> Tensor:
    """``[t.shape[0], lanes]`` int64: each block's digest per lane (module docstring)."""
    unit, lanes = units(t)
    per_block = t[0].numel()
    w = _weights(per_block, t.device)
    exact_sum = per_block < 2 ** (63 - WEIGHT_BITS - 16)
    step = max(1, CHUNK_UNITS // max(1, per_block * lanes))
    out = []
    for b in range(0, t.shape[0], step):
        u = t[b:b + step].contiguous().view(unit).reshape(-1, per_block, lanes).to(torch.int64) & 0xFFFF
        products = u * w if exact_sum else (u * w) % PRIME
        out.append(products.sum(dim=1) % PRIME)
    return torch.cat(out)


def block_digests(caches: tuple) -> list[list[Tensor]]:
    """Per layer, per cache element (in ``cache._fields`` order): ``tensor_digest`` of it."""
    return [[tensor_digest(t) for t in cache] for cache in caches]


def changed_blocks(before: list[list[Tensor]], after: list[list[Tensor]], caches: tuple,
                   skip: Tensor) -> list[dict]:
    """Where ``after`` differs from ``before`` (per-block digests, ``[num_blocks, lanes]``, or
    whole-tensor copies) outside the blocks ``skip``: ``{"layer", "element", "blocks"}`` per
    cache tensor with a changed block, in layer order; empty when none changed."""
    found = []
    for i, (cache, b_layer, a_layer) in enumerate(zip(caches, before, after)):
        for name, b, a in zip(cache._fields, b_layer, a_layer):
            unit, _ = units(b)  # bit for bit: a NaN equals itself, -0.0 differs from 0.0
            b, a = b.contiguous().view(unit), a.contiguous().view(unit)
            differs = (b != a).flatten(1).any(dim=1)
            differs[skip] = False
            blocks = torch.nonzero(differs).flatten().tolist()
            if blocks:
                found.append({"layer": i, "element": name, "blocks": blocks})
    return found
