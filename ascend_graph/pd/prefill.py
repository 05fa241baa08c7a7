"""The prefill role: eager prefill on its own tuple caches, blocks held until the decode side confirms.

``PrefillServer.serve(channel)`` answers one decode process: the handshake (both layouts must
match, ``layout.CacheLayout.check_matches``), then ``prefill`` jobs (prompt + the decode side's
block ids) batched into one eager step per round as far as free blocks allow. For each job it
sends ``prefilled`` (its own block ids and the last token's logits) and then the transport's
source side of the plan. It frees a job's blocks on ``release`` (the decode side has the data or
gave up), or when no release came within ``hold_timeout_s``. Run as a process:
``python -m ascend_graph.pd.prefill --model small --port 0`` prints ``READY <port>`` once listening.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

from ..config import GraphConfig
from ..engine.engine import Engine
from ..runner.step import SequenceStep
from .control import Channel, PeerLost, accept, listen
from .layout import REGISTRATION_ALIGN, CacheLayout, LayoutMismatch, plan_transfer
from .select import open_transport
from .transport import TransferError

log = logging.getLogger(__name__)
READY = "READY"


@dataclass
class PrefillStats:
    """Counters of a prefill server."""

    prefill_steps: int = 0
    prefilled: int = 0
    failed: int = 0
    released: int = 0
    expired: int = 0  # holds freed because no release came in time
    send_errors: int = 0
    prefill_seconds: float = 0.0


class PrefillServer:
    """Eager prefill over ``model`` with ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, model: nn.Module, *, block_size: int, num_blocks: int, max_model_len: int,
                 transport: str = "auto", host: str = "127.0.0.1", max_batch: int = 8,
                 hold_timeout_s: float = 120.0, handshake_timeout_s: float = 60.0) -> None:
        self.engine = Engine(model, graph_config=GraphConfig(enabled=False), block_size=block_size,
                             num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=max_batch,
                             cache_align_bytes=REGISTRATION_ALIGN)
        self.transport = open_transport(transport, "source", host)
        self.layout = self.transport.register(self.engine.runner.kv_caches)
        self.max_batch = max_batch
        self.hold_timeout_s = hold_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.stats = PrefillStats()
        self._waiting: deque[dict] = deque()
        self._held: dict[object, float] = {}  # request id -> release deadline
        self._peer: Optional[CacheLayout] = None
        self._plan_options: dict = {}

    def serve(self, channel: Channel) -> None:
        """Handshake, then answer ``channel`` until ``shutdown`` or the decode side is gone."""
        try:
            if self._handshake(channel):
                self._loop(channel)
        except PeerLost as e:
            log.warning("prefill server: %s; freeing every held block", e)
        finally:
            for rid in list(self._held):
                self._free(rid)
            self.transport.close()

    # -- protocol -----------------------------------------------------------------------------

    def _handshake(self, channel: Channel) -> bool:
        hello = channel.expect("hello", self.handshake_timeout_s)
        peer = CacheLayout.from_dict(hello["layout"])
        try:
            if hello["transport"] != self.transport.name:
                raise LayoutMismatch(f"transport differs: {self.transport.name} here, {hello['transport']} on the "
                                     "decode side")
            self.layout.check_matches(peer, "decode side")
        except LayoutMismatch as e:
            channel.send("error", error=f"layout mismatch: {e}")
            return False
        self._peer, self._plan_options = peer, dict(hello.get("plan_options", {}))
        channel.send("hello", layout=self.layout.to_dict(), endpoint=self.transport.endpoint(), pid=os.getpid(),
                     fingerprint=self.layout.fingerprint)
        self.transport.connect(hello["endpoint"], self.handshake_timeout_s)
        return True

    def _loop(self, channel: Channel) -> None:
        while True:
            msg = channel.recv(0.05 if self._waiting else 0.5)
            while msg is not None:
                if msg["op"] == "shutdown":
                    return
                self._handle(channel, msg)
                msg = channel.recv(0.0)
            self._expire_holds()
            self._prefill_waiting(channel)

    def _handle(self, channel: Channel, msg: dict) -> None:
        op = msg["op"]
        if op == "prefill":
            self._waiting.extend(msg["jobs"])
        elif op in ("release", "cancel"):
            self._waiting = deque(j for j in self._waiting if j["id"] != msg["id"])
            if msg["id"] in self._held:
                self._free(msg["id"])
                self.stats.released += 1
        elif op == "stats":
            channel.send("stats", **self.counters())
        else:
            channel.send("error", error=f"unknown message {op!r}")

    def counters(self) -> dict:
        """The server's counters and its free blocks."""
        blocks = self.engine.blocks
        return {**asdict(self.stats), "held": len(self._held), "free_blocks": blocks.num_free,
                "num_blocks": blocks.num_blocks}

    # -- prefill --------------------------------------------------------------------------------

    def _prefill_waiting(self, channel: Channel) -> None:
        """One eager step for as many waiting jobs (in order) as seats and free blocks allow."""
        jobs, blocks = [], self.engine.blocks
        while self._waiting and len(jobs) < self.max_batch:
            job = self._waiting[0]
            problem = self._problem(job)
            if problem:
                self._waiting.popleft()
                self.stats.failed += 1
                channel.send("failed", id=job["id"], error=problem)
                continue
            if not blocks.can_hold(job["id"], len(job["prompt"])):
                break
            blocks.ensure(job["id"], len(job["prompt"]))
            jobs.append(self._waiting.popleft())
        if not jobs:
            return
        start = time.perf_counter()
        entries = [SequenceStep(j["prompt"], 0, blocks.table(j["id"])) for j in jobs]
        logits = self.engine.runner.execute(entries)  # [n, V] float32
        self.stats.prefill_steps += 1
        self.stats.prefill_seconds += time.perf_counter() - start
        for job, row in zip(jobs, logits):
            self._reply(channel, job, row)

    def _problem(self, job: dict) -> Optional[str]:
        need = math.ceil(len(job["prompt"]) / self.engine.block_size)
        if len(job["prompt"]) > self.engine.max_model_len:
            return f"prompt of {len(job['prompt'])} tokens exceeds the prefill side's max_model_len"
        if need > self.engine.num_blocks - 1:
            return f"prompt needs {need} blocks, the prefill side has {self.engine.num_blocks - 1}"
        if len(job["dst_blocks"]) != need:
            return f"dst_blocks has {len(job['dst_blocks'])} ids for a prompt of {need} blocks"
        return None

    def _reply(self, channel: Channel, job: dict, row: torch.Tensor) -> None:
        src = list(self.engine.blocks.table(job["id"]))
        self._held[job["id"]] = time.monotonic() + self.hold_timeout_s
        self.stats.prefilled += 1
        channel.send("prefilled", id=job["id"], src_blocks=src, logits=row.clone())
        if self.transport.pulls:
            return
        plan = plan_transfer(self.layout, self._peer, src, job["dst_blocks"], **self._plan_options)
        try:
            self.transport.send(plan, float(job.get("timeout_s", 30.0)))
        except TransferError as e:
            self.stats.send_errors += 1
            log.warning("prefill server: sending request %r failed: %s", job["id"], e)

    def _expire_holds(self) -> None:
        now = time.monotonic()
        for rid in [r for r, deadline in self._held.items() if deadline < now]:
            log.warning("prefill server: no release for request %r in %g s; freeing its blocks", rid,
                        self.hold_timeout_s)
            self._free(rid)
            self.stats.expired += 1

    def _free(self, rid: object) -> None:
        self._held.pop(rid, None)
        self.engine.blocks.free(rid)


def main(argv: Optional[list[str]] = None) -> int:
    """Serve one decode process: listen, print ``READY <port>``, answer until it shuts us down."""
    from ..models.named import named_model

    p = argparse.ArgumentParser(prog="python -m ascend_graph.pd.prefill", description=__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--transport", default="auto")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--hold-timeout", type=float, default=120.0)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    model, _ = named_model(args.model, getattr(torch, args.dtype) if args.dtype else None)
    server = PrefillServer(model, block_size=args.block_size, num_blocks=args.num_blocks,
                           max_model_len=args.max_model_len, transport=args.transport, host=args.host,
                           max_batch=args.max_batch, hold_timeout_s=args.hold_timeout)
    with listen(args.host, args.port) as listener:
        print(f"{READY} {listener.address[1]}", flush=True)
        server.serve(accept(listener, "decode"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
