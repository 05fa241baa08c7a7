"""What ``kv_connector.TupleCacheConnector`` needs beyond ``ascend_graph.pd``, without vLLM.

The layouts, transfer plans and the transfer engine are ``ascend_graph.pd``'s (``pd/layout.py``,
``pd/mooncake.py``); so are the wire format and the authentication (``pd/wire.py``,
``pd/auth.py``: declared JSON messages, a mutual HMAC challenge on a shared secret, an HMAC per
frame; nothing is unpickled). This module adds (docs/vllm.md, "PD between two vLLM instances"):

- ``ControlServer`` / ``ask``: one request and its reply per authenticated TCP connection. The
  producer answers ``layout`` with ``layout_reply`` (its transport's endpoint, its cache layout
  with the model identity, its engine id) and ``done`` (``request_id``: the consumer has read
  that request's blocks) with the request's lease: ``held`` (the blocks were still leased, so
  the data read is the request's), ``expired`` (they may have been reused: discard it) or
  ``unknown`` (the producer's worker has not seen the request yet: ask again). Any number of
  consumers ask, each at any time.
- ``Leases``: the producer's leases, decided under one lock with the answers to ``done``.
- ``Puller``: the consumer's pulls, one pulling transport per producer instance (connected at
  its first request), the fence (a pull counts only when the producer answers ``held``), and
  what happens after a failed pull: the request's blocks are reported back only once no
  abandoned read can still write into them.
"""

from __future__ import annotations

import logging
import socketserver
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

from ..kv_cache import LayerCache
from ..pd.auth import server_handshake
from ..pd.identity import ModelIdentity
from ..pd.layout import CacheLayout, TransferPlan, plan_transfer
from ..pd.select import open_transport
from ..pd.transport import Transport
from ..pd.wire import OBJECT, STR, Connection, PeerLost, Schema, WireError, connect

MAX_MESSAGE = 1 << 20  # bytes of one control message
LEASE_ANSWERS = ("held", "expired", "unknown")
REQUESTS = Schema("consumer -> producer", {"layout": {}, "done": {"request_id": STR}})
REPLIES = Schema("producer -> consumer", {
    "layout": {"engine_id": STR, "endpoint": OBJECT, "layout": OBJECT},
    "done": {"lease": STR},
    "error": {"error": STR},
})
logger = logging.getLogger(__name__)


class ControlServer:
    """An authenticated TCP server on ``(host, port)``: per connection, the challenge, one request
    (``REQUESTS``) and ``handler(message)``'s reply (``REPLIES``, under the request's op).

    Serves from daemon threads until ``close``. A peer without the secret is refused before it
    can send anything; a handler error, or a request that breaks the schema or the size limit,
    is answered ``error`` naming it; the server goes on either way (``counters``)."""

    def __init__(self, host: str, port: int, handler: Callable[[dict], dict], secret: bytes,
                 timeout_s: float = 10.0) -> None:
        counters = self.counters = {"served": 0, "refused_connections": 0, "refused_messages": 0, "errors": 0}
        lock = threading.Lock()

        def count(key: str) -> None:
            with lock:
                counters[key] += 1

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    keys = server_handshake(self.request, secret, time.monotonic() + timeout_s)
                except (OSError, TimeoutError) as e:
                    count("refused_connections")
                    logger.warning("control server: refused %s:%d: %s", *self.client_address[:2], e)
                    return
                conn = Connection(self.request, keys, "consumer", REQUESTS, REPLIES, max_bytes=MAX_MESSAGE,
                                  frame_timeout_s=timeout_s)
                _answer(conn, handler, timeout_s, count)

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


def _answer(conn: Connection, handler: Callable[[dict], dict], timeout_s: float, count) -> None:
    try:
        message = conn.recv(timeout_s)
        if message is None:
            return
        op = message["op"]
        try:
            reply = handler(message)
        except Exception as e:  # the peer gets the reason; the server keeps serving
            count("errors")
            conn.send("error", error=f"{type(e).__name__}: {e}")
            return
        try:
            conn.send(op, **reply)
        except WireError as e:  # our handler's bug: said, not hidden
            count("errors")
            conn.send("error", error=f"the producer's reply broke its schema: {e}")
            return
        count("served")
    except WireError as e:
        count("refused_messages")
        logger.warning("control server: refused a message: %s", e)
        try:
            conn.send("error", error=f"message refused: {e}")
        except (PeerLost, WireError):
            pass
    except PeerLost as e:
        logger.warning("control server: %s", e)
    finally:
        conn.close()


def ask(host: str, port: int, message: dict, secret: bytes, timeout_s: float = 10.0) -> dict:
    """Send ``message`` (``{"op": ..., fields}``) to a ``ControlServer``; its reply's fields.

    ``ConnectionError`` on an ``error`` reply or when the server is gone (``AuthError`` when the
    secrets differ), ``TimeoutError`` past ``timeout_s``, ``WireError`` where a side breaks the schema."""
    fields = {k: v for k, v in message.items() if k != "op"}
    conn = connect((host, port), secret, "producer", REPLIES, REQUESTS, timeout_s=timeout_s, retry=False,
                   max_bytes=MAX_MESSAGE, frame_timeout_s=timeout_s)
    try:
        conn.send(message.get("op", ""), **fields)
        reply = conn.recv(timeout_s)
    finally:
        conn.close()
    if reply is None:
        raise TimeoutError(f"{host}:{port} sent no reply to {message.get('op')!r} within {timeout_s:g} s")
    if reply["op"] == "error":
        raise ConnectionError(f"{host}:{port} answered {message.get('op')!r} with: {reply['error']}")
    if reply["op"] != message.get("op"):
        raise ConnectionError(f"{host}:{port} answered {message.get('op')!r} with {reply['op']!r}")
    return {k: v for k, v in reply.items() if k != "op"}


def layout_reply(transport: Transport, engine_id: str, identity: Optional[ModelIdentity]) -> dict:
    """The producer's answer to ``layout``: how to reach its registered caches, and its model identity."""
    if transport.layout is None:
        raise RuntimeError("the producer's caches are not registered yet")
    layout = transport.layout if identity is None else transport.layout.with_identity(identity)
    return {"engine_id": engine_id, "endpoint": transport.endpoint(), "layout": layout.to_dict()}


class Leases:
    """The producer's leases on held requests' blocks: each expires ``timeout_s`` after ``hold``.

    ``done`` (a consumer's word, from the control server's threads) and the expiry (``finished``,
    from vLLM's step) are decided under one lock, so ``done`` answers ``held`` only for a lease
    that no step has expired: the blocks were the request's while the consumer read them.
    ``finished`` hands the ended leases (done or expired) to vLLM, which then frees the blocks.
    The last ``remember`` answers are kept, so a repeated ``done`` gets the same one."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic, remember: int = 4096) -> None:
        self.timeout_s, self._clock, self._remember = timeout_s, clock, remember
        self._lock = threading.Lock()
        self._held: dict[str, float] = {}  # request id -> deadline
        self._ended: set[str] = set()  # done or expired, not yet handed to vLLM
        self._answers: OrderedDict[str, str] = OrderedDict()
        self.expired = 0

    def hold(self, request_ids: Iterable[str]) -> None:
        deadline = self._clock() + self.timeout_s
        with self._lock:
            for request_id in request_ids:
                self._held[request_id] = deadline

    def done(self, request_id: str) -> str:
        """``held``, ``expired`` or ``unknown`` (see the module docstring); ends a held lease."""
        with self._lock:
            if request_id in self._held:
                self._expire(self._clock())
                answer = "expired" if request_id not in self._held else "held"
                self._end(request_id, answer)
                return answer
            return self._answers.get(request_id, "unknown")

    def finished(self) -> set[str]:
        """Expire overdue leases; the request ids whose leases ended since the last call."""
        with self._lock:
            self._expire(self._clock())
            ended, self._ended = self._ended, set()
        return ended

    def _expire(self, now: float) -> None:
        for request_id in [r for r, deadline in self._held.items() if now > deadline]:
            self.expired += 1
            logger.warning("no consumer finished reading request %s within %g s: its lease expired", request_id,
                           self.timeout_s)
            self._end(request_id, "expired")

    def _end(self, request_id: str, answer: str) -> None:
        self._held.pop(request_id, None)
        self._ended.add(request_id)
        self._answers[request_id] = answer
        while len(self._answers) > self._remember:
            self._answers.popitem(last=False)


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

    The fence: after a pull the producer is told ``done`` and answers with the lease; the data
    counts only where it answers ``held``. ``expired`` (or no answer within ``timeout_s``) reports
    the request's blocks invalid, so vLLM recomputes it (``expired_pulls`` counts the expired).
    ``identity`` (``pd/identity.py``) goes into this side's layout: a producer must match it.
    """

    def __init__(self, kv_caches: Sequence[LayerCache], secret: bytes, host: str = "127.0.0.1",
                 timeout_s: float = 20.0, new_transport: Optional[Callable[[], Transport]] = None,
                 identity: Optional[ModelIdentity] = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.kv_caches = tuple(kv_caches)
        self.layout = CacheLayout.of(self.kv_caches)
        if identity is not None:
            self.layout = self.layout.with_identity(identity)
        self.secret = secret
        self.timeout_s = timeout_s
        self.expired_pulls = 0
        self._new_transport = new_transport or (lambda: open_transport("mooncake", "destination", host))
        self._peers: dict[Producer, tuple[Transport, CacheLayout]] = {}
        self._done: set[str] = set()  # request ids whose pull has ended and whose blocks are safe
        self._failed: set[int] = set()  # their blocks, where the pull failed
        self._held: list[tuple[str, list[int], Transport]] = []  # failed receives, until their transport settles
        self.transports_opened = 0

    def load(self, request_id: str, producer: Producer, remote_request_id: str, src_blocks: Sequence[int],
             dst_blocks: Sequence[int]) -> Optional[TransferPlan]:
        """Pull ``src_blocks`` of ``producer``'s request ``remote_request_id`` into ``dst_blocks`` and
        settle its lease; the plan, or None where it failed or the lease had expired (logged; the
        failure then reaches ``take_finished``). Never raises for a failed pull."""
        try:
            transport, remote = self._peer(producer)
            plan = plan_transfer(remote, self.layout, src_blocks, dst_blocks)
        except Exception as e:  # nothing was read into dst_blocks
            self._lease(producer, remote_request_id, retry=False)
            return self._fail(request_id, producer, dst_blocks, e, None)
        try:
            transport.receive(plan, self.timeout_s)
        except Exception as e:  # reads may still land (TransferError.in_flight): held until settled
            self._peers.pop(producer, None)  # a later request opens a fresh transport
            self._lease(producer, remote_request_id, retry=False)
            return self._fail(request_id, producer, dst_blocks, e, transport)
        lease = self._lease(producer, remote_request_id, retry=True)
        if lease != "held":  # the blocks may have held another request's data while we read them
            self.expired_pulls += lease == "expired"
            error = ConnectionError(f"the producer's lease on {remote_request_id} was {lease} at the end of the "
                                    "pull; the data read is discarded")
            return self._fail(request_id, producer, dst_blocks, error, None)
        self._done.add(request_id)
        return plan

    def _lease(self, producer: Producer, remote_request_id: str, retry: bool) -> str:
        """Tell the producer ``done``; its lease answer (``unknown`` asked again until ``timeout_s``),
        or ``no answer (...)`` where it could not be asked."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                lease = ask(producer.host, producer.port, {"op": "done", "request_id": remote_request_id}, self.secret,
                            max(0.1, deadline - time.monotonic()))["lease"]
            except (OSError, TimeoutError, WireError) as e:
                logger.warning("telling %s that %s is read failed: %s", producer, remote_request_id, e)
                return f"not known (no answer: {e})"
            if lease != "unknown" or not retry or time.monotonic() > deadline:
                return lease if lease in LEASE_ANSWERS else f"not known (answer {lease!r})"
            time.sleep(0.05)

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
            reply = ask(producer.host, producer.port, {"op": "layout"}, self.secret, self.timeout_s)
            if reply["engine_id"] != producer.engine_id:  # another instance now listens there
                raise ConnectionError(f"{producer.host}:{producer.port} is instance {reply['engine_id']}, "
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
