"""The wire format of the PD control channels: declared schemas, JSON frames, raw tensor bytes.

Nothing here unpickles: a message is a JSON header plus raw tensor bytes, checked against the
receiving side's declared ``Schema`` before anyone reads it. Used by the pd-demo channel
(``pd/control.py``: one long-lived link) and the vLLM connector's control server
(``vllm/kv_transfer.py``: one request and its reply per connection); both authenticate first
(``pd/auth.py``).

A frame: ``FRAME_MAGIC, header bytes (u32), payload bytes (u32)`` (big-endian), the header, the
payload, and a 32-byte HMAC-SHA256 tag under the sending direction's session key over the
frame's sequence number and everything before the tag. The header is
``{"op": str, "fields": {...}, "tensors": [[name, dtype, shape], ...]}``; the payload is the
tensors' bytes in that order (C order, native little-endian as torch stores them on x86/ARM).

What a receiver does with a bad message: an unknown op or field, a missing field, a value of the
wrong type, a header that is not JSON, tensor bytes that do not add up, or a message over the
size limit (its bytes are read and dropped, never buffered) is a ``WireError`` naming it, and the
link stays usable. A bad tag, bad magic or a closed socket is ``PeerLost``: that link is over.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import select
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .auth import SessionKeys, client_handshake, discard, recv_exact, send_all, server_handshake

log = logging.getLogger(__name__)
FRAME_MAGIC = b"AGW1"
_PREFIX = struct.Struct("!4sII")
_TAG_BYTES = 32
DTYPES = {name: getattr(torch, name) for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32")}
DEFAULT_MAX_BYTES = 16 << 20  # one message, header and payload


class WireError(ValueError):
    """A message broke the declared schema or the size limit; the link itself is still usable."""


class PeerLost(ConnectionError):
    """The peer closed the link, died, or sent bytes that are not frames of this link."""


# -- schemas -------------------------------------------------------------------------------------

Check = Callable[[Any, str], None]


@dataclass(frozen=True)
class Field:
    """One declared field: how its value is checked, whether it must be present, whether a tensor."""

    check: Optional[Check]
    required: bool = True
    tensor: bool = False


def _is(types: tuple, words: str) -> Check:
    def check(value: Any, path: str) -> None:
        if isinstance(value, bool) and bool not in types or not isinstance(value, types):
            raise WireError(f"{path}: expected {words}, got {type(value).__name__}")
    return check


def _int_list(value: Any, path: str) -> None:
    _is((list,), "a list of ints")(value, path)
    for i, v in enumerate(value):
        _is((int,), "an int")(v, f"{path}[{i}]")


def record(fields: dict[str, Field]) -> Check:
    """A JSON object with exactly the declared keys (optional ones may be missing)."""
    def check(value: Any, path: str) -> None:
        _is((dict,), "an object")(value, path)
        _check_fields(value, fields, path)
    return check


def list_of(item: Check) -> Check:
    def check(value: Any, path: str) -> None:
        _is((list,), "a list")(value, path)
        for i, v in enumerate(value):
            item(v, f"{path}[{i}]")
    return check


def _nullable(check: Check) -> Check:
    return lambda value, path: None if value is None else check(value, path)


STR, INT, BOOL = Field(_is((str,), "a string")), Field(_is((int,), "an int")), Field(_is((bool,), "a bool"))
NUM, OBJECT, INTS = Field(_is((int, float), "a number")), Field(_is((dict,), "an object")), Field(_int_list)
TENSOR = Field(None, tensor=True)


def optional(f: Field) -> Field:
    return Field(f.check, required=False, tensor=f.tensor)


def nullable(f: Field) -> Field:
    return Field(_nullable(f.check), f.required)


def _check_fields(values: dict, fields: dict[str, Field], path: str) -> None:
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise WireError(f"{path}: unknown field(s) {', '.join(map(repr, unknown))} (declared: "
                        f"{', '.join(sorted(fields)) or 'none'})")
    missing = sorted(k for k, f in fields.items() if f.required and k not in values)
    if missing:
        raise WireError(f"{path}: missing field(s) {', '.join(map(repr, missing))}")
    for key, value in values.items():
        if fields[key].check is not None:
            fields[key].check(value, f"{path}.{key}")


class Schema:
    """The ops one side of a channel accepts, each with its declared fields."""

    def __init__(self, name: str, ops: dict[str, dict[str, Field]]) -> None:
        self.name, self.ops = name, ops

    def encode(self, op: str, fields: dict) -> tuple[bytes, bytes]:
        """Header and payload of a message; ``WireError`` where it breaks this schema."""
        self.check(op, fields)
        spec = self.ops[op]
        tensors = [(k, v) for k, v in fields.items() if spec[k].tensor]
        plain = {k: v for k, v in fields.items() if not spec[k].tensor}
        descr, payload = [], []
        for key, t in tensors:
            if not isinstance(t, torch.Tensor) or str(t.dtype).removeprefix("torch.") not in DTYPES:
                raise WireError(f"{op}.{key}: expected a tensor of {', '.join(DTYPES)}, got {t!r:.60}")
            t = t.detach().to("cpu").contiguous()
            descr.append([key, str(t.dtype).removeprefix("torch."), list(t.shape)])
            payload.append(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        header = json.dumps({"op": op, "fields": plain, "tensors": descr}, allow_nan=False).encode()
        return header, b"".join(payload)

    def check(self, op: str, fields: dict) -> None:
        if op not in self.ops:
            raise WireError(f"unknown op {op!r} (the {self.name} channel takes: {', '.join(sorted(self.ops))})")
        _check_fields(fields, self.ops[op], op)

    def decode(self, header: bytes, payload: bytes) -> dict:
        """The message ``{"op": ..., fields...}`` (tensors as CPU tensors); ``WireError`` naming what is wrong."""
        try:
            doc = json.loads(header.decode("utf-8"), parse_constant=_no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise WireError(f"malformed message: the header is not JSON ({type(e).__name__})") from None
        if not isinstance(doc, dict) or sorted(doc) != ["fields", "op", "tensors"]:
            raise WireError("malformed message: the header must be an object of exactly op, fields, tensors")
        op, fields, tensors = doc["op"], doc["fields"], doc["tensors"]
        if not isinstance(op, str) or not isinstance(fields, dict) or not isinstance(tensors, list):
            raise WireError("malformed message: op must be a string, fields an object, tensors a list")
        if op not in self.ops:
            raise WireError(f"unknown op {op!r} (the {self.name} channel takes: {', '.join(sorted(self.ops))})")
        message = dict(fields)
        offset = 0
        for i, entry in enumerate(tensors):
            key, t, offset = _tensor(op, self.ops[op], entry, payload, offset, i)
            if key in message:
                raise WireError(f"{op}: field {key!r} given twice")
            message[key] = t
        if offset != len(payload):
            raise WireError(f"{op}: the payload has {len(payload)} bytes, its tensors declare {offset}")
        for key, value in fields.items():
            if key in self.ops[op] and self.ops[op][key].tensor:
                raise WireError(f"{op}.{key}: a tensor field sent as JSON")
        self.check(op, message)
        return {"op": op, **message}


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _tensor(op: str, spec: dict[str, Field], entry: Any, payload: bytes, offset: int, i: int):
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)):
        raise WireError(f"{op}: tensors[{i}] must be [name, dtype, shape]")
    key, dtype, shape = entry
    if key not in spec or not spec[key].tensor:
        raise WireError(f"{op}: {key!r} is not a declared tensor field")
    if dtype not in DTYPES:
        raise WireError(f"{op}.{key}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                            for d in shape)):
        raise WireError(f"{op}.{key}: shape must be a list of non-negative ints, got {shape!r:.60}")
    numel = 1
    for d in shape:
        numel *= d
    size = numel * DTYPES[dtype].itemsize
    if offset + size > len(payload):
        raise WireError(f"{op}.{key}: {size} bytes declared, {len(payload) - offset} left in the payload")
    data = payload[offset:offset + size]
    t = torch.frombuffer(bytearray(data), dtype=DTYPES[dtype]) if size else torch.empty(0, dtype=DTYPES[dtype])
    return key, t.reshape(shape), offset + size


# -- an authenticated link -------------------------------------------------------------------------


class Connection:
    """One end of an authenticated link: ``send`` checks against ``outgoing``, ``recv`` against ``incoming``.

    ``max_bytes`` bounds one message (header and payload), both ways; a frame must arrive whole
    within ``frame_timeout_s`` of its first byte."""

    def __init__(self, sock: socket.socket, keys: SessionKeys, peer: str, incoming: Schema, outgoing: Schema, *,
                 max_bytes: int = DEFAULT_MAX_BYTES, frame_timeout_s: float = 30.0) -> None:
        self._sock, self._keys, self.peer = sock, keys, peer
        self.incoming, self.outgoing = incoming, outgoing
        self.max_bytes, self.frame_timeout_s = max_bytes, frame_timeout_s
        self._sent = self._received = 0  # frame sequence numbers, per direction
        self.closed = False

    def send(self, op: str, **fields: Any) -> None:
        """Send one message; ``WireError`` (nothing sent) where it breaks the schema or the size limit,
        ``PeerLost`` when the peer is gone."""
        header, payload = self.outgoing.encode(op, fields)
        if len(header) + len(payload) > self.max_bytes:
            raise WireError(f"{op}: a message of {len(header) + len(payload)} bytes exceeds the limit of "
                            f"{self.max_bytes} bytes")
        self.send_frame(header, payload)

    def send_frame(self, header: bytes, payload: bytes) -> None:
        """Send raw header and payload bytes as one authenticated frame (no schema check)."""
        prefix = _PREFIX.pack(FRAME_MAGIC, len(header), len(payload))
        tag = hmac.new(self._keys.send, self._sent.to_bytes(8, "big") + prefix, hashlib.sha256)
        tag.update(header)
        tag.update(payload)
        try:
            send_all(self._sock, prefix + header + payload + tag.digest(), time.monotonic() + self.frame_timeout_s,
                     f"sending to the {self.peer}")
        except (OSError, TimeoutError) as e:
            self.close()
            raise PeerLost(f"the {self.peer} is gone ({e})") from e
        self._sent += 1

    def recv(self, timeout_s: float) -> Optional[dict]:
        """The next message, or None when no frame starts within ``timeout_s``. ``WireError``: that
        message was refused, the link goes on; ``PeerLost``: the link is over."""
        if self.closed:
            raise PeerLost(f"the link to the {self.peer} is closed")
        try:
            ready, _, _ = select.select([self._sock], [], [], max(timeout_s, 0.0))
        except (OSError, ValueError) as e:
            raise PeerLost(f"the {self.peer} is gone ({e})") from e
        if not ready:
            return None
        header, payload = self._read_frame(time.monotonic() + self.frame_timeout_s)
        return self.incoming.decode(header, payload)

    def _read_frame(self, deadline: float) -> tuple[bytes, bytes]:
        what = f"reading from the {self.peer}"
        try:
            prefix = recv_exact(self._sock, _PREFIX.size, deadline, what)
            magic, header_len, payload_len = _PREFIX.unpack(prefix)
            if magic != FRAME_MAGIC:
                raise ConnectionError("bytes that are not a frame of this link")
            tag = hmac.new(self._keys.recv, self._received.to_bytes(8, "big") + prefix, hashlib.sha256)
            size = header_len + payload_len
            if size > self.max_bytes:
                discard(self._sock, size, deadline, what, tag.update)
                header = payload = None
            else:
                header = recv_exact(self._sock, header_len, deadline, what)
                payload = recv_exact(self._sock, payload_len, deadline, what)
                tag.update(header)
                tag.update(payload)
            if not hmac.compare_digest(recv_exact(self._sock, _TAG_BYTES, deadline, what), tag.digest()):
                raise ConnectionError("a frame failed its integrity check")
        except (OSError, TimeoutError) as e:
            self.close()
            raise PeerLost(f"the {self.peer} is gone or broke the link ({e})") from e
        self._received += 1
        if header is None:
            raise WireError(f"a message of {size} bytes exceeds the limit of {self.max_bytes} bytes")
        return header, payload

    def close(self) -> None:
        self.closed = True
        try:
            self._sock.close()
        except OSError:
            pass


# -- opening links ---------------------------------------------------------------------------------


class Listener:
    """A TCP listener on ``host:port`` (port 0: a free one; ``address`` says which) for authenticated links."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self._sock = socket.create_server((host, port), backlog=16)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._secret = secret
        self.refused = 0  # connections that failed the challenge

    def accept(self, timeout_s: float, peer: str, incoming: Schema, outgoing: Schema, *,
               handshake_timeout_s: float = 10.0, **options: Any) -> Connection:
        """The first peer to pass the challenge within ``timeout_s``; others are refused (logged,
        counted) and the wait goes on. ``TimeoutError`` when none does."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {peer} passed the challenge on {self.address[0]}:{self.address[1]} within "
                                   f"{timeout_s:g} s ({self.refused} refused)")
            self._sock.settimeout(left)
            try:
                sock, where = self._sock.accept()
            except socket.timeout:
                continue
            try:
                keys = server_handshake(sock, self._secret, min(deadline, time.monotonic() + handshake_timeout_s))
            except (OSError, TimeoutError) as e:  # AuthError is an OSError
                self.refused += 1
                log.warning("refused a control connection from %s:%d: %s", where[0], where[1], e)
                sock.close()
                continue
            return Connection(sock, keys, peer, incoming, outgoing, **options)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def connect(address: tuple[str, int], secret: bytes, peer: str, incoming: Schema, outgoing: Schema, *,
            timeout_s: float, retry: bool = True, **options: Any) -> Connection:
    """An authenticated link to ``address`` within ``timeout_s`` (``retry``: while nobody listens yet).

    ``AuthError`` where the secrets differ, ``TimeoutError`` past the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection(address, timeout=max(0.01, deadline - time.monotonic()))
            break
        except ConnectionRefusedError:
            if not retry or time.monotonic() > deadline:
                raise TimeoutError(f"no {peer} listens on {address[0]}:{address[1]} (waited {timeout_s:g} s)") from None
            time.sleep(0.05)
        except socket.timeout:
            raise TimeoutError(f"connecting to the {peer} at {address[0]}:{address[1]} took over {timeout_s:g} s") \
                from None
    try:
        keys = client_handshake(sock, secret, deadline)
    except BaseException:
        sock.close()
        raise
    return Connection(sock, keys, peer, incoming, outgoing, **options)
