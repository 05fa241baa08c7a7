"""The prefill role: eager prefill on its own tuple caches, blocks held until the decode side confirms.

``PrefillServer.serve(channel)`` answers one decode process: the handshake (both layouts must
match, ``layout.CacheLayout.check_matches``), then ``prefill`` jobs (prompt + the decode side's
block ids) batched into one eager step per round as far as free blocks allow. For each job it
sends ``prefilled`` (its own block ids and the last token's logits) and then the transport's
source side of the plan. A job's blocks are leased to the decode side until its ``release`` (the
decode side has read them, or gave up), or until ``hold_timeout_s`` passes without one (counted
in ``expired``). The answer to a release, ``released`` with ``held``, says whether the lease was
still held: only then may the decode side use what it read, since expired blocks may already
hold another request's data (the fence; one thread handles both, so the answer is exact).

Run as a process: ``python -m ascend_graph.pd.prefill --model small --port 0 --secret-file PATH``
prints ``READY <port>`` once listening; the decode side must hold the same secret (``pd/auth.py``).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import select
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
from .auth import SECRET_ENV, check_secret, secret_from
from .control import Channel, PeerLost, WireError, accept, listen
from .identity import model_identity
from .layout import REGISTRATION_ALIGN, CacheLayout, LayoutMismatch, check_drafting, plan_transfer
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
    expired: int = 0  # leases freed because no release came in time
    late_releases: int = 0  # releases answered held=False: the lease had expired
    refused_messages: int = 0  # malformed, oversized or undeclared messages (answered with an error)
    refused_connections: int = 0  # connections that failed the challenge before the decode side's
    send_errors: int = 0
    prefill_seconds: float = 0.0


class PrefillServer:
    """Eager prefill over ``model`` with ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, model: nn.Module, *, block_size: int, num_blocks: int, max_model_len: int,
                 transport: str = "auto", host: str = "127.0.0.1", max_batch: int = 8,
                 hold_timeout_s: float = 120.0, handshake_timeout_s: float = 60.0,
                 num_speculative_tokens: int = 0) -> None:
        for name, value in (("hold_timeout_s", hold_timeout_s), ("handshake_timeout_s", handshake_timeout_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        self.engine = Engine(model, graph_config=GraphConfig(enabled=False), block_size=block_size,
                             num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=max_batch,
                             cache_align_bytes=REGISTRATION_ALIGN, num_speculative_tokens=num_speculative_tokens)
        self.transport = open_transport(transport, "source", host)
        self.layout = self.transport.register(self.engine.runner.kv_caches).with_identity(model_identity(model))
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
        except (PeerLost, TimeoutError) as e:
            log.warning("prefill server: %s; freeing every held block", e)
        finally:
            for rid in list(self._held):
                self._free(rid)
            self.transport.close()

    # -- protocol -----------------------------------------------------------------------------

    def _handshake(self, channel: Channel) -> bool:
        deadline = time.monotonic() + self.handshake_timeout_s
        while True:  # a refused message is answered and the wait goes on, to the deadline
            try:
                hello = channel.expect("hello", max(0.0, deadline - time.monotonic()))
                break
            except (WireError, RuntimeError) as e:
                self.stats.refused_messages += 1
                channel.send("error", error=f"message refused: {e}")
        try:
            peer = CacheLayout.from_dict(hello["layout"])
            if hello["transport"] != self.transport.name:
                raise LayoutMismatch(f"transport differs: {self.transport.name} here, {hello['transport']} on the "
                                     "decode side")
            self.layout.check_matches(peer, "decode side")
            check_drafting(self.engine.spec.k if self.engine.spec else 0, hello.get("drafting", 0), "decode side")
            options = dict(hello.get("plan_options") or {})
            plan_transfer(self.layout, peer, [1], [1], **options)  # the options hold (ValueError names them)
        except ValueError as e:  # LayoutMismatch too
            channel.send("error", error=f"handshake refused: {e}")
            return False
        self._peer, self._plan_options = peer, options
        channel.send("hello", layout=self.layout.to_dict(), endpoint=self.transport.endpoint(), pid=os.getpid(),
                     fingerprint=self.layout.fingerprint, drafting=self.engine.spec.k if self.engine.spec else 0)
        self.transport.connect(hello["endpoint"], self.handshake_timeout_s)
        return True

    def _loop(self, channel: Channel) -> None:
        timeout = 0.05 if self._waiting else 0.5
        while True:
            try:
                msg = channel.recv(timeout)
            except WireError as e:  # refused; the link and the server go on
                self.stats.refused_messages += 1
                log.warning("prefill server: refused a message from the decode side: %s", e)
                channel.send("error", error=f"message refused: {e}")
                timeout = 0.0
                continue
            if msg is not None:
                if msg["op"] == "shutdown":
                    return
                self._handle(channel, msg)
                timeout = 0.0
                continue
            self._expire_holds()
            self._prefill_waiting(channel)
            timeout = 0.05 if self._waiting else 0.5

    def _handle(self, channel: Channel, msg: dict) -> None:
        op = msg["op"]
        if op == "prefill":
            self._waiting.extend(msg["jobs"])
        elif op in ("release", "cancel"):
            self._waiting = deque(j for j in self._waiting if j["id"] != msg["id"])
            held = msg["id"] in self._held  # the fence: one thread expires and releases
            if held:
                self._free(msg["id"])
                self.stats.released += 1
            if op == "release":
                self.stats.late_releases += not held
                channel.send("released", id=msg["id"], held=held)
        elif op == "stats":
            channel.send("stats", counters=self.counters())
        else:  # the schema admits no other op; a new one must be handled here
            channel.send("error", error=f"op {op!r} is declared but not handled")

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
            problem = self._problem(job, set(self._held) | {j["id"] for j in jobs})
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
        logits = self.engine.runner.execute(entries)  # [n, V] float32 (drafting: the MTP draft too)
        self.stats.prefill_steps += 1
        self.stats.prefill_seconds += time.perf_counter() - start
        for job, row in zip(jobs, logits):
            self._reply(channel, job, row)

    def _problem(self, job: dict, taken: set) -> Optional[str]:
        need = math.ceil(len(job["prompt"]) / self.engine.block_size)
        vocab = self.engine.runner.model.config.vocab_size
        if not job["prompt"]:
            return "prompt is empty"
        if any(not 0 <= t < vocab for t in job["prompt"]):
            return f"prompt has token ids outside [0, {vocab})"
        if job["id"] in taken:
            return f"id {job['id']} is in use already"
        if not job["timeout_s"] > 0:
            return f"timeout_s must be > 0, got {job['timeout_s']}"
        if len(job["prompt"]) > self.engine.max_model_len:
            return f"prompt of {len(job['prompt'])} tokens exceeds the prefill side's max_model_len"
        if need > self.engine.num_blocks - 1:
            return f"prompt needs {need} blocks, the prefill side has {self.engine.num_blocks - 1}"
        if len(job["dst_blocks"]) != need:
            return f"dst_blocks has {len(job['dst_blocks'])} ids for a prompt of {need} blocks"
        return None

    def _reply(self, channel: Channel, job: dict, row: torch.Tensor) -> None:
        src = list(self.engine.blocks.table(job["id"]))
        plan = None
        if not self.transport.pulls:  # we push: the plan must hold before we promise anything
            try:
                plan = plan_transfer(self.layout, self._peer, src, job["dst_blocks"], **self._plan_options)
            except ValueError as e:
                self.engine.blocks.free(job["id"])
                self.stats.failed += 1
                channel.send("failed", id=job["id"], error=f"no transfer plan: {e}")
                return
        self._held[job["id"]] = time.monotonic() + self.hold_timeout_s
        self.stats.prefilled += 1
        channel.send("prefilled", id=job["id"], src_blocks=src, logits=row, lease_s=self.hold_timeout_s)
        if plan is None:
            return
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

    p = argparse.ArgumentParser(prog="python -m ascend_graph.pd.prefill", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--transport", default="auto")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--hold-timeout", type=float, default=120.0)
    p.add_argument("--accept-timeout", type=float, default=600.0,
                   help="seconds to wait for the decode side to connect and pass the challenge")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="draft with the model's MTP layer (its cache moves with the target's) for a decode side "
                        "with the same setting")
    secret = p.add_mutually_exclusive_group()
    secret.add_argument("--secret-file", default=None, metavar="PATH",
                        help=f"a file holding the shared secret (else ${SECRET_ENV}); the decode side uses the same")
    secret.add_argument("--secret-stdin", action="store_true",
                        help="read the secret from the first line of stdin (how PrefillProcess hands over its own)")
    args = p.parse_args(argv)
    for name in ("hold_timeout", "accept_timeout"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    try:
        key = _stdin_secret() if args.secret_stdin else secret_from(
            secret_file=args.secret_file, what="give --secret-file PATH or --secret-stdin")
    except ValueError as e:
        p.error(str(e))
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    k = args.num_speculative_tokens
    model, _ = named_model(args.model, getattr(torch, args.dtype) if args.dtype else None, mtp_layers=min(k, 1))
    server = PrefillServer(model, block_size=args.block_size, num_blocks=args.num_blocks,
                           max_model_len=args.max_model_len, transport=args.transport, host=args.host,
                           max_batch=args.max_batch, hold_timeout_s=args.hold_timeout, num_speculative_tokens=k)
    with listen(key, args.host, args.port) as listener:
        print(f"{READY} {listener.address[1]}", flush=True)
        try:
            channel = accept(listener, args.accept_timeout)
        except TimeoutError as e:
            server.transport.close()
            print(f"prefill server: {e}", file=sys.stderr)
            return 1
        server.stats.refused_connections = listener.refused
        server.serve(channel)
    return 0


def _stdin_secret(timeout_s: float = 60.0) -> bytes:
    """The secret, hex-encoded on the first line of stdin, within ``timeout_s`` (the parent writes it at once)."""
    ready, _, _ = select.select([sys.stdin.buffer], [], [], timeout_s)
    line = sys.stdin.buffer.readline(1 << 12) if ready else b""
    try:
        secret = bytes.fromhex(line.strip().decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        raise ValueError("--secret-stdin: the first line of stdin is not a hex-encoded secret") from None
    return check_secret(secret, "the secret on stdin (--secret-stdin)")


if __name__ == "__main__":
    sys.exit(main())
