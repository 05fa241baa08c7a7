"""Moving KV blocks of per-layer tuple caches between two processes, without vLLM.

What ``kv_connector.TupleCacheConnector`` builds on (docs/vllm.md, "PD between two vLLM
instances"):

- ``Region``: one cache tensor (``kv_c`` or ``k_pe`` of a layer) as the transfer engine sees
  it: base address, bytes, bytes per block. Both sides list their regions in the same order
  (layer by layer, tuple order); ``layout_key`` is what must agree between them.
- ``block_runs`` / ``descriptors``: a request's blocks as ``(local, remote, length)`` byte
  ranges, one per run of blocks contiguous on both sides and per region, cut into batches of
  at most ``MAX_DESCRIPTORS``.
- ``ControlServer`` / ``ask``: one JSON object per line over TCP, one request per connection:
  the producer answers ``{"op": "layout"}`` with its engine's address and its regions, and
  records ``{"op": "done", "request_id": ...}``, the consumer's word that it has read a
  request's blocks (so they may be freed).
- ``new_engine``: Mooncake's ``TransferEngine`` over TCP with no metadata server; the
  ``mooncake`` package is imported only here.
"""

from __future__ import annotations

import json
import socket
import socketserver
import threading
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator, Sequence

from torch import Tensor

MAX_DESCRIPTORS = 512  # per batch: far below the engine's per-peer queue limit (~2048 in flight)
MAX_MESSAGE = 1 << 20  # bytes of one control-channel line


@dataclass(frozen=True)
class Region:
    """One cache tensor: ``num_blocks`` blocks of ``block_bytes`` from ``addr`` (block-major)."""

    addr: int
    nbytes: int
    block_bytes: int
    num_blocks: int
    block_shape: tuple[int, ...]  # one block's shape (the tensor's shape after dim 0)
    dtype: str


def regions_of(caches: Sequence[Sequence[Tensor]]) -> list[Region]:
    """The regions of per-layer cache tuples, layer by layer and in tuple order.

    Each tensor must be contiguous (a block is then one byte range) with at least one block."""
    out = []
    for i, layer in enumerate(caches):
        for j, t in enumerate(layer):
            if not t.is_contiguous() or t.dim() < 2 or t.shape[0] < 1:
                raise ValueError(f"cache tensor {j} of layer {i} must be contiguous and block-major "
                                 f"[num_blocks, ...]; got shape {list(t.shape)}, stride {list(t.stride())}")
            block_bytes = t.stride(0) * t.element_size()
            out.append(Region(t.data_ptr(), t.shape[0] * block_bytes, block_bytes, int(t.shape[0]),
                              tuple(int(d) for d in t.shape[1:]), str(t.dtype)))
    return out


def layout_key(regions: Sequence[Region]) -> list[list[Any]]:
    """What two sides must share to copy blocks byte for byte: per region, block shape and dtype
    (block counts and addresses may differ)."""
    return [[list(r.block_shape), r.dtype, r.block_bytes] for r in regions]


def block_runs(local: Sequence[int], remote: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(local_start, remote_start, count)`` for maximal runs where both ids step by one."""
    if len(local) != len(remote):
        raise ValueError(f"{len(local)} local blocks against {len(remote)} remote blocks")
    runs: list[tuple[int, int, int]] = []
    for lb, rb in zip(local, remote):
        if runs and lb == runs[-1][0] + runs[-1][2] and rb == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((lb, rb, 1))
    return runs


def descriptors(local: Sequence[Region], remote: Sequence[Region],
                runs: Sequence[tuple[int, int, int]]) -> tuple[list[int], list[int], list[int]]:
    """Byte ranges ``(local addrs, remote addrs, lengths)``: every run in every region pair.

    ``ValueError`` where the layouts differ or a block id is outside either side's cache."""
    if layout_key(local) != layout_key(remote):
        raise ValueError("the two sides' cache layouts differ (per tensor: block shape, dtype): "
                         f"{layout_key(local)} against {layout_key(remote)}")
    addrs: tuple[list[int], list[int], list[int]] = ([], [], [])
    for mine, theirs in zip(local, remote):
        for lb, rb, n in runs:
            if lb < 0 or rb < 0 or lb + n > mine.num_blocks or rb + n > theirs.num_blocks:
                raise ValueError(f"blocks {lb}+{n} (local, of {mine.num_blocks}) / {rb}+{n} "
                                 f"(remote, of {theirs.num_blocks}) out of range")
            addrs[0].append(mine.addr + lb * mine.block_bytes)
            addrs[1].append(theirs.addr + rb * theirs.block_bytes)
            addrs[2].append(n * mine.block_bytes)
    return addrs


def batches(addrs: tuple[list[int], list[int], list[int]],
            limit: int = MAX_DESCRIPTORS) -> Iterator[tuple[list[int], list[int], list[int]]]:
    """``descriptors``' output in slices of at most ``limit`` descriptors."""
    for i in range(0, len(addrs[0]), limit):
        yield addrs[0][i:i + limit], addrs[1][i:i + limit], addrs[2][i:i + limit]


def regions_to_json(regions: Sequence[Region]) -> list[dict]:
    return [asdict(r) for r in regions]


def regions_from_json(items: Sequence[dict]) -> list[Region]:
    return [Region(**{**d, "block_shape": tuple(d["block_shape"])}) for d in items]


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


def new_engine(host: str) -> Any:
    """A Mooncake ``TransferEngine`` on ``host`` over TCP, peer-to-peer handshake (no metadata
    server). Its RPC port is ``engine.get_rpc_port()`` (the engine binds all interfaces)."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise ImportError("TupleCacheConnector needs Mooncake's transfer engine: pip install "
                          "mooncake-transfer-engine-non-cuda (and libibverbs1 from the OS)") from e
    engine = TransferEngine()
    rc = engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise RuntimeError(f"Mooncake TransferEngine.initialize({host!r}, 'P2PHANDSHAKE', 'tcp') returned {rc}")
    return engine


def register(engine: Any, regions: Sequence[Region]) -> None:
    """Register every region with ``engine`` (once, at stable addresses); ``RuntimeError`` otherwise."""
    rc = engine.batch_register_memory([r.addr for r in regions], [r.nbytes for r in regions])
    if rc != 0:
        raise RuntimeError(f"Mooncake batch_register_memory of {len(regions)} cache tensors returned {rc}")


def read_blocks(engine: Any, peer: str, addrs: tuple[list[int], list[int], list[int]]) -> int:
    """Pull the byte ranges from ``peer`` (``"host:rpc_port"``) batch by batch; the bytes read.

    ``RuntimeError`` at the first failed batch (some of its ranges may have been written)."""
    done = 0
    for local, remote, lengths in batches(addrs):
        rc = engine.batch_transfer_sync_read(peer, local, remote, lengths)
        if rc != 0:
            raise RuntimeError(f"Mooncake batch_transfer_sync_read from {peer} of {len(local)} ranges returned {rc}")
        done += sum(lengths)
    return done
