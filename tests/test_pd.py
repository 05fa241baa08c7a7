"""Prefill and decode in two processes: tokens, static caches, handshake, faults, leases, the
authenticated control channel, no block leaks.

The oracle is a single-process eager ``Engine`` serving the same requests. The prefill server
runs as a child process (``PrefillProcess``); the decode engine runs here with graph mode on.
Mooncake's tests fail instead of skipping where ``$ASCEND_GRAPH_REQUIRE_MOONCAKE`` is set (CI).
The wire format and the challenge themselves are tests/test_pd_wire.py's.
"""

import json
import os
import socket
import time

import pytest
import torch

from ascend_graph.config import GraphConfig
from ascend_graph.engine.engine import Engine
from ascend_graph.models.deepseek import DeepseekForCausalLM
from ascend_graph.models.named import named_model
from ascend_graph.pd import LayoutMismatch, TransferError, decode as decode_module
from ascend_graph.pd.auth import SECRET_ENV, AuthError
from ascend_graph.pd.decode import DecodeEngine
from ascend_graph.pd.process import PrefillProcess
from ascend_graph.pd.select import mooncake_problem
from test_pd_wire import live_payload

pytestmark = [pytest.mark.xdist_group("pd"), pytest.mark.usefixtures("one_torch_thread")]

BLOCK, MAX_LEN, SEATS = 16, 96, 2
GRAPH = GraphConfig(enabled=True, capture_sizes=(1, 2), max_batch_size=2)
NUM_BLOCKS = 1 + SEATS * MAX_LEN // BLOCK
PROMPTS = [[(5 * i + 3 * j) % 250 + 1 for j in range(4 + 9 * i)] for i in range(5)]  # 4..40 tokens
BUDGETS = [6, 9, 5, 8, 7]


def _transports():
    problem = mooncake_problem()
    if problem and os.environ.get("ASCEND_GRAPH_REQUIRE_MOONCAKE"):
        raise RuntimeError(f"ASCEND_GRAPH_REQUIRE_MOONCAKE is set but {problem}")
    marks = [pytest.mark.skip(reason=problem)] if problem else []
    return [pytest.param("mooncake", marks=marks), "gloo"]


TRANSPORTS = _transports()


@pytest.fixture(scope="module")
def model():
    return named_model("small")[0]


@pytest.fixture(scope="module")
def reference(model):
    engine = Engine(model, graph_config=GraphConfig(enabled=False), block_size=BLOCK, max_model_len=MAX_LEN,
                    max_num_seqs=SEATS, num_blocks=NUM_BLOCKS)
    return engine.generate(PROMPTS, BUDGETS, ignore_eos=True)


def prefill(transport, **kwargs):
    return PrefillProcess("small", block_size=kwargs.pop("block_size", BLOCK),
                          num_blocks=kwargs.pop("num_blocks", NUM_BLOCKS), max_model_len=MAX_LEN, transport=transport,
                          threads=1, **kwargs)


def decode(model, server, transport, **kwargs):
    return DecodeEngine(model, server, transport=transport, graph_config=kwargs.pop("graph_config", GRAPH),
                        block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=SEATS, num_blocks=NUM_BLOCKS, **kwargs)


def addresses(engine):
    return [t.data_ptr() for cache in engine.runner.kv_caches for t in cache]


def assert_no_leak(engine, server_counters):
    assert engine.blocks.num_free == NUM_BLOCKS - 1
    if server_counters is not None:
        assert server_counters["held"] == 0 and server_counters["free_blocks"] == NUM_BLOCKS - 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_decode_tokens_equal_a_single_process_engine(model, reference, transport):
    with prefill(transport) as server:
        engine = decode(model, server, transport)
        try:
            registered = [r.address for r in engine.layout.regions]
            assert registered == addresses(engine) and all(a % (2 << 20) == 0 for a in registered)
            engine.capture(show_progress=False)
            tokens = engine.generate(PROMPTS, BUDGETS, ignore_eos=True)
            again = engine.generate(PROMPTS[:2], BUDGETS[:2], ignore_eos=True)  # keeps serving
            counters = engine.prefill_counters()
        finally:
            engine.close()
    assert tokens == reference and again == reference[:2]
    assert addresses(engine) == registered  # the data landed in the tensors the graphs captured
    stats = engine.runner.stats.to_dict()
    assert stats["graph_steps"] > 0 and stats["recompiles"] == 0
    assert stats["eager_steps_total"] == 0  # no prefill ran here: every prompt's blocks came over
    assert engine.transfer.transfers == len(PROMPTS) + 2 and engine.transfer.bytes > 0
    assert counters["prefilled"] == counters["released"] == len(PROMPTS) + 2
    assert_no_leak(engine, counters)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("on_error", ["recompute", "fail"])
def test_prefill_killed_mid_transfer(model, reference, transport, on_error):
    with prefill(transport) as server:
        engine = decode(model, server, transport, kill_prefill_after=2, max_descriptors=1,
                        on_transfer_error=on_error, transfer_timeout_s=10.0)
        try:
            tokens = engine.generate(PROMPTS, BUDGETS, ignore_eos=True)
            assert not server.alive
            after = engine.generate(PROMPTS[:1], BUDGETS[:1], ignore_eos=True)  # still serving, prefill gone
        finally:
            engine.close()
    assert engine.transfer.transfers == 2 and engine.transfer.errors["transfer failed"] >= 1  # later: broken
    if on_error == "recompute":
        assert tokens == reference and after == reference[:1]
        assert engine.transfer.recomputed == len(PROMPTS) - 2 + 1 and not engine.failures
    else:
        assert set(engine.failures) == {0}  # the last call's failures: its only request
        assert engine.transfer.failed_requests == len(PROMPTS) - 2 + 1
        assert tokens[:2] == reference[:2] and all(t == [] for t in tokens[2:]) and after == [[]]
    assert engine.runner.stats.to_dict()["recompiles"] == 0
    assert_no_leak(engine, None)


def test_a_hung_prefill_misses_its_deadline_and_the_request_is_recomputed(model, reference):
    with prefill("gloo") as server:
        engine = decode(model, server, "gloo", prefill_timeout_s=2.0)
        try:
            server.suspend()
            start = time.monotonic()
            tokens = engine.generate(PROMPTS[:2], BUDGETS[:2], ignore_eos=True)
            elapsed = time.monotonic() - start
        finally:
            server.resume()
            engine.close()
    assert tokens == reference[:2]
    assert engine.transfer.errors["no prefill reply within 2 s"] == 2 and engine.transfer.recomputed == 2
    # a deadline, not a timing: two 2 s prefill waits and an eager recompute, with a generous margin
    # for a loaded shared host; without the prefill deadline the suspended prefill would block for ever
    assert elapsed < 60
    assert_no_leak(engine, None)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_failed_batch_fails_only_its_request(model, reference, transport, monkeypatch):
    with prefill(transport) as server:
        engine = decode(model, server, transport, on_transfer_error="fail")
        receive, calls = engine._transport.receive, []

        def flaky(plan, timeout_s):
            calls.append(plan)
            if len(calls) == 2:
                receive(plan, timeout_s)  # the data may land partly: the request must not use it
                raise TransferError("injected: batch 0 reported failure", batches_done=0)
            receive(plan, timeout_s)

        monkeypatch.setattr(engine._transport, "receive", flaky)
        try:
            tokens = engine.generate(PROMPTS, BUDGETS, ignore_eos=True)
            counters = engine.prefill_counters()
        finally:
            engine.close()
    failed = [i for i, t in enumerate(tokens) if not t]
    assert len(failed) == 1 and set(engine.failures) == set(failed)
    assert "transfer failed: injected" in engine.failures[failed[0]]
    assert all(tokens[i] == reference[i] for i in range(len(PROMPTS)) if i not in failed)
    assert_no_leak(engine, counters)


@pytest.mark.parametrize("change, seed, words", [
    (dict(block_size=8), 0, "block size differs: 8 here, 16 on the decode side"),
    (dict(dtype="bfloat16"), 0, "layer 0 kv_c: dtype differs: bfloat16 here, float32 on the decode side"),
    ({}, 1, "model weights differ: embed_tokens.weight digest [0-9a-f]+ here, [0-9a-f]+ on the decode side"),
])
def test_a_layout_or_model_mismatch_is_refused_at_handshake_naming_the_difference(model, change, seed, words):
    transport = "gloo"
    mine = model if seed == 0 else DeepseekForCausalLM(model.config, seed=seed).eval()  # same shapes, other weights
    with prefill(transport, **change) as server:
        with pytest.raises(LayoutMismatch, match=words):
            decode(mine, server, transport)


def _record_drafts(engine) -> dict:
    """Each request's drafts after each of its steps (``Speculation.advance``), by request index."""
    drafts, advance = {}, engine.spec.advance

    def recording(scheduler, batch, *args):
        done = advance(scheduler, batch, *args)
        for r in batch:
            drafts.setdefault(r.index, []).append(list(r.drafts))
        return done

    engine.spec.advance = recording
    return drafts


def test_mtp_speculation_across_pd_drafts_from_the_mtp_cache_the_prefill_side_wrote():
    """small-v3 with its MTP layer, ``num_speculative_tokens=2`` on both sides: the prefill side's
    step also runs the MTP layer (its row brings the first draft and hidden states), the MTP
    layer's cache moves with the target's, and the decode side's first chain step reads the
    prompt's MTP entries from it. Oracle: one process, eager, the same speculation: the same
    drafts request by request and step by step, and the tokens of decoding without speculation.
    A prefill side that drafts otherwise is refused at the handshake."""
    transport, k = "gloo", 2
    v3 = named_model("small-v3", mtp_layers=1)[0]
    kwargs = dict(block_size=BLOCK, max_model_len=MAX_LEN, max_num_seqs=SEATS, num_blocks=NUM_BLOCKS)
    plain = Engine(named_model("small-v3")[0], graph_config=GraphConfig(enabled=False), **kwargs)
    reference = plain.generate(PROMPTS, BUDGETS, ignore_eos=True)
    single = Engine(v3, graph_config=GraphConfig(enabled=False), num_speculative_tokens=k, **kwargs)
    want = _record_drafts(single)
    assert single.generate(PROMPTS, BUDGETS, ignore_eos=True) == reference
    server = PrefillProcess("small-v3", block_size=BLOCK, num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN,
                            transport=transport, threads=1, num_speculative_tokens=k)
    with server:
        engine = decode(v3, server, transport, num_speculative_tokens=k,
                        graph_config=GraphConfig(enabled=True, capture_sizes=(2,), max_batch_size=2))
        try:
            got = _record_drafts(engine)
            tokens = engine.generate(PROMPTS, BUDGETS, ignore_eos=True)
            counters = engine.prefill_counters()
        finally:
            engine.close()
    assert tokens == reference and got == want
    stats = engine.stats
    assert stats["eager_steps_total"] == 0 and stats["graph_steps"] > 0  # every prompt prefilled over there
    assert stats["speculative"]["draft_chain"]["graph_steps"] > 0 and engine.transfer.transfers == len(PROMPTS)
    assert_no_leak(engine, counters)
    one = PrefillProcess("small-v3", block_size=BLOCK, num_blocks=NUM_BLOCKS, max_model_len=MAX_LEN,
                         transport=transport, threads=1, num_speculative_tokens=1)  # its rows hold no hidden states
    refused = r"refused the handshake: .*num_speculative_tokens=1 here, 2 on the decode side"
    with one, pytest.raises(LayoutMismatch, match=refused):  # by the prefill side, before its transport waits
        decode(v3, one, transport, num_speculative_tokens=k)


def test_the_decode_side_needs_the_prefill_servers_secret(model, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="no shared secret: pass secret=... .*ASCEND_GRAPH_PD_SECRET"):
        DecodeEngine(model, ("127.0.0.1", 1), transport="gloo")


def test_the_prefill_server_will_not_start_without_a_secret(monkeypatch, capsys):
    from ascend_graph.pd.prefill import main

    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "small"])
    assert exit_.value.code == 2 and "give --secret-file PATH or --secret-stdin" in capsys.readouterr().err


def test_the_prefill_server_refuses_wrong_keys_pickles_and_bad_messages_and_serves_its_decode_side(
        model, reference, tmp_path):
    payload, marker = live_payload(tmp_path, "ran")
    with prefill("gloo") as server:
        with pytest.raises(AuthError, match="different secrets"):
            decode(model, server.address, "gloo", secret=b"w" * 32)
        with socket.create_connection(server.address) as raw:  # a pickle where the answer to the challenge goes
            raw.recv(64)
            try:
                raw.sendall(payload + b"\0" * 80)
            except OSError:  # refused and closed before we were through
                pass
        engine = decode(model, server, "gloo")
        frame = engine._channel._conn.send_frame
        bad = [(b'{"op": "free_all", "fields": {}, "tensors": []}', b"", "unknown op 'free_all'"),
               (b'{"op": "release", "fields": {"id": 1, "all": true}, "tensors": []}', b"", "unknown field"),
               (payload, b"", "not JSON"),
               (b'{"op": "stats", "fields": {}, "tensors": []}', b"\0" * (64 << 20), "exceeds the limit")]
        try:
            for header, body, words in bad:
                frame(header, body)
                reply = engine._channel.recv(60.0)
                assert reply["op"] == "error" and words in reply["error"], reply
            tokens = engine.generate(PROMPTS[:2], BUDGETS[:2], ignore_eos=True)
            counters = engine.prefill_counters()
        finally:
            engine.close()
    assert tokens == reference[:2] and not marker.exists()
    assert counters["refused_messages"] == len(bad) and counters["refused_connections"] == 2
    assert_no_leak(engine, counters)


def test_pulls_confirmed_by_the_prefill_side_are_used(model, reference, monkeypatch):
    monkeypatch.setattr(decode_module, "LEASE_SAFETY", 0.0)  # never trust the clock: always ask (the fence)
    with prefill("gloo") as server:
        engine = decode(model, server, "gloo")
        try:
            tokens = engine.generate(PROMPTS[:3], BUDGETS[:3], ignore_eos=True)
            counters = engine.prefill_counters()
        finally:
            engine.close()
    assert tokens == reference[:3]
    assert engine.transfer.recomputed == 0 and engine.transfer.leases_expired == 0
    assert counters["released"] == 3 and counters["late_releases"] == 0
    assert_no_leak(engine, counters)


def test_a_pull_that_outlives_its_lease_never_uses_another_requests_blocks(model, reference, monkeypatch):
    """The prefill side has blocks for one long prompt at a time and leases them for 0.3 s; the read
    of the first prompt is held back until that lease has expired and the second prompt has been
    prefilled into the same blocks. Its tokens must still be the single-process ones (recomputed)."""
    if mooncake_problem():
        if os.environ.get("ASCEND_GRAPH_REQUIRE_MOONCAKE"):
            pytest.fail(mooncake_problem())
        pytest.skip(mooncake_problem())
    order = [4, 3]  # 40 tokens (3 blocks), then 31 (2 blocks): the second must wait for the first's blocks
    with prefill("mooncake", hold_timeout_s=0.3, num_blocks=4) as server:
        engine = decode(model, server, "mooncake")
        receive, delayed = engine._transport.receive, []

        def late(plan, timeout_s):
            if not delayed:  # the first pull: wait for the prefill side to expire its lease, then some
                delayed.append(plan)
                deadline = time.monotonic() + 60.0
                while "no release for request" not in server.stderr_tail(100_000):
                    assert time.monotonic() < deadline, "the prefill side never expired the lease"
                    time.sleep(0.05)
                time.sleep(1.0)  # margin for its next step: the second prompt prefilled into those blocks
            receive(plan, timeout_s)

        monkeypatch.setattr(engine._transport, "receive", late)
        try:
            tokens = engine.generate([PROMPTS[i] for i in order], [BUDGETS[i] for i in order], ignore_eos=True)
            counters = engine.prefill_counters()
        finally:
            engine.close()
    assert tokens == [reference[i] for i in order]
    assert engine.transfer.leases_expired >= 1 and engine.transfer.recomputed >= 1
    assert counters["expired"] >= 1 and counters["late_releases"] >= 1 and counters["prefilled"] == 2
    assert engine.blocks.num_free == NUM_BLOCKS - 1 and counters["held"] == 0 and counters["free_blocks"] == 3


def test_pd_demo_reports_tokens_transfer_and_decode_counters_as_json(capsys):
    from ascend_graph.cli import main

    code = main(["pd-demo", "--capture-sizes", "1,2", "--max-model-len", "96", "--num-requests", "4",
                 "--max-new-tokens", "5", "--kill-prefill-after", "2", "--json", "--no-progress"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0, result
    assert {"prompts", "max_new_tokens", "tokens", "transport", "decode_stats", "transfer"} <= set(result)
    assert result["tokens"] == result["reference_tokens"] and result["tokens_match"]
    assert result["transfer"]["transfers"] == 2 and result["transfer"]["recomputed"] == 2
    assert result["transfer"]["bytes"] > 0 and result["transfer"]["seconds"] > 0
    assert result["decode_stats"]["graph_steps"] > 0 and result["decode_stats"]["recompiles"] == 0
    assert result["decode_free_blocks"]["before"] == result["decode_free_blocks"]["after"]
    assert result["prefill_side"] is None  # killed


def test_blocks_never_released_by_the_decode_side_are_freed_after_the_hold_timeout(model, reference, monkeypatch):
    with prefill("gloo", hold_timeout_s=1.0) as server:
        engine = decode(model, server, "gloo", prefill_timeout_s=10.0)  # a pull not confirmed in time is recomputed
        tell = engine._tell
        monkeypatch.setattr(engine, "_tell", lambda op, seq_id: None if op == "release" else tell(op, seq_id))
        try:
            engine.capture(show_progress=False)
            tokens = engine.generate(PROMPTS[:3], BUDGETS[:3], ignore_eos=True)
            held = engine.prefill_counters()["held"]
            time.sleep(1.5)
            counters = engine.prefill_counters()
        finally:
            engine.close()
    assert tokens == reference[:3]
    assert held > 0 and counters["expired"] == 3 and counters["released"] == 0
    assert_no_leak(engine, counters)
