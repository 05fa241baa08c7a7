"""The KV transfer layer: what a transport does (``pd/select.py`` picks one by name).

A transport moves whole blocks of every cache tensor from a source process (prefill) to a
destination process (decode) on an existing engine: Mooncake's TransferEngine
(``pd/mooncake.py``) or torch.distributed with gloo (``pd/gloo.py``). The data never travels
on the control channel (``pd/control.py``), which carries only requests, block ids and verdicts.

The protocol, per process: ``register(kv_caches)`` once, before any graph is captured (the
addresses it records never change afterwards); exchange ``endpoint()`` over the control
channel; ``connect(peer_endpoint)``. Per request both sides derive the same ``TransferPlan``
(``layout.plan_transfer``) from the block ids in the control messages; the source calls
``send(plan)`` and the destination ``receive(plan)``. A pulling transport (``pulls``) moves
the data in ``receive`` alone and its ``send`` returns at once. Blocks hold valid data only once
``receive`` has returned; on any failure it raises ``TransferError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, Optional, Sequence

from ..kv_cache import LayerCache
from .layout import CacheLayout, TransferPlan

ROLES = ("source", "destination")


class TransferError(RuntimeError):
    """A transfer failed or missed its deadline: the destination blocks hold no valid data.

    ``batches_done`` batches of the plan had completed. ``in_flight``: the engine may still write
    into the destination blocks after this error (an abandoned batch), so they must not be
    handed to another request before ``Transport.settled()`` is true.
    """

    def __init__(self, message: str, *, batches_done: int = 0, in_flight: bool = False) -> None:
        super().__init__(message)
        self.batches_done = batches_done
        self.in_flight = in_flight


class Transport(ABC):
    """One process's end of a block transfer between a source and a destination process."""

    name: ClassVar[str]
    pulls: ClassVar[bool]  # the destination reads; send() moves nothing

    def __init__(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.role = role
        self.layout: Optional[CacheLayout] = None
        self._broken: Optional[str] = None  # why an earlier failure broke this transport
        self._closed = False
        # called with the index of each batch this side has completed: received (destination) or, on a
        # pushing transport, sent (source); tests inject faults here
        self.after_batch: Optional[Callable[[int], None]] = None

    @abstractmethod
    def register(self, kv_caches: Sequence[LayerCache]) -> CacheLayout:
        """Make every cache tensor transferable, once, before graph capture; returns their layout."""

    @abstractmethod
    def endpoint(self) -> dict:
        """What the peer needs to reach this process (JSON-safe)."""

    @abstractmethod
    def connect(self, peer: dict, timeout_s: float) -> None:
        """Reach the peer whose ``endpoint()`` is ``peer``; both sides call it after the handshake."""

    @abstractmethod
    def send(self, plan: TransferPlan, timeout_s: float) -> None:
        """Source side of ``plan``; raises ``TransferError``."""

    @abstractmethod
    def receive(self, plan: TransferPlan, timeout_s: float) -> None:
        """Destination side of ``plan``: on return its destination blocks hold the source's data;
        raises ``TransferError`` (within ``timeout_s`` plus a bounded grace)."""

    def settled(self) -> bool:
        """Whether no abandoned batch can still write into this process's memory."""
        return True

    def close(self) -> None:
        """Release the engine's resources (idempotent)."""

    def _live(self, what: str) -> None:
        """Raise unless this transport is open, not broken and registered: ``what`` names the call."""
        if self._closed:
            raise TransferError(f"{what}: the {self.name} transport is closed")
        if self._broken is not None:
            raise TransferError(f"{what}: transport broken after an earlier failure ({self._broken}); "
                                "open a fresh transport")
        if self.layout is None:
            raise RuntimeError(f"{what} before register()")
