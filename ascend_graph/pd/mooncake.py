"""The Mooncake transport: the destination pulls blocks out of the source's registered caches.

Both processes run one Mooncake ``TransferEngine`` over TCP with peer-to-peer handshakes (no
metadata server) and register every cache tensor once. The source's ``send`` moves nothing:
the destination's ``receive`` reads each batch of the plan (``batch_transfer_async_read``) and
waits for it on a helper thread, so that a hung peer fails at the caller's deadline.

What the engine does on faults (measured by hand, docs/pd.md): a batch whose peer address lies outside
the peer's registered memory fails (status -1) at once, a killed peer soon after, a hung
(stopped) peer only at the engine's transfer timeout (``MC_TRANSFER_TIMEOUT``).
Its status call blocks until then, and after a failure the engine may still write data that
arrives late into the destination blocks; only destroying the engine ends that. So any failure
after a batch was submitted breaks the transport: it raises ``TransferError(in_flight=True)``,
and a helper thread destroys the engine once its status wait has returned; ``settled()`` turns
true after that. Later calls raise at once; the caller opens a fresh transport. The engine's
destructor holds the GIL while it runs: the whole process stalls that long after a
failure (on the helper thread) and in ``close()``.

Environment: ``MC_LOG_LEVEL`` defaults to ``ERROR`` (set process-wide unless set);
``MC_TRANSFER_TIMEOUT`` (read by each engine as it starts) is ``engine_timeout_s`` when given,
else the variable's value, else ``DEFAULT_ENGINE_TIMEOUT_S`` (the engine's own default is 30 s).
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from typing import Optional, Sequence

import torch

from ..kv_cache import LayerCache
from .layout import BlockMap, CacheLayout, TransferPlan
from .transport import TransferError, Transport

DEFAULT_ENGINE_TIMEOUT_S = 10  # MC_TRANSFER_TIMEOUT unless set: abandoned batches end within it (+ teardown)
_TEARDOWN_GRACE_S = 10.0  # beyond the engine timeout, for the status wait to return before teardown
_WARMUP_BYTES = 64


def _engine_class():
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read as the module loads
    try:
        engine = importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as e:  # the wheel missing, or libibverbs.so.1 missing under it
        raise ImportError(
            'the Mooncake transport needs Mooncake\'s transfer engine: pip install "ascend-graph[pd]" '
            "(x86_64 Linux), and the system package libibverbs1 (apt-get install libibverbs1) even for TCP; "
            f"importing mooncake.engine failed: {type(e).__name__}: {e}") from e
    return engine.TransferEngine


class MooncakeTransport(Transport):
    """One end of a Mooncake TCP transfer; ``pulls``: the destination reads, the source serves."""

    name = "mooncake"
    pulls = True

    def __init__(self, role: str, host: str = "127.0.0.1", engine_timeout_s: Optional[int] = None) -> None:
        super().__init__(role)
        self.host = host
        self.engine_timeout_s = engine_timeout_s
        self._engine = None
        self._tensors: list = []  # the registered tensors, kept alive while the engine may touch them
        self._scratch = torch.zeros(_WARMUP_BYTES, dtype=torch.uint8)  # the warm-up read's target
        self._peer: Optional[str] = None
        self._reaper: Optional[threading.Thread] = None
        self._waiter: Optional[threading.Thread] = None  # a status wait abandoned at a deadline
        self._timeout_s = DEFAULT_ENGINE_TIMEOUT_S  # the engine's transfer timeout, once started

    # -- setup --------------------------------------------------------------------------------

    def register(self, kv_caches: Sequence[LayerCache]) -> CacheLayout:
        """Start the engine and register every cache tensor (whole) and a small scratch buffer."""
        if self.layout is not None:
            raise RuntimeError("register() was called already: cache tensors are registered once")
        layout = CacheLayout.of(kv_caches)
        engine, self._timeout_s = _start_engine(_engine_class(), self.host, self.engine_timeout_s)
        tensors = [t for cache in kv_caches for t in cache] + [self._scratch]
        rc = engine.batch_register_memory([t.data_ptr() for t in tensors],
                                          [t.numel() * t.element_size() for t in tensors])
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register the cache tensors (status {rc}; -7: a tensor "
                               "overlaps another registered region)")
        self._engine, self._tensors, self.layout = engine, tensors, layout
        return layout

    def endpoint(self) -> dict:
        """``session``: the engine's ``host:rpc_port``; ``layout``: this process's cache layout."""
        self._live("endpoint")
        return {"transport": self.name, "session": f"{self.host}:{self._engine.get_rpc_port()}",
                "layout": self.layout.to_dict()}

    def connect(self, peer: dict, timeout_s: float) -> None:
        """Check the peer's layout; the destination also makes its first (slow) read now."""
        self._live("connect")
        CacheLayout.from_dict(peer["layout"]).check_matches(self.layout, "peer")
        self._peer = str(peer["session"])
        if self.role == "destination":
            region = CacheLayout.from_dict(peer["layout"]).regions[0]
            n = min(_WARMUP_BYTES, region.block_bytes)
            self._read_batches([((self._scratch.data_ptr(), region.address, n),)], timeout_s, "warm-up read")

    # -- transfers ----------------------------------------------------------------------------

    def send(self, plan: TransferPlan, timeout_s: float) -> None:
        """Nothing to do: the destination reads. Raises if the transport is broken or closed."""
        self._live("send")

    def receive(self, plan: TransferPlan, timeout_s: float) -> None:
        """Read every batch of ``plan`` in order, one in flight; ``after_batch(i)`` after each.

        Every destination range must be whole blocks of this process's caches (checked before
        anything is read: ``TransferError(in_flight=False)``). The peer's engine checks its side.
        """
        self._live("receive")
        if self._peer is None:
            raise RuntimeError("receive() before connect()")
        _check_local(plan, self.layout)
        batches = [tuple((d.dst, d.src, d.length) for d in batch) for batch in plan.batches]
        self._read_batches(batches, timeout_s, "transfer")

    def _read_batches(self, batches, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        for i, batch in enumerate(batches):
            dsts, srcs, lengths = (list(x) for x in zip(*batch))
            batch_id = self._engine.batch_transfer_async_read(self._peer, dsts, srcs, lengths)
            status = self._wait(batch_id, deadline) if batch_id > 0 else batch_id or -1  # <= 0: not submitted
            if status != 0:
                reason = (f"missed its deadline ({timeout_s:g} s)" if status is None
                          else f"failed (engine status {status})")
                self._break(f"{what} from {self._peer}: batch {i} of {len(batches)} {reason}")
                raise TransferError(f"Mooncake {what} from {self._peer}: batch {i} of {len(batches)} {reason}; "
                                    "the destination blocks hold no valid data", batches_done=i, in_flight=True)
            if self.after_batch is not None and what == "transfer":
                self.after_batch(i)

    def _wait(self, batch_id: int, deadline: float) -> Optional[int]:
        """The batch's final status (0 done, negative failed), or None at the deadline."""
        result: list = []
        engine = self._engine

        def wait() -> None:  # the engine's status call blocks until the batch ends (GIL released)
            result.append(engine.get_batch_transfer_status([batch_id]))

        waiter = threading.Thread(target=wait, name="mooncake-status", daemon=True)
        waiter.start()
        waiter.join(max(0.0, deadline - time.monotonic()))
        if waiter.is_alive():
            self._waiter = waiter
            return None
        self._waiter = None
        return result[0]

    # -- failure and teardown -----------------------------------------------------------------

    def _break(self, reason: str) -> None:
        """Mark the transport broken and destroy the engine once no status wait holds it."""
        self._broken = reason
        engine, self._engine = self._engine, None
        waiter, self._waiter = self._waiter, None
        limit = self._timeout_s + _TEARDOWN_GRACE_S
        tensors = self._tensors  # what the engine may still write into outlives it, even if this object does not

        def reap() -> None:
            nonlocal engine, tensors
            if waiter is not None:
                waiter.join(limit)
            del engine  # the last reference: the engine's destructor closes its connections
            del tensors

        self._reaper = threading.Thread(target=reap, name="mooncake-teardown", daemon=True)
        self._reaper.start()

    def settled(self) -> bool:
        """True once no abandoned read can still land: none was abandoned, or its engine is gone."""
        return self._reaper is None or not self._reaper.is_alive()

    def close(self) -> None:
        """Destroy the engine (slow; idempotent). A broken one is torn down already."""
        if self._closed:
            return
        self._closed = True
        if self._engine is not None:
            engine, self._engine = self._engine, None
            del engine


def _start_engine(engine_class, host: str, timeout_s: Optional[int]):
    """A TCP engine on ``host`` with peer-to-peer handshakes (its port binds every interface), and
    the transfer timeout it runs with. ``timeout_s`` overrides ``MC_TRANSFER_TIMEOUT`` for it alone."""
    before = os.environ.get("MC_TRANSFER_TIMEOUT")
    value = str(int(timeout_s)) if timeout_s is not None else before or str(DEFAULT_ENGINE_TIMEOUT_S)
    os.environ["MC_TRANSFER_TIMEOUT"] = value
    try:
        engine = engine_class()
        rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    finally:
        if before is None:
            os.environ.pop("MC_TRANSFER_TIMEOUT", None)
        else:
            os.environ["MC_TRANSFER_TIMEOUT"] = before
    if rc != 0:
        raise RuntimeError(f"Mooncake's transfer engine did not start on {host} (status {rc})")
    try:
        effective = int(value)
    except ValueError:
        effective = 30  # the engine's own default when the variable does not parse
    return engine, max(effective, 5)  # the engine's floor for its transfer timeout (docs/pd.md)


def _check_local(plan: TransferPlan, layout: CacheLayout) -> None:
    """Every descriptor's destination range is whole blocks of one of this process's cache tensors."""
    blocks = BlockMap(layout)
    for i, batch in enumerate(plan.batches):
        for d in batch:
            if blocks.locate(d.dst, d.length) is None:
                raise TransferError(f"batch {i}: destination range [{d.dst:#x}, +{d.length}) is not whole blocks "
                                    "of this process's registered caches; nothing was read", batches_done=0)
