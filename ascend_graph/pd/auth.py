"""Shared-secret authentication of the PD control channels: a mutual HMAC-SHA256 challenge.

There is no built-in key. A secret is at least ``MIN_SECRET_BYTES`` bytes that both ends hold:
``new_secret()`` makes a random one per run (the decode side hands it to the prefill process it
starts, on that child's stdin), or the user gives the same one to both ends (``secret_from``: a
file, or ``$ASCEND_GRAPH_PD_SECRET``). The secret itself never crosses the wire.

The challenge, before any message (``client_handshake`` / ``server_handshake``):

1. server -> client: ``GREETING + b"S" + ns`` (a fresh random 32-byte nonce);
2. client -> server: ``GREETING + b"C" + nc + HMAC(secret, "client" | ns | nc)``;
3. server: a wrong proof (constant-time compare) -> ``GREETING + b"N"`` and the link is closed;
   else ``GREETING + b"A" + HMAC(secret, "server" | ns | nc)``, which the client checks in turn.

Both ends then derive one key per direction from the secret and both nonces; every later frame
carries an HMAC under its direction's key over a sequence number and its bytes (``pd/wire.py``),
so a frame cannot be forged, replayed or reordered by whoever can reach the port. Every read
here has a deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Iterator, Optional

SECRET_ENV = "ASCEND_GRAPH_PD_SECRET"
MIN_SECRET_BYTES = 16
NONCE_BYTES = 32
GREETING = b"AGPD-AUTH1"
_MAC_BYTES = hashlib.sha256().digest_size


class AuthError(ConnectionError):
    """The peer did not prove it holds the shared secret (or is no peer of this protocol)."""


@dataclass(frozen=True)
class SessionKeys:
    """One HMAC key per direction of an authenticated link."""

    send: bytes
    recv: bytes


def new_secret() -> bytes:
    """A fresh random secret for one run (64 hex characters)."""
    return secrets.token_hex(32).encode()


def check_secret(secret: object, what: str) -> bytes:
    """``secret`` as bytes; ``ValueError`` naming ``what`` unless it is bytes of at least ``MIN_SECRET_BYTES``."""
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, (bytes, bytearray)):
        raise ValueError(f"{what} must be bytes (a shared secret), got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{what} is {len(secret)} bytes; a shared secret needs at least {MIN_SECRET_BYTES} "
                         "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')")
    return bytes(secret)


def read_secret_file(path: str, what: str) -> bytes:
    """The secret in the file ``path`` (surrounding whitespace stripped); errors name ``what``."""
    try:
        with open(path, "rb") as f:
            data = f.read(1 << 16)
    except OSError as e:
        raise ValueError(f"{what}: cannot read the secret file {path!r} ({e.strerror or e})") from None
    return check_secret(data.strip(), f"{what} ({path})")


def secret_from(secret: Optional[bytes] = None, secret_file: Optional[str] = None, *, what: str) -> bytes:
    """The shared secret: ``secret``, else the content of ``secret_file``, else ``$ASCEND_GRAPH_PD_SECRET``.

    There is no default: with none of them, ``ValueError`` naming ``what`` (the settings to use)."""
    if secret is not None:
        return check_secret(secret, what)
    if secret_file is not None:
        return read_secret_file(secret_file, what)
    env = os.environ.get(SECRET_ENV)
    if env:
        return check_secret(env.strip().encode(), f"${SECRET_ENV}")
    raise ValueError(f"no shared secret: {what}, or set ${SECRET_ENV}; both ends must use the same one "
                     "(there is no default key)")


# -- the challenge --------------------------------------------------------------------------------


def server_handshake(sock: socket.socket, secret: bytes, deadline: float) -> SessionKeys:
    """Challenge a freshly accepted peer; its session keys, or ``AuthError`` / ``TimeoutError``."""
    ns = secrets.token_bytes(NONCE_BYTES)
    send_all(sock, GREETING + b"S" + ns, deadline, "authentication")
    reply = recv_exact(sock, len(GREETING) + 1 + NONCE_BYTES + _MAC_BYTES, deadline, "authentication")
    head, nc, proof = reply[:len(GREETING) + 1], reply[-NONCE_BYTES - _MAC_BYTES:-_MAC_BYTES], reply[-_MAC_BYTES:]
    if head != GREETING + b"C":
        raise AuthError("the peer is not an authenticated ascend-graph control client (bad greeting)")
    if not hmac.compare_digest(proof, _mac(secret, b"client", ns, nc)):
        try:
            send_all(sock, GREETING + b"N", deadline, "authentication")
        except (OSError, TimeoutError):
            pass
        raise AuthError("the peer's proof is wrong: it does not hold this side's secret")
    send_all(sock, GREETING + b"A" + _mac(secret, b"server", ns, nc), deadline, "authentication")
    return SessionKeys(send=_mac(secret, b"s2c", ns, nc), recv=_mac(secret, b"c2s", ns, nc))


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> SessionKeys:
    """Answer a server's challenge and check its proof; session keys, or ``AuthError`` / ``TimeoutError``."""
    challenge = recv_exact(sock, len(GREETING) + 1 + NONCE_BYTES, deadline, "authentication")
    if challenge[:len(GREETING) + 1] != GREETING + b"S":
        raise AuthError("the server is not an ascend-graph control server (bad greeting)")
    ns, nc = challenge[-NONCE_BYTES:], secrets.token_bytes(NONCE_BYTES)
    send_all(sock, GREETING + b"C" + nc + _mac(secret, b"client", ns, nc), deadline, "authentication")
    verdict = recv_exact(sock, len(GREETING) + 1, deadline, "authentication")
    if verdict == GREETING + b"N":
        raise AuthError("the server refused this side's proof: the two ends hold different secrets")
    if verdict != GREETING + b"A":
        raise AuthError("the server answered the challenge with something else")
    proof = recv_exact(sock, _MAC_BYTES, deadline, "authentication")
    if not hmac.compare_digest(proof, _mac(secret, b"server", ns, nc)):
        raise AuthError("the server's proof is wrong: it does not hold this side's secret")
    return SessionKeys(send=_mac(secret, b"c2s", ns, nc), recv=_mac(secret, b"s2c", ns, nc))


def _mac(secret: bytes, label: bytes, ns: bytes, nc: bytes) -> bytes:
    return hmac.new(secret, b"ascend-graph " + label + b"|" + ns + nc, hashlib.sha256).digest()


# -- socket reads and writes with a deadline --------------------------------------------------------


def recv_exact(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    """Exactly ``n`` bytes before ``deadline`` (monotonic); ``TimeoutError`` / ``ConnectionError``."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        got += _recv_some(sock, view[got:], deadline, what)
    return bytes(buf)


def discard(sock: socket.socket, n: int, deadline: float, what: str, sink) -> None:
    """Read and drop ``n`` bytes before ``deadline``, passing each chunk to ``sink`` (a MAC's update)."""
    chunk = bytearray(min(n, 1 << 20))
    while n > 0:
        k = _recv_some(sock, memoryview(chunk)[:min(n, len(chunk))], deadline, what)
        sink(chunk[:k])
        n -= k


def _recv_some(sock: socket.socket, view: memoryview, deadline: float, what: str) -> int:
    with _before(sock, deadline, f"{what}: the peer sent too little before the deadline"):
        k = sock.recv_into(view, len(view))
    if k == 0:
        raise ConnectionError(f"{what}: the peer closed the connection")
    return k


def send_all(sock: socket.socket, data: bytes, deadline: float, what: str) -> None:
    """Send ``data`` before ``deadline``; ``TimeoutError`` / ``OSError``."""
    with _before(sock, deadline, f"{what}: the peer did not take {len(data)} bytes before the deadline"):
        sock.sendall(data)


@contextlib.contextmanager
def _before(sock: socket.socket, deadline: float, late: str) -> Iterator[None]:
    """The socket's timeout set to what is left until ``deadline``; ``TimeoutError(late)`` past it."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(late)
    sock.settimeout(left)
    try:
        yield
    except socket.timeout:
        raise TimeoutError(late) from None
