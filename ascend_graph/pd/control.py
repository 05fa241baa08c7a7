"""The control channel between a prefill and a decode process: small messages, never KV data.

One ``multiprocessing.connection`` link (a socket with an authentication key; messages are
dicts with an ``"op"``, pickled by value: tensors travel as bytes, never as shared memory): the handshake (layouts and transport endpoints), prefill
requests with the decode side's block ids, each request's verdict and its first token's
logits, releases, and counters. The KV blocks themselves travel on the transport
(``pd/transport.py``). Every wait here has a deadline.
"""

from __future__ import annotations

import os
import pickle
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Optional

AUTHKEY_ENV = "ASCEND_GRAPH_PD_AUTHKEY"
DEFAULT_AUTHKEY = b"ascend-graph-pd"


class PeerLost(ConnectionError):
    """The peer process closed the control channel or died."""


def authkey() -> bytes:
    """The key both ends authenticate with: ``$ASCEND_GRAPH_PD_AUTHKEY`` (hex) or the default."""
    key = os.environ.get(AUTHKEY_ENV)
    return bytes.fromhex(key) if key else DEFAULT_AUTHKEY


class Channel:
    """One end of the control link."""

    def __init__(self, conn: Connection, peer: str) -> None:
        self._conn = conn
        self.peer = peer

    def send(self, op: str, **fields) -> None:
        """Send one message; raises ``PeerLost`` when the peer is gone."""
        try:
            self._conn.send_bytes(pickle.dumps({"op": op, **fields}))
        except (OSError, EOFError) as e:
            raise PeerLost(f"the {self.peer} process is gone ({e})") from e

    def recv(self, timeout_s: Optional[float]) -> Optional[dict]:
        """The next message, or ``None`` when none arrives within ``timeout_s`` (``None``: wait for one)."""
        try:
            if timeout_s is not None and not self._conn.poll(max(timeout_s, 0.0)):
                return None
            return pickle.loads(self._conn.recv_bytes())
        except (OSError, EOFError) as e:
            raise PeerLost(f"the {self.peer} process is gone ({type(e).__name__})") from e

    def expect(self, op: str, timeout_s: float) -> dict:
        """The next message, which must be ``op`` (an ``"error"`` message raises its text)."""
        msg = self.recv(timeout_s)
        if msg is None:
            raise TimeoutError(f"the {self.peer} process sent no {op!r} within {timeout_s:g} s")
        if msg["op"] == "error":
            raise RuntimeError(f"the {self.peer} process refused: {msg['error']}")
        if msg["op"] != op:
            raise RuntimeError(f"the {self.peer} process sent {msg['op']!r}, expected {op!r}")
        return msg

    def close(self) -> None:
        self._conn.close()


def listen(host: str = "127.0.0.1", port: int = 0) -> Listener:
    """A listener on ``host:port`` (port 0: any free one; ``listener.address`` says which)."""
    return Listener((host, port), authkey=authkey())


def accept(listener: Listener, peer: str) -> Channel:
    """Wait for the peer to connect (no deadline: the prefill server waits for its decode side)."""
    return Channel(listener.accept(), peer)


def connect(address: tuple[str, int], peer: str, timeout_s: float) -> Channel:
    """Connect to a listener, retrying until ``timeout_s`` while it is not up yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Channel(Client(address, authkey=authkey()), peer)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {peer} process listens on {address[0]}:{address[1]} "
                                   f"(waited {timeout_s:g} s)") from None
            time.sleep(0.05)
