"""The control channel between a prefill and a decode process: small messages, never KV data.

One TCP link, authenticated by the shared secret (``pd/auth.py``: a mutual HMAC challenge, then
an HMAC on every frame) and carrying only the messages declared below (``pd/wire.py``: JSON
headers, the first token's logits as raw bytes with dtype and shape; nothing is unpickled). The
KV blocks travel on the transport (``pd/transport.py``). Every wait has a deadline.

decode -> prefill (``TO_PREFILL``)
  ``hello`` layout, endpoint, transport, plan_options, drafting  the handshake (``layout``:
          ``CacheLayout`` with the model identity; ``drafting``: its ``num_speculative_tokens``, 0
          if absent)
  ``prefill`` jobs [{id, prompt, dst_blocks, timeout_s}]
  ``release`` id     the decode side has read the blocks (or gave up); answered by ``released``
  ``cancel`` id      drop a job not prefilled yet, or its blocks; no answer
  ``stats``          answered by ``stats``
  ``shutdown``
prefill -> decode (``TO_DECODE``)
  ``hello`` layout, endpoint, pid, fingerprint, drafting (its ``num_speculative_tokens``; 0 if
          absent);  ``error`` error (a refused handshake or message)
  ``prefilled`` id, src_blocks, logits (tensor [V]; drafting: its prefill step's row, [2V] or, at
                drafting > 1, [2V + E]), lease_s (the blocks' lease, from now)
  ``failed`` id, error
  ``released`` id, held  held: the lease was still held when the release came, so no other
                          request could have used the blocks meanwhile (the fence)
  ``stats`` counters
"""

from __future__ import annotations

from typing import Any, Optional

from .wire import (BOOL, INT, INTS, NUM, OBJECT, STR, TENSOR, Connection, Field, Listener, PeerLost, Schema,
                   WireError, connect as _connect, list_of, nullable, optional, record)

__all__ = ["Channel", "PeerLost", "TO_DECODE", "TO_PREFILL", "WireError", "accept", "connect", "listen"]

_JOB = record({"id": INT, "prompt": INTS, "dst_blocks": INTS, "timeout_s": NUM})
_PLAN_OPTIONS = record({"max_descriptors": INT, "max_batch_bytes": nullable(INT)})
TO_PREFILL = Schema("decode -> prefill", {
    "hello": {"layout": OBJECT, "endpoint": OBJECT, "transport": STR,
              "plan_options": optional(Field(_PLAN_OPTIONS)), "drafting": optional(INT)},
    "prefill": {"jobs": Field(list_of(_JOB))},
    "release": {"id": INT},
    "cancel": {"id": INT},
    "stats": {},
    "shutdown": {},
})
TO_DECODE = Schema("prefill -> decode", {
    "hello": {"layout": OBJECT, "endpoint": OBJECT, "pid": INT, "fingerprint": STR, "drafting": optional(INT)},
    "error": {"error": STR},
    "prefilled": {"id": INT, "src_blocks": INTS, "logits": TENSOR, "lease_s": NUM},
    "failed": {"id": INT, "error": STR},
    "released": {"id": INT, "held": BOOL},
    "stats": {"counters": OBJECT},
})
MAX_MESSAGE_BYTES = 64 << 20  # a batch of long prompts, or a vocabulary-sized logits row, fits


class Channel:
    """One end of the control link (a ``wire.Connection`` with ``expect``)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.peer = conn.peer

    def send(self, op: str, **fields: Any) -> None:
        """Send one message; ``PeerLost`` when the peer is gone, ``WireError`` (nothing sent) when it
        breaks the declared schema."""
        self._conn.send(op, **fields)

    def recv(self, timeout_s: float) -> Optional[dict]:
        """The next message, or None when none starts within ``timeout_s``; ``WireError`` for a refused
        message (the link goes on), ``PeerLost`` when the peer is gone."""
        return self._conn.recv(timeout_s)

    def expect(self, op: str, timeout_s: float) -> dict:
        """The next message, which must be ``op`` (an ``"error"`` message raises its text)."""
        msg = self.recv(timeout_s)
        if msg is None:
            raise TimeoutError(f"the {self.peer} sent no {op!r} within {timeout_s:g} s")
        if msg["op"] == "error":
            raise RuntimeError(f"the {self.peer} refused: {msg['error']}")
        if msg["op"] != op:
            raise RuntimeError(f"the {self.peer} sent {msg['op']!r}, expected {op!r}")
        return msg

    def close(self) -> None:
        self._conn.close()


def listen(secret: bytes, host: str = "127.0.0.1", port: int = 0) -> Listener:
    """A listener for the decode side on ``host:port`` (port 0: any free one; ``.address`` says which)."""
    return Listener(host, port, secret)


def accept(listener: Listener, timeout_s: float) -> Channel:
    """The prefill side's link: the first decode process to pass the challenge within ``timeout_s``."""
    return Channel(listener.accept(timeout_s, "decode process", TO_PREFILL, TO_DECODE,
                                   max_bytes=MAX_MESSAGE_BYTES))


def connect(address: tuple[str, int], secret: bytes, timeout_s: float) -> Channel:
    """The decode side's link to a prefill server, retrying until ``timeout_s`` while it is not up yet.
    ``AuthError`` where the secrets differ."""
    return Channel(_connect(address, secret, "prefill process", TO_DECODE, TO_PREFILL, timeout_s=timeout_s,
                            max_bytes=MAX_MESSAGE_BYTES))
