"""``ascend_graph.vllm.kv_transfer`` without vLLM: the authenticated control channel, the producer's
leases, and the consumer's ``Puller`` against a producer's Mooncake transport (two engines in this
process, TCP on 127.0.0.1).

Oracles: the producer's cache bytes (a pulled block equals its source block, every other block is
unchanged), the layout check of ``pd/layout.py``, the declared schemas of ``kv_transfer`` and the
standard library's pickle (a payload first shown to run code when unpickled). A pull that fails
with reads in flight is reported only once its transport has settled; this is checked with a
transport whose settling the test controls, and with a real engine reading outside the
producer's registered memory. A pull that outlives its lease (the producer's blocks are reused
meanwhile) must be reported invalid. The layouts and plans themselves are
tests/test_pd_layout.py's; the wire format tests/test_pd_wire.py's. The two vLLM instances are
tests/test_vllm_pd.py. Mooncake's cases skip without it, except where
``$ASCEND_GRAPH_REQUIRE_MOONCAKE`` (or ``$ASCEND_GRAPH_REQUIRE_VLLM``) is set, where they fail.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import socket
import time

import pytest
import torch

from ascend_graph.kv_cache import MLACache
from ascend_graph.pd import auth, wire
from ascend_graph.pd.layout import CacheLayout
from ascend_graph.pd.select import mooncake_problem
from ascend_graph.pd.transport import TransferError, Transport
from ascend_graph.vllm import kv_transfer as kt
from test_pd_wire import live_payload

ENGINE = "producer-0"
SECRET = b"k" * 32
SRC, DST = [3, 7, 8, 9, 31], [10, 11, 12, 20, 5]  # runs: 10<-3, 11..12<-7..8, 20<-9, 5<-31


def _caches(layers: int, blocks: int, seed: int, rope: int = 16) -> list[MLACache]:
    g = torch.Generator().manual_seed(seed)
    return [MLACache(torch.randn(blocks, 16, 1, 64, generator=g), torch.randn(blocks, 16, 1, rope, generator=g))
            for _ in range(layers)]


def _require_mooncake() -> None:
    problem = mooncake_problem()
    if problem:
        if os.environ.get("ASCEND_GRAPH_REQUIRE_MOONCAKE") or os.environ.get("ASCEND_GRAPH_REQUIRE_VLLM"):
            pytest.fail(f"Mooncake is required here but {problem}")
        pytest.skip(problem)


@pytest.fixture
def serve():
    """``serve(handler) -> Producer``: a control server on 127.0.0.1, closed after the test."""
    servers = []

    def start(handler) -> kt.Producer:
        servers.append(kt.ControlServer("127.0.0.1", 0, handler, SECRET, timeout_s=5.0))
        host, port = servers[-1].address
        return kt.Producer(host, port, ENGINE)

    start.servers = servers
    yield start
    for server in servers:
        server.close()


def _layout_handler(reply: dict, lease: str = "held"):
    return lambda message: reply if message["op"] == "layout" else {"lease": lease}


def _ask(producer, message, secret=SECRET):
    return kt.ask(producer.host, producer.port, message, secret, timeout_s=10.0)


def test_control_server_answers_and_reports_errors(serve):
    seen = []

    def handler(message):
        seen.append(message)
        if message["request_id"] == "bad":
            raise KeyError("nope")
        return {"lease": "held"} if message["request_id"] == "r1" else {"lease": "held", "extra": 1}

    producer = serve(handler)
    assert _ask(producer, {"op": "done", "request_id": "r1"}) == {"lease": "held"}
    with pytest.raises(ConnectionError, match="KeyError"):
        _ask(producer, {"op": "done", "request_id": "bad"})
    with pytest.raises(ConnectionError, match="reply broke its schema: done: unknown field"):
        _ask(producer, {"op": "done", "request_id": "r2"})
    assert seen == [{"op": "done", "request_id": r} for r in ("r1", "bad", "r2")]
    assert serve.servers[0].counters == {"served": 1, "refused_connections": 0, "refused_messages": 0, "errors": 2}


def test_control_server_refuses_wrong_missing_and_pickled_keys_and_serves_the_right_peer(serve, tmp_path):
    payload, marker = live_payload(tmp_path, "ran")
    producer = serve(lambda message: {"lease": "held"})
    with pytest.raises(auth.AuthError, match="different secrets"):
        _ask(producer, {"op": "done", "request_id": "r1"}, secret=b"w" * 32)
    for raw_bytes in (b"", payload + b"\0" * 80):  # no key at all (silence, then gone); a pickle
        with socket.create_connection((producer.host, producer.port)) as raw:
            raw.recv(64)
            raw.settimeout(10.0)
            try:
                raw.sendall(raw_bytes)
                raw.shutdown(socket.SHUT_WR)
                raw.recv(64)  # the server closes the connection
            except OSError:  # ... before we are through
                pass
    assert _ask(producer, {"op": "done", "request_id": "r1"}) == {"lease": "held"}
    deadline = time.monotonic() + 10.0  # the refusals are counted on the server's threads
    while serve.servers[0].counters["refused_connections"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert serve.servers[0].counters["refused_connections"] == 3
    assert not marker.exists()


@pytest.mark.parametrize("header, payload, words", [
    ({"op": "free_all", "fields": {}, "tensors": []}, b"", "unknown op 'free_all'"),
    ({"op": "done", "fields": {"request_id": "r1", "block_ids": [1]}, "tensors": []}, b"", "unknown field"),
    ({"op": "done", "fields": {"request_id": 7}, "tensors": []}, b"", "done.request_id: expected a string"),
    (None, b"", "not JSON"),  # a pickle where the header goes
    ({"op": "layout", "fields": {}, "tensors": []}, b"\0" * (kt.MAX_MESSAGE + 1), "exceeds the limit"),
])
def test_control_server_refuses_undeclared_malformed_and_oversized_requests_and_goes_on(serve, tmp_path, header,
                                                                                        payload, words):
    pickled, marker = live_payload(tmp_path, "ran")
    calls = []
    producer = serve(lambda message: calls.append(message) or {"lease": "held"})
    conn = wire.connect((producer.host, producer.port), SECRET, "producer", kt.REPLIES, kt.REQUESTS, timeout_s=10.0,
                        max_bytes=kt.MAX_MESSAGE)
    conn.send_frame(pickled if header is None else json.dumps(header).encode(), payload)
    reply = conn.recv(10.0)
    conn.close()
    assert reply["op"] == "error" and "message refused" in reply["error"] and words in reply["error"]
    assert calls == [] and not marker.exists()
    assert _ask(producer, {"op": "done", "request_id": "r1"}) == {"lease": "held"}
    assert serve.servers[0].counters["refused_messages"] == 1


def test_leases_answer_done_atomically_with_their_expiry():
    now = [100.0]
    leases = kt.Leases(timeout_s=5.0, clock=lambda: now[0])
    leases.hold(["a", "b", "c"])
    assert leases.done("a") == "held" and leases.done("a") == "held"  # a repeated done: the same answer
    assert leases.done("zz") == "unknown"  # not held (yet): the consumer asks again
    now[0] = 105.5  # past b's and c's deadline, before any step has expired them
    assert leases.done("b") == "expired"
    assert leases.finished() == {"a", "b", "c"} and leases.finished() == set()  # each handed to vLLM once
    assert leases.done("c") == "expired" and leases.expired == 2


@pytest.mark.parametrize("reply, words", [
    ({"engine_id": ENGINE, "layout": CacheLayout.of(_caches(2, 8, 0, rope=32)).to_dict()}, "block shape differs"),
    ({"engine_id": ENGINE, "layout": CacheLayout.of(_caches(3, 8, 0)).to_dict()}, "layer count differs"),
    ({"engine_id": "another", "layout": CacheLayout.of(_caches(2, 8, 0)).to_dict()}, "is instance another"),
])
def test_a_producer_that_does_not_match_fails_the_request_naming_why(serve, caplog, reply, words):
    opened = []
    puller = kt.Puller(_caches(2, 24, 1), SECRET, new_transport=lambda: opened.append(1))
    producer = serve(_layout_handler({**reply, "endpoint": {}}))
    with caplog.at_level(logging.ERROR, logger=kt.__name__):
        assert puller.load("r1", producer, "p1", [1, 2], [3, 4]) is None
    assert words in caplog.text and "r1" in caplog.text
    assert puller.take_finished() == ({"r1"}, {3, 4})
    assert puller.take_finished() == (set(), set())  # reported once
    assert opened == []  # refused before any transport was opened


def test_bad_blocks_fail_the_request_before_anything_is_read(serve, caplog):
    layout = CacheLayout.of(_caches(2, 8, 0)).to_dict()
    transports = []

    def new_transport():
        transports.append(FakeTransport())
        return transports[-1]

    puller = kt.Puller(_caches(2, 24, 1), SECRET, new_transport=new_transport)
    producer = serve(_layout_handler({"engine_id": ENGINE, "layout": layout, "endpoint": {}}))
    assert puller.load("r1", producer, "p1", [1, 8], [3, 4]) is None  # the producer has 8 blocks
    assert "src_blocks[1]=8" in caplog.text
    assert puller.take_finished() == ({"r1"}, {3, 4})
    assert transports[0].received == []


class FakeTransport(Transport):
    """A pulling transport whose ``receive`` fails with reads in flight until told otherwise, and
    whose settling the test decides."""

    name, pulls = "fake", True

    def __init__(self, fail: bool = False) -> None:
        super().__init__("destination")
        self.fail, self.is_settled, self.received, self.closed = fail, False, [], False

    def register(self, kv_caches):
        self.layout = CacheLayout.of(kv_caches)
        return self.layout

    def endpoint(self):
        return {}

    def connect(self, peer, timeout_s):
        pass

    def send(self, plan, timeout_s):
        pass

    def receive(self, plan, timeout_s):
        if self.fail:
            raise TransferError("batch 0 failed", in_flight=True)
        self.received.append(plan)

    def settled(self):
        return self.is_settled

    def close(self):
        self.closed = True


def test_a_pull_failed_in_flight_is_reported_only_once_settled_and_then_reopens(serve):
    layout = CacheLayout.of(_caches(2, 8, 0)).to_dict()
    transports = [FakeTransport(fail=True), FakeTransport()]
    opened = iter(transports)
    puller = kt.Puller(_caches(2, 24, 1), SECRET, new_transport=lambda: next(opened))
    producer = serve(_layout_handler({"engine_id": ENGINE, "layout": layout, "endpoint": {}}))

    assert puller.load("r1", producer, "p1", [1, 2], [3, 4]) is None
    for _ in range(3):  # steps go by: neither the request nor its blocks come back while reads may land
        assert puller.take_finished() == (set(), set())
    assert puller.holding == 1 and not transports[0].closed
    plan = puller.load("r2", producer, "p2", [5], [6])  # the broken transport is not used again
    assert plan is not None and transports[1].received == [plan] and puller.transports_opened == 2
    assert puller.take_finished() == ({"r2"}, set())
    transports[0].is_settled = True
    assert puller.take_finished() == ({"r1"}, {3, 4})
    assert puller.holding == 0 and transports[0].closed


def _source(caches):
    from ascend_graph.pd.mooncake import MooncakeTransport

    transport = MooncakeTransport("source", engine_timeout_s=5)
    transport.register(caches)
    return transport


def _assert_pulled(dst, before, src, src_blocks, dst_blocks, pointers):
    rest = [b for b in range(dst[0].kv_c.shape[0]) if b not in dst_blocks]
    for i, (cache, old, source) in enumerate(zip(dst, before, src)):
        for field, t, o, s in zip(cache._fields, cache, old, source):
            assert torch.equal(t[dst_blocks], s[src_blocks]), f"layer {i} {field}: pulled blocks differ"
            assert torch.equal(t[rest], o[rest]), f"layer {i} {field}: a block outside the plan changed"
    assert [[t.data_ptr() for t in cache] for cache in dst] == pointers


def test_pulls_copy_exactly_the_requested_blocks_and_recover_after_a_failed_one(serve):
    _require_mooncake()
    src, dst = _caches(3, 32, 0), _caches(3, 24, 1)
    before = [[t.clone() for t in cache] for cache in dst]
    pointers = [[t.data_ptr() for t in cache] for cache in dst]
    source = _source(src)
    puller = kt.Puller(dst, SECRET, timeout_s=10.0)
    try:
        producer = serve(lambda m: kt.layout_reply(source, ENGINE, None) if m["op"] == "layout" else {"lease": "held"})
        plan = puller.load("r1", producer, "p1", SRC, DST)
        assert plan is not None and plan.num_descriptors == 4 * 3 * 2  # four runs, six tensors
        assert plan.num_bytes == len(SRC) * 16 * (64 + 16) * 4 * 3
        assert puller.take_finished() == ({"r1"}, set())
        _assert_pulled(dst, before, src, SRC, DST, pointers)

        # the same tensors claimed far larger: a read outside the producer's registered memory
        forged = kt.layout_reply(source, ENGINE, None)
        forged["layout"]["regions"] = [{**r, "num_blocks": 1 << 20} for r in forged["layout"]["regions"]]
        liar = serve(_layout_handler(forged))
        assert puller.load("r2", liar, "p2", [(1 << 20) - 1], [2]) is None
        assert puller.holding == 1  # failed in flight: held until its engine is gone
        deadline, finished = time.monotonic() + 30.0, (set(), set())
        while finished == (set(), set()) and time.monotonic() < deadline:
            finished = puller.take_finished()
            time.sleep(0.05)
        assert finished == ({"r2"}, {2})

        # the healthy producer's transport still serves, bit for bit
        after = [[t.clone() for t in cache] for cache in dst]
        assert puller.load("r3", producer, "p3", [1, 2], [6, 7]) is not None
        assert puller.take_finished() == ({"r3"}, set())
        _assert_pulled(dst, after, src, [1, 2], [6, 7], pointers)
        assert puller.transports_opened == 2
    finally:
        puller.close()
        source.close()


@pytest.mark.parametrize("answers, valid", [(["held"], True), (["unknown", "unknown", "held"], True),
                                            (["expired"], False), (["unknown"] * 1000, False)])
def test_a_pull_counts_only_when_the_producer_says_its_lease_was_held(serve, answers, valid):
    layout = CacheLayout.of(_caches(2, 8, 0)).to_dict()
    transport, asked = FakeTransport(), []

    def handler(message):
        if message["op"] == "layout":
            return {"engine_id": ENGINE, "layout": layout, "endpoint": {}}
        asked.append(message["request_id"])
        return {"lease": answers[min(len(asked), len(answers)) - 1]}

    puller = kt.Puller(_caches(2, 24, 1), SECRET, timeout_s=1.0, new_transport=lambda: transport)
    plan = puller.load("r1", serve(handler), "p1", [1, 2], [3, 4])
    assert transport.received == [plan] if valid else len(transport.received) == 1
    assert (plan is not None) == valid
    assert puller.take_finished() == ({"r1"}, set() if valid else {3, 4})
    assert puller.expired_pulls == (answers == ["expired"])
    assert set(asked) == {"p1"} and len(asked) <= len(answers)


def test_a_producer_of_another_model_is_refused_by_identity(serve, caplog):
    from ascend_graph.models.deepseek import DeepseekForCausalLM
    from ascend_graph.models.deepseek_config import DeepseekConfig
    from ascend_graph.pd.identity import model_identity

    mine, theirs = (model_identity(DeepseekForCausalLM(DeepseekConfig.small(), seed=s)) for s in (0, 1))
    layout = CacheLayout.of(_caches(2, 8, 0)).with_identity(theirs).to_dict()
    opened = []
    puller = kt.Puller(_caches(2, 24, 1), SECRET, new_transport=lambda: opened.append(1), identity=mine)
    with caplog.at_level(logging.ERROR, logger=kt.__name__):
        assert puller.load("r1", serve(_layout_handler({"engine_id": ENGINE, "layout": layout, "endpoint": {}})),
                           "p1", [1], [3]) is None
    assert "model weights differ: embed_tokens.weight" in caplog.text and opened == []
    assert puller.take_finished() == ({"r1"}, {3})


def test_a_pull_that_outlives_its_lease_never_counts_another_requests_blocks(serve):
    """The producer's lease runs out while the read is delayed, and its blocks get another request's
    data before the read: the consumer must report the blocks invalid, not use them."""
    _require_mooncake()
    from ascend_graph.pd.mooncake import MooncakeTransport

    src, dst, other = _caches(2, 32, 0), _caches(2, 24, 1), _caches(2, 32, 9)
    source = _source(src)
    leases = kt.Leases(timeout_s=0.2)
    producer = serve(lambda m: kt.layout_reply(source, ENGINE, None) if m["op"] == "layout"
                     else {"lease": leases.done(m["request_id"])})
    late = []  # request ids whose read is delayed past the lease

    def transport():
        t = MooncakeTransport("destination", engine_timeout_s=5)
        receive = t.receive

        def delayed(plan, timeout_s):
            if late:
                rid = late.pop()
                deadline = time.monotonic() + 30.0
                while rid not in leases.finished():  # vLLM's steps go on: the lease expires, the blocks are freed
                    assert time.monotonic() < deadline, "the lease never expired"
                    time.sleep(0.02)
                for cache, reuse in zip(src, other):  # ... and another request's KV lands in them
                    for t_, o in zip(cache, reuse):
                        t_[SRC] = o[SRC]
            receive(plan, timeout_s)

        t.receive = delayed
        return t

    puller = kt.Puller(dst, SECRET, timeout_s=10.0, new_transport=transport)
    try:
        leases.hold(["p1"])
        late.append("p1")
        assert puller.load("r1", producer, "p1", SRC, DST) is None
        assert puller.take_finished() == ({"r1"}, set(DST))  # vLLM recomputes these blocks
        assert all(torch.equal(t[DST], o[SRC]) for c, r in zip(dst, other) for t, o in zip(c, r))  # what was read
        assert puller.expired_pulls == 1 and leases.expired == 1
        leases.hold(["p3"])  # a pull inside its lease counts
        assert puller.load("r3", producer, "p3", [1, 2], [6, 7]) is not None
        assert puller.take_finished() == ({"r3"}, set())
        assert all(torch.equal(t[[6, 7]], s[[1, 2]]) for c, sc in zip(dst, src) for t, s in zip(c, sc))
    finally:
        puller.close()
        source.close()
