"""What ``kv_connector.TupleCacheConnector`` needs beyond ``ascend_graph.pd``, without vLLM.

The layouts, transfer plans and the transfer engine are ``ascend_graph.pd``'s (``pd/layout.py``,
``pd/mooncake.py``); this module adds (docs/vllm.md, "PD between two vLLM instances"):

- ``ControlServer`` / ``ask``: one JSON object per line over TCP, one request per connection. The
  producer answers ``{"op": "layout"}`` with ``layout_reply`` (its transport's endpoint, its cache
  layout, its engine id) and records ``{"op": "done", "request_id": ...}``, the consumer's word
  that it is through with a request's blocks (so they may be freed). Unlike ``pd/control.py``
  (one authenticated link to one peer), any number of consumers ask, each at any time.
- ``Puller``: the consumer's pulls, one pulling transport per producer instance (connected at
  its first request), and what happens after a failed pull: the request's blocks are reported
  back only once no abandoned read can still write into them.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ..kv_cache import LayerCache
from ..pd.layout import CacheLayout, TransferPlan, plan_transfer
from ..pd.select import open_transport
from ..pd.transport import Transport

MAX_MESSAGE = 1 << 20  # bytes of one control-channel line
logger = logging.getLogger(__name__)


class ControlServer:
    """A TCP server on ``(host, port)`` answering each JSON line with ``handler(message)``'s JSON.

    Serves from daemon threads until ``close``; a handler error answers ``{"error": ...}``."""

    def __init__(self, host: str, port: int, handler: Callable[[dict], dict], timeout_s: float = 10.0) -> None:
        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                self.connection.settimeout(timeout_s)
                try:
                    line = self.rfile.readline(MAX_MESSAGE)
                    reply = handler(json.loads(line))
                except Exception as e:  # the peer gets the reason; the server keeps serving
                    reply = {"error": f"{type(e).__name__}: {e}"}
                self.wfile.write(json.dumps(reply).encode() + b"\n")

        class Server(socketserver.ThreadingTCPServer):
            allow_reuse_address = True
            daemon_threads = True

        self._server = Server((host, port), Handler)
        self.address = self._server.server_address[:2]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="ascend-graph-kv-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def ask(host: str, port: int, message: dict, timeout_s: float = 10.0) -> dict:
    """Send ``message`` to a ``ControlServer``; its reply. ``ConnectionError`` on an error reply."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(json.dumps(message).encode() + b"\n")
        with sock.makefile("rb") as f:
            line = f.readline(MAX_MESSAGE)
    if not line:
        raise ConnectionError(f"{host}:{port} closed the control connection without a reply")
    reply = json.loads(line)
    if "error" in reply:
        raise ConnectionError(f"{host}:{port} answered {message.get('op')!r} with: {reply['error']}")
    return reply


def layout_reply(transport: Transport, engine_id: str) -> dict:
    """The producer's answer to ``{"op": "layout"}``: how to reach its registered caches."""
    if transport.layout is None:
        raise RuntimeError("the producer's caches are not registered yet")
    return {"engine_id": engine_id, "endpoint": transport.endpoint(), "layout": transport.layout.to_dict()}


@dataclass(frozen=True)
class Producer:
    """One producer instance: its control server's address and its engine id."""

    host: str
    port: int
    engine_id: str

    def __str__(self) -> str:
        return f"producer {self.engine_id} at {self.host}:{self.port}"


class Puller:
    """The consumer side: pulls producers' blocks into ``kv_caches`` with a pulling transport each.

    ``load`` runs one request's pull; ``take_finished`` then reports it (and, where it failed, its
    blocks). A failure before anything is read (handshake, layouts, block ids) is reported at once.
    A failed ``receive`` retires that producer's transport, and the request is reported only once
    the transport is ``settled()``: after a failure with reads in flight
    (``TransferError.in_flight``) that is when its engine is gone (``pd/mooncake.py`` bounds it), so
    vLLM neither reuses nor recomputes the blocks while a late write can land. The producer's next
    request opens a fresh transport.
    """

    def __init__(self, kv_caches: Sequence[LayerCache], host: str = "127.0.0.1", timeout_s: float = 20.0,
                 new_transport: Optional[Callable[[], Transport]] = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.kv_caches = tuple(kv_caches)
        self.layout = CacheLayout.of(self.kv_caches)
        self.timeout_s = timeout_s
        self._new_transport = new_transport or (lambda: open_transport("mooncake", "destination", host))
        self._peers: dict[Producer, tuple[Transport, CacheLayout]] = {}
        self._done: set[str] = set()  # request ids whose pull has ended and whose blocks are safe
        self._failed: set[int] = set()  # their blocks, where the pull failed
        self._held: list[tuple[str, list[int], Transport]] = []  # failed receives, until their transport settles
        self.transports_opened = 0

    def load(self, request_id: str, producer: Producer, src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> Optional[TransferPlan]:
        """Pull ``src_blocks`` of ``producer`` into ``dst_blocks``; the plan, or None where it failed
        (logged; the failure then reaches ``take_finished``). Never raises for a failed pull."""
        try:
            transport, remote = self._peer(producer)
            plan = plan_transfer(remote, self.layout, src_blocks, dst_blocks)
        except Exception as e:  # nothing was read into dst_blocks
            return self._fail(request_id, producer, dst_blocks, e, None)
        try:
            transport.receive(plan, self.timeout_s)
        except Exception as e:  # reads may still land (TransferError.in_flight): held until settled
            self._peers.pop(producer, None)  # a later request opens a fresh transport
            return self._fail(request_id, producer, dst_blocks, e, transport)
        self._done.add(request_id)
        return plan

    def take_finished(self) -> tuple[set[str], set[int]]:
        """Requests whose pull has ended with no read left that can write into their blocks, and the
        blocks of those that failed; each reported once."""
        still = []
        for request_id, blocks, transport in self._held:
            if transport.settled():
                self._done.add(request_id)
                self._failed.update(blocks)
                transport.close()
            else:
                still.append((request_id, blocks, transport))
        self._held = still
        done, failed, self._done, self._failed = self._done, self._failed, set(), set()
        return done, failed

    @property
    def holding(self) -> int:
        """Failed requests waiting for their transport to settle."""
        return len(self._held)

    def close(self) -> None:
        """Close every transport (each engine's teardown is slow)."""
        for transport, _ in self._peers.values():
            transport.close()
        self._peers = {}

    def _peer(self, producer: Producer) -> tuple[Transport, CacheLayout]:
        """The producer's transport and layout, handshaken once per producer instance."""
        if producer not in self._peers:
            reply = ask(producer.host, producer.port, {"op": "layout"}, self.timeout_s)
            if reply.get("engine_id") != producer.engine_id:  # another instance now listens there
                raise ConnectionError(f"{producer.host}:{producer.port} is instance {reply.get('engine_id')}, "
                                      f"not {producer.engine_id}")
            remote = CacheLayout.from_dict(reply["layout"])
            self.layout.check_matches(remote, str(producer))
            transport = self._new_transport()
            self.transports_opened += 1
            try:
                transport.register(self.kv_caches)
                transport.connect(reply["endpoint"], self.timeout_s)  # its warm-up read lands in scratch only
            except BaseException:
                transport.close()
                raise
            self._peers[producer] = (transport, remote)
        return self._peers[producer]

    def _fail(self, request_id: str, producer: Producer, blocks: Sequence[int], error: Exception,
              retired: Optional[Transport]) -> None:
        logger.error("pulling request %s from %s failed: %s: %s", request_id, producer, type(error).__name__, error)
        if retired is not None:
            self._held.append((request_id, list(blocks), retired))
        else:
            self._done.add(request_id)
            self._failed.update(blocks)
        return None
