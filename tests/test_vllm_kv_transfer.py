"""``ascend_graph.vllm.kv_transfer`` without vLLM: the control channel, and the consumer's ``Puller``
against a producer's Mooncake transport (two engines in this process, TCP on 127.0.0.1).

Oracles: the producer's cache bytes (a pulled block equals its source block, every other block is
unchanged), and the layout check of ``pd/layout.py``. A pull that fails with reads in flight is
reported only once its transport has settled; this is checked with a transport whose settling the
test controls, and with a real engine reading outside the producer's registered memory. The
layouts and plans themselves are tests/test_pd_layout.py's. The two vLLM instances are
tests/test_vllm_pd.py. Mooncake's cases skip without it, except where
``$ASCEND_GRAPH_REQUIRE_MOONCAKE`` (or ``$ASCEND_GRAPH_REQUIRE_VLLM``) is set, where they fail.
"""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from ascend_graph.kv_cache import MLACache
from ascend_graph.pd.layout import CacheLayout
from ascend_graph.pd.select import mooncake_problem
from ascend_graph.pd.transport import TransferError, Transport
from ascend_graph.vllm import kv_transfer as kt

ENGINE = "producer-0"
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
        servers.append(kt.ControlServer("127.0.0.1", 0, handler))
        host, port = servers[-1].address
        return kt.Producer(host, port, ENGINE)

    yield start
    for server in servers:
        server.close()


def _layout_handler(reply: dict):
    return lambda message: reply if message["op"] == "layout" else {"ok": True}


def test_control_server_answers_and_reports_errors(serve):
    seen = []

    def handler(message):
        if message["op"] == "bad":
            raise KeyError("nope")
        seen.append(message)
        return {"echo": message["op"]}

    producer = serve(handler)
    assert kt.ask(producer.host, producer.port, {"op": "layout"}) == {"echo": "layout"}
    with pytest.raises(ConnectionError, match="KeyError"):
        kt.ask(producer.host, producer.port, {"op": "bad"})
    assert seen == [{"op": "layout"}]


@pytest.mark.parametrize("reply, words", [
    ({"engine_id": ENGINE, "layout": CacheLayout.of(_caches(2, 8, 0, rope=32)).to_dict()}, "block shape differs"),
    ({"engine_id": ENGINE, "layout": CacheLayout.of(_caches(3, 8, 0)).to_dict()}, "layer count differs"),
    ({"engine_id": "another", "layout": CacheLayout.of(_caches(2, 8, 0)).to_dict()}, "is instance another"),
])
def test_a_producer_that_does_not_match_fails_the_request_naming_why(serve, caplog, reply, words):
    opened = []
    puller = kt.Puller(_caches(2, 24, 1), new_transport=lambda: opened.append(1))
    producer = serve(_layout_handler({**reply, "endpoint": {}}))
    with caplog.at_level(logging.ERROR, logger=kt.__name__):
        assert puller.load("r1", producer, [1, 2], [3, 4]) is None
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

    puller = kt.Puller(_caches(2, 24, 1), new_transport=new_transport)
    producer = serve(_layout_handler({"engine_id": ENGINE, "layout": layout, "endpoint": {}}))
    assert puller.load("r1", producer, [1, 8], [3, 4]) is None  # the producer has 8 blocks
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
    puller = kt.Puller(_caches(2, 24, 1), new_transport=lambda: next(opened))
    producer = serve(_layout_handler({"engine_id": ENGINE, "layout": layout, "endpoint": {}}))

    assert puller.load("r1", producer, [1, 2], [3, 4]) is None
    for _ in range(3):  # steps go by: neither the request nor its blocks come back while reads may land
        assert puller.take_finished() == (set(), set())
    assert puller.holding == 1 and not transports[0].closed
    plan = puller.load("r2", producer, [5], [6])  # the broken transport is not used again
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
    puller = kt.Puller(dst, timeout_s=10.0)
    try:
        producer = serve(lambda m: kt.layout_reply(source, ENGINE) if m["op"] == "layout" else {"ok": True})
        plan = puller.load("r1", producer, SRC, DST)
        assert plan is not None and plan.num_descriptors == 4 * 3 * 2  # four runs, six tensors
        assert plan.num_bytes == len(SRC) * 16 * (64 + 16) * 4 * 3
        assert puller.take_finished() == ({"r1"}, set())
        _assert_pulled(dst, before, src, SRC, DST, pointers)

        # the same tensors claimed far larger: a read outside the producer's registered memory
        forged = kt.layout_reply(source, ENGINE)
        forged["layout"]["regions"] = [{**r, "num_blocks": 1 << 20} for r in forged["layout"]["regions"]]
        liar = serve(_layout_handler(forged))
        assert puller.load("r2", liar, [(1 << 20) - 1], [2]) is None
        assert puller.holding == 1  # failed in flight: held until its engine is gone
        deadline, finished = time.monotonic() + 30.0, (set(), set())
        while finished == (set(), set()) and time.monotonic() < deadline:
            finished = puller.take_finished()
            time.sleep(0.05)
        assert finished == ({"r2"}, {2})

        # the healthy producer's transport still serves, bit for bit
        after = [[t.clone() for t in cache] for cache in dst]
        assert puller.load("r3", producer, [1, 2], [6, 7]) is not None
        assert puller.take_finished() == ({"r3"}, set())
        _assert_pulled(dst, after, src, [1, 2], [6, 7], pointers)
        assert puller.transports_opened == 2
    finally:
        puller.close()
        source.close()
