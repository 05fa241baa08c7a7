"""The gloo transport: the source pushes packed blocks over torch.distributed's gloo backend.

A private two-rank group per transport (never the default process group): the destination is
rank 0 and hosts the rendezvous ``TCPStore`` on a free port of ``host``; the source is rank 1.
Per batch of the plan and per region, the source packs its blocks with ``index_select`` into
messages of at most ``chunk_bytes`` and sends them; the destination receives each into a
private staging tensor and ``index_copy_``s it into its registered cache tensors (addresses
unchanged). Both sides derive the same message sequence from the same plan.

The cache tensors are written only by ``index_copy_`` after a message has fully arrived, so a
failure never leaves a write in flight (``settled()`` is always true). A failed or late message
(the deadline is ``timeout_s`` for the whole plan) breaks the group: this transport raises
``TransferError`` then and at every later call, and the caller opens a fresh one.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..kv_cache import LayerCache
from .layout import BlockMap, CacheLayout, TransferPlan
from .transport import TransferError, Transport

DEFAULT_CHUNK_BYTES = 8 << 20  # bytes per message: bounds the staging and packing buffers
_SOURCE, _DESTINATION = 1, 0  # ranks


class GlooTransport(Transport):
    """One end of a gloo push; ``send`` and ``receive`` run at the same time in the two processes."""

    name = "gloo"
    pulls = False

    def __init__(self, role: str, host: str = "127.0.0.1", chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__(role)
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.host = host
        self.chunk_bytes = chunk_bytes
        self._tensors: list[Tensor] = []  # one per region, the caller's cache tensors
        self._peer_layout: Optional[CacheLayout] = None
        self._store: Optional[dist.TCPStore] = None
        self._group = None
        self._abandoned: list = []  # (work, buffer) of a failed message: the buffer outlives the work

    def register(self, kv_caches: Sequence[LayerCache]) -> CacheLayout:
        """Record the cache tensors (nothing to pin); the destination also starts its store."""
        if self.layout is not None:
            raise RuntimeError("register() was called already: cache tensors are registered once")
        self.layout = CacheLayout.of(kv_caches)
        self._tensors = [t for cache in kv_caches for t in cache]
        if self.role == "destination":
            self._store = dist.TCPStore(self.host, 0, 2, True, timedelta(seconds=60), wait_for_workers=False)
        return self.layout

    def endpoint(self) -> dict:
        """``host``/``port`` of the destination's store (none on the source); ``layout``."""
        self._live("endpoint")
        out = {"transport": self.name, "layout": self.layout.to_dict()}
        if self._store is not None:
            out.update(host=self.host, port=self._store.port)
        return out

    def connect(self, peer: dict, timeout_s: float) -> None:
        """Check the peer's layout and form the two-rank group (both sides call it; it returns once
        both have joined, or raises ``TransferError`` after ``timeout_s``)."""
        self._live("connect")
        self._peer_layout = CacheLayout.from_dict(peer["layout"])
        self._peer_layout.check_matches(self.layout, "peer")
        timeout = timedelta(seconds=timeout_s)
        try:
            if self.role == "source":
                self._store = dist.TCPStore(str(peer["host"]), int(peer["port"]), 2, False, timeout)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            rank = _SOURCE if self.role == "source" else _DESTINATION
            self._group = dist.ProcessGroupGloo(self._store, rank, 2, options)
        except (RuntimeError, dist.DistStoreError) as e:
            self._fail(f"connect: {e}")
            raise TransferError(f"gloo connect failed: {e}") from e

    def send(self, plan: TransferPlan, timeout_s: float) -> None:
        """Push every block of ``plan``: pack, send, wait, message by message, within ``timeout_s``;
        ``after_batch(i)`` once batch ``i`` is sent."""
        self._ready("send")
        deadline = time.monotonic() + timeout_s
        for i, batch in enumerate(self._messages(plan)):
            for region, src_ids, _ in batch:
                packed = self._tensors[region].index_select(0, torch.tensor(src_ids))
                self._finish(self._group.send, _DESTINATION, packed, deadline, i, "send")
            if self.after_batch is not None:
                self.after_batch(i)

    def receive(self, plan: TransferPlan, timeout_s: float) -> None:
        """Receive every message of ``plan`` into staging and copy it into the caches; ``after_batch(i)``
        after batch ``i``. Raises ``TransferError`` within ``timeout_s`` (plus a bounded grace)."""
        self._ready("receive")
        deadline = time.monotonic() + timeout_s
        for i, batch in enumerate(self._messages(plan)):
            for region, _, dst_ids in batch:
                cache = self._tensors[region]
                staging = cache.new_empty((len(dst_ids), *cache.shape[1:]))
                self._finish(self._group.recv, _SOURCE, staging, deadline, i, "receive")
                cache.index_copy_(0, torch.tensor(dst_ids), staging)
            if self.after_batch is not None:
                self.after_batch(i)

    def _finish(self, op, rank: int, buffer: Tensor, deadline: float, batch: int, what: str) -> None:
        """Start ``op`` (the group's send or recv) on ``buffer`` and wait for it until ``deadline``."""
        work = None
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("the deadline passed")
            work = op([buffer], rank, 0)
            work.wait(timedelta(seconds=left))
        except RuntimeError as e:
            self._abandoned.append((work, buffer))  # gloo may still touch the buffer
            self._fail(f"{what} of batch {batch}: {e}")
            raise TransferError(f"gloo {what} failed in batch {batch}: {e}", batches_done=batch) from e

    def _messages(self, plan: TransferPlan) -> list[list[tuple[int, list[int], list[int]]]]:
        """Per batch, the messages ``(region, source block ids, destination block ids)``: per region
        in the batch's order, its blocks in chunks of at most ``chunk_bytes`` (at least one block).
        Raises ``TransferError`` (nothing sent) where a descriptor lies outside either layout."""
        mine, theirs = BlockMap(self.layout), BlockMap(self._peer_layout)
        src_map, dst_map = (theirs, mine) if self.role == "destination" else (mine, theirs)
        out = []
        for i, batch in enumerate(plan.batches):
            per_region: dict[int, tuple[list[int], list[int]]] = {}
            for d in batch:
                region, s0, n = _located(src_map, d.src, d.length, i, "source")
                region_d, d0, _ = _located(dst_map, d.dst, d.length, i, "destination")
                if region != region_d:
                    raise TransferError(f"batch {i}: a descriptor pairs region {region} with region {region_d}")
                ids = per_region.setdefault(region, ([], []))
                ids[0].extend(range(s0, s0 + n))
                ids[1].extend(range(d0, d0 + n))
            messages = []
            for region, (src_ids, dst_ids) in per_region.items():
                per = max(1, self.chunk_bytes // self.layout.regions[region].block_bytes)
                messages += [(region, src_ids[k:k + per], dst_ids[k:k + per]) for k in range(0, len(src_ids), per)]
            out.append(messages)
        return out

    def _fail(self, reason: str) -> None:
        self._broken = reason
        if self._group is not None:
            try:
                self._group.abort()
            except RuntimeError:
                pass

    def close(self) -> None:
        """Shut the group and the store down (idempotent)."""
        if self._closed:
            return
        self._closed = True
        group, self._group = self._group, None
        if group is not None and self._broken is None:
            try:
                group.shutdown()
            except RuntimeError:
                pass
        self._store = None

    def _ready(self, what: str) -> None:
        self._live(what)
        if self._group is None:
            raise RuntimeError(f"{what} before connect()")



def _located(blocks: BlockMap, address: int, length: int, batch: int, side: str) -> tuple[int, int, int]:
    found = blocks.locate(address, length)
    if found is None:
        raise TransferError(f"batch {batch}: {side} range [{address:#x}, +{length}) is not whole blocks of that "
                            "process's caches; nothing was sent")
    return found
