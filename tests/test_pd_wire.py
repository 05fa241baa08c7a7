"""The PD control channels' wire format and authentication (``pd/wire.py``, ``pd/auth.py``), over
real sockets on 127.0.0.1 in this process.

Oracles: the declared schemas of ``pd/control.py`` (what each side may send), the bytes a tensor
had before it was sent, and the standard library's pickle (a payload is first shown to run code
when unpickled, then sent to the port, where it must not). The prefill process and the vLLM
control server are tested end to end in tests/test_pd.py and tests/test_vllm_kv_transfer.py.
"""

import json
import os
import pathlib
import pickle
import queue
import socket
import struct
import threading
import time

import pytest
import torch

from ascend_graph.pd import auth, wire
from ascend_graph.pd.control import TO_DECODE, TO_PREFILL

SECRET = b"s" * 32
DEADLINE_S = 20.0  # generous: the host is shared; nothing here is timed


class Touch:
    """Unpickling this creates ``path`` (the stand-in for arbitrary code)."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def live_payload(tmp_path, name):
    """A pickle that creates ``tmp_path/name`` when loaded; proven live on a twin first."""
    twin = tmp_path / f"{name}.twin"
    pickle.loads(pickle.dumps(Touch(twin)))
    assert twin.exists(), "the payload must run code under pickle, or the test proves nothing"
    return pickle.dumps(Touch(tmp_path / name)), tmp_path / name


@pytest.fixture
def listener():
    with wire.Listener("127.0.0.1", 0, SECRET) as lst:
        yield lst


def accept_in_thread(listener, **options):
    """Start accepting (the prefill side's end: it receives TO_PREFILL); a queue that gets the
    Connection or the exception."""
    out = queue.Queue()

    def run():
        try:
            out.put(listener.accept(DEADLINE_S, "decode process", TO_PREFILL, TO_DECODE, **options))
        except Exception as e:  # handed to the test
            out.put(e)

    threading.Thread(target=run, daemon=True).start()
    return out


def client(listener, secret=SECRET, **options):
    return wire.connect(listener.address, secret, "prefill process", TO_DECODE, TO_PREFILL, timeout_s=DEADLINE_S,
                        **options)


def pair(listener, **options):
    accepted = accept_in_thread(listener, **options)
    decode = client(listener)
    prefill = accepted.get(timeout=DEADLINE_S)
    assert isinstance(prefill, wire.Connection), prefill
    return decode, prefill


def frame(header: dict) -> bytes:
    return json.dumps(header).encode()


# -- the schema ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_tensor_arrives_bit_exact_with_its_dtype_and_shape(listener, dtype):
    decode, prefill = pair(listener)
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits[7] = float("nan")
    prefill.send("prefilled", id=3, src_blocks=[4, 5], logits=logits, lease_s=1.5)
    msg = decode.recv(DEADLINE_S)
    assert set(msg) == {"op", "id", "src_blocks", "logits", "lease_s"}
    assert (msg["op"], msg["id"], msg["src_blocks"], msg["lease_s"]) == ("prefilled", 3, [4, 5], 1.5)
    got = msg["logits"]
    assert got.dtype == dtype and got.shape == (300,)
    assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       logits.view(torch.int16 if dtype != torch.float32 else torch.int32))


@pytest.mark.parametrize("header, words", [
    ({"op": "evil", "fields": {}, "tensors": []}, "unknown op 'evil'"),
    ({"op": "release", "fields": {"id": 1, "extra": 2}, "tensors": []}, r"release: unknown field\(s\) 'extra'"),
    ({"op": "release", "fields": {}, "tensors": []}, r"release: missing field\(s\) 'id'"),
    ({"op": "release", "fields": {"id": "1"}, "tensors": []}, "release.id: expected an int, got str"),
    ({"op": "release", "fields": {"id": True}, "tensors": []}, "release.id: expected an int, got bool"),
    ({"op": "prefill", "fields": {"jobs": [{"id": 1, "prompt": [1], "dst_blocks": [1], "timeout_s": 1,
                                            "code": "x"}]}, "tensors": []}, r"prefill.jobs\[0\]: unknown field"),
    ({"op": "prefill", "fields": {"jobs": [{"id": 1, "prompt": [1.5], "dst_blocks": [1], "timeout_s": 1}]},
      "tensors": []}, r"prefill.jobs\[0\].prompt\[0\]: expected an int"),
    ({"op": "release", "fields": {"id": 1}, "tensors": [["logits", "float32", [1]]]}, "not a declared tensor"),
    ({"op": "release", "fields": {"id": 1}}, "exactly op, fields, tensors"),
    ([1, 2], "exactly op, fields, tensors"),
])
def test_an_undeclared_or_ill_typed_message_is_refused_naming_it_and_the_link_goes_on(listener, header, words):
    decode, prefill = pair(listener)
    decode.send_frame(frame(header), b"")
    with pytest.raises(wire.WireError, match=words):
        prefill.recv(DEADLINE_S)
    decode.send("release", id=9)
    assert prefill.recv(DEADLINE_S) == {"op": "release", "id": 9}


def test_a_malformed_header_or_payload_is_refused_and_the_link_goes_on(listener, tmp_path):
    payload, marker = live_payload(tmp_path, "ran")
    decode, prefill = pair(listener)
    cases = [(payload, b"", "not JSON"),  # a pickle where the JSON header goes
             (b'{"op": "release", "fields": {"id": NaN}, "tensors": []}', b"", "not JSON"),
             (b"\xff\xfe", b"", "not JSON"),
             (frame({"op": "stats", "fields": {}, "tensors": []}), payload, "the payload has"),  # bytes nobody declared
             (frame({"op": "hello", "fields": {}, "tensors": [["layout", "float32", [2]]]}), b"x" * 8,
              "not a declared tensor")]
    for header, body, words in cases:
        decode.send_frame(header, body)
        with pytest.raises(wire.WireError, match=words):
            prefill.recv(DEADLINE_S)
    decode.send("stats")
    assert prefill.recv(DEADLINE_S) == {"op": "stats"}
    assert not marker.exists()


@pytest.mark.parametrize("tensors, payload, words", [
    ([["logits", "object", [1]]], b"x" * 8, "dtype 'object' is not one of"),
    ([["logits", "float32", [-1]]], b"", "non-negative ints"),
    ([["logits", "float32", [4]]], b"x" * 8, "16 bytes declared, 8 left"),
])
def test_tensor_descriptions_that_do_not_hold_are_refused(listener, tensors, payload, words):
    decode, prefill = pair(listener)
    header = {"op": "prefilled", "fields": {"id": 1, "src_blocks": [1], "lease_s": 1.0}, "tensors": tensors}
    prefill.send_frame(frame(header), payload)
    with pytest.raises(wire.WireError, match=words):
        decode.recv(DEADLINE_S)


def test_an_oversized_message_is_dropped_unread_and_the_link_goes_on(listener):
    decode, prefill = pair(listener, max_bytes=4096)
    header = frame({"op": "stats", "fields": {}, "tensors": []})
    decode.send_frame(header, b"\0" * 100_000)
    with pytest.raises(wire.WireError, match=f"message of {len(header) + 100_000} bytes exceeds the limit of 4096"):
        prefill.recv(DEADLINE_S)
    decode.send("release", id=2)
    assert prefill.recv(DEADLINE_S) == {"op": "release", "id": 2}
    with pytest.raises(wire.WireError, match="exceeds the limit of 4096"):  # nor is one sent
        prefill.send("prefilled", id=1, src_blocks=[1], logits=torch.zeros(2048), lease_s=1.0)
    prefill.send("released", id=1, held=True)
    assert decode.recv(DEADLINE_S) == {"op": "released", "id": 1, "held": True}


def test_a_sender_breaking_its_own_schema_sends_nothing(listener):
    decode, prefill = pair(listener)
    with pytest.raises(wire.WireError, match="unknown op 'prefilled'"):  # a prefill-side op, from the decode side
        decode.send("prefilled", id=1, src_blocks=[], logits=torch.zeros(1), lease_s=1.0)
    with pytest.raises(wire.WireError, match="release: unknown field"):
        decode.send("release", id=1, note="x")
    assert prefill.recv(0.2) is None


def test_a_forged_or_replayed_frame_ends_the_link(listener):
    decode, prefill = pair(listener)
    header = frame({"op": "release", "fields": {"id": 1}, "tensors": []})
    prefix = struct.pack("!4sII", wire.FRAME_MAGIC, len(header), 0)
    decode._sock.sendall(prefix + header + b"\0" * 32)  # a tag made without the session key
    with pytest.raises(wire.PeerLost, match="integrity"):
        prefill.recv(DEADLINE_S)
    assert prefill.closed


def test_recv_returns_none_when_nothing_arrives_and_a_stalled_frame_misses_its_deadline(listener):
    decode, prefill = pair(listener, frame_timeout_s=0.5)
    assert prefill.recv(0.1) is None
    decode._sock.sendall(b"AGW1")  # a frame begun and never finished
    start = time.monotonic()
    with pytest.raises(wire.PeerLost, match="before the deadline"):
        prefill.recv(DEADLINE_S)
    assert time.monotonic() - start < DEADLINE_S  # the frame deadline ended it, not the caller's wait


# -- authentication --------------------------------------------------------------------------------


def test_wrong_missing_or_pickled_credentials_are_refused_and_the_listener_serves_the_right_peer(tmp_path):
    payload, marker = live_payload(tmp_path, "ran")
    with wire.Listener("127.0.0.1", 0, SECRET) as lst:
        accepted = queue.Queue()
        threading.Thread(target=lambda: accepted.put(lst.accept(DEADLINE_S, "decode process", TO_PREFILL, TO_DECODE,
                                                                handshake_timeout_s=1.0)), daemon=True).start()
        with pytest.raises(auth.AuthError, match="different secrets"):
            client(lst, secret=b"w" * 32)
        with socket.create_connection(lst.address) as silent:  # no key at all: says nothing
            silent.recv(64)  # the challenge
            time.sleep(1.5)  # past the server's handshake deadline (1 s)
        with socket.create_connection(lst.address) as raw:  # a pickle where the answer goes
            raw.recv(64)
            raw.settimeout(DEADLINE_S)
            try:
                raw.sendall(payload + b"\0" * 80)
                assert raw.recv(64) == b""  # closed without a word
            except (ConnectionResetError, BrokenPipeError):  # closed with our bytes unread
                pass
        decode = client(lst)
        prefill = accepted.get(timeout=DEADLINE_S)
        decode.send("release", id=4)
        assert prefill.recv(DEADLINE_S) == {"op": "release", "id": 4}
        assert lst.refused == 3
    assert not marker.exists()


def test_the_client_refuses_a_server_that_cannot_prove_the_secret():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        def fake():
            conn, _ = srv.accept()
            with conn:
                conn.sendall(auth.GREETING + b"S" + os.urandom(32))
                conn.recv(128)
                conn.sendall(auth.GREETING + b"A" + os.urandom(32))  # "accepted", with a made-up proof
                time.sleep(1)

        threading.Thread(target=fake, daemon=True).start()
        with pytest.raises(auth.AuthError, match="server's proof is wrong"):
            wire.connect(srv.getsockname()[:2], SECRET, "x", TO_DECODE, TO_PREFILL, timeout_s=DEADLINE_S)


def test_a_server_that_never_speaks_fails_the_connect_at_its_deadline():
    with socket.create_server(("127.0.0.1", 0)) as srv:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="authentication"):
            wire.connect(srv.getsockname()[:2], SECRET, "x", TO_DECODE, TO_PREFILL, timeout_s=0.5)
        assert time.monotonic() - start < DEADLINE_S


def test_each_link_has_fresh_session_keys(listener):
    a, _ = pair(listener)
    b, _ = pair(listener)
    assert a._keys.send != b._keys.send and a._keys.recv != b._keys.recv and a._keys.send != a._keys.recv


@pytest.mark.parametrize("kwargs, env, words", [
    ({}, None, "no shared secret: give --x, or set \\$ASCEND_GRAPH_PD_SECRET"),
    ({"secret": b"short"}, None, "5 bytes; a shared secret needs at least 16"),
    ({"secret_file": "/nonexistent/secret"}, None, "cannot read the secret file '/nonexistent/secret'"),
    ({}, "tiny", "ASCEND_GRAPH_PD_SECRET is 4 bytes"),
])
def test_there_is_no_default_secret(monkeypatch, kwargs, env, words):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(auth.SECRET_ENV, env)
    with pytest.raises(ValueError, match=words):
        auth.secret_from(what="give --x", **kwargs)


def test_a_secret_comes_from_the_argument_the_file_or_the_environment(monkeypatch, tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(b"f" * 20 + b"\n")
    monkeypatch.setenv(auth.SECRET_ENV, "e" * 20)
    assert auth.secret_from(b"a" * 16, str(path), what="x") == b"a" * 16
    assert auth.secret_from(secret_file=str(path), what="x") == b"f" * 20
    assert auth.secret_from(what="x") == b"e" * 20
    assert len(auth.new_secret()) == 64 and auth.new_secret() != auth.new_secret()
