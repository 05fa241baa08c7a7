"""A source process for the transport tests (tests/test_pd_transport.py), and the test's handle on it.

Run as ``python tests/pd_peer.py TRANSPORT DTYPE NUM_BLOCKS SEED``: it fills its caches from
``SEED`` (``make_caches``, so the test can rebuild the same data as its oracle), registers them
with a source transport, prints its endpoint as one JSON line and then answers one JSON line per
JSON command on stdin: ``connect``, ``send`` (builds the same plan as the destination; optionally
slow after batch 0), ``fresh`` (a new transport over new caches of a given dtype, same seed),
``exit``. Replies: ``{"ok": ...}`` or ``{"error": ...}``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import subprocess
import sys
import time
from typing import Optional

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
if __name__ == "__main__":
    # a source process needs only ascend_graph.pd and ascend_graph.kv_cache: skip the package's
    # __init__ (its re-exports import the whole engine, seconds on a busy 2-core machine)
    import types

    _package = types.ModuleType("ascend_graph")
    _package.__path__ = [os.path.join(os.path.dirname(HERE), "ascend_graph")]
    sys.modules["ascend_graph"] = _package

from ascend_graph.kv_cache import MLACacheSpec, allocate_kv_caches  # noqa: E402
from ascend_graph.pd.layout import CacheLayout, Descriptor, TransferPlan, plan_transfer  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BLOCK_SIZE, KV_LORA_RANK, ROPE_DIM, LAYERS = 4, 64, 16, 2


def make_caches(dtype: str, num_blocks: int, seed: int):
    """Two MLA layers ``[N, 4, 1, 64]`` / ``[N, 4, 1, 16]`` of seeded normal values."""
    spec = MLACacheSpec(KV_LORA_RANK, ROPE_DIM, DTYPES[dtype])
    kv = allocate_kv_caches([spec] * LAYERS, num_blocks, BLOCK_SIZE)
    g = torch.Generator().manual_seed(seed)
    for cache in kv:
        for t in cache:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return kv


def build_plan(src: CacheLayout, dst: CacheLayout, cmd: dict) -> TransferPlan:
    """The plan of a ``send`` command; ``corrupt: [batch, k]`` points that descriptor's source 1 GiB
    past the end of the source's caches (memory no engine registered)."""
    plan = plan_transfer(src, dst, cmd["src_blocks"], cmd["dst_blocks"], max_descriptors=cmd["max_descriptors"])
    if cmd.get("corrupt") is None:
        return plan
    b, k = cmd["corrupt"]
    beyond = max(r.address + r.num_blocks * r.block_bytes for r in src.regions) + (1 << 30)
    batches = [list(batch) for batch in plan.batches]
    batches[b][k] = Descriptor(beyond, batches[b][k].dst, batches[b][k].length)
    return dataclasses.replace(plan, batches=tuple(tuple(batch) for batch in batches))


class Peer:
    """The test's side of a peer process: spawn, one command at a time, every wait bounded."""

    def __init__(self, transport: str, dtype: str, num_blocks: int, seed: int, timeout_s: float = 30.0) -> None:
        env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "pd_peer.py"), transport, dtype,
                                      str(num_blocks), str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        self._pending = b""  # read from the pipe, not yet a whole line
        self._endpoint: Optional[dict] = None
        self.timeout_s = timeout_s

    @property
    def endpoint(self) -> dict:
        """The source transport's endpoint (its first line, waited for on first use)."""
        if self._endpoint is None:
            self._endpoint = self.reply(self.timeout_s)["ok"]
        return self._endpoint

    def fresh(self, dtype: str) -> dict:
        """Replace the peer's transport and caches (``dtype``, same block count and seed): its endpoint."""
        self.endpoint  # noqa: B018 (the start line first)
        out = self.call({"op": "fresh", "dtype": dtype})
        self._endpoint = out["ok"]
        return self._endpoint

    def request(self, cmd: dict) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float) -> dict:
        """The next reply line, within ``timeout_s``; raises ``TimeoutError`` / ``EOFError``."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()  # read raw: a buffered reader would hide lines from select
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._pending:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"peer {self.proc.pid} did not answer within {timeout_s} s")
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise EOFError(f"peer {self.proc.pid} exited (status {self.proc.poll()})")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def call(self, cmd: dict, timeout_s: float = 30.0) -> dict:
        self.request(cmd)
        return self.reply(timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def _serve(argv: list[str]) -> None:
    from ascend_graph.pd.select import open_transport

    name, dtype, num_blocks, seed = argv[0], argv[1], int(argv[2]), int(argv[3])

    def hold(i: int, seconds: float) -> None:  # a slow source: sleeps once batch 0 is sent
        if i == 0:
            time.sleep(seconds)

    kv = make_caches(dtype, num_blocks, seed)
    transport = open_transport(name, "source")
    layout = transport.register(kv)
    print(json.dumps({"ok": transport.endpoint()}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["op"] == "connect":
                transport.connect(cmd["peer"], cmd["timeout_s"])
                out = {"ok": True}
            elif cmd["op"] == "send":
                plan = build_plan(layout, CacheLayout.from_dict(cmd["dst_layout"]), cmd)
                seconds = cmd.get("hold_after_batch0_s")
                transport.after_batch = None if seconds is None else (lambda i: hold(i, seconds))
                transport.send(plan, cmd["timeout_s"])
                out = {"ok": True}
            elif cmd["op"] == "fresh":
                transport.close()
                kv = make_caches(cmd["dtype"], num_blocks, seed)
                transport = open_transport(name, "source")
                layout = transport.register(kv)
                out = {"ok": transport.endpoint()}
            else:
                transport.close()
                print(json.dumps({"ok": True}), flush=True)
                return
        except Exception as e:  # reported to the test, which decides
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _serve(sys.argv[1:])
