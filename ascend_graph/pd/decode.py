"""The decode role: an ``Engine`` whose prompts are prefilled in another process.

``DecodeEngine`` registers its runner's tuple caches with the transport when it is built, before
any graph is captured, so the blocks land in the very tensors the graphs take as static inputs.
Per request: the scheduler reserves its blocks here (prompt + ``max_new_tokens``); the prefill
side gets the prompt and the prompt's block ids; on its ``prefilled`` reply the transport moves
the prompt's blocks into ours, the prefill side is told to release its copy, and the first token
is sampled from the logits it sent (the same per-request generator as a single-process
``Engine``); the request then joins the decode batch.

The fence: the prefill side leases a request's blocks until our ``release`` or its
``hold_timeout_s``; expired blocks may hold another request's data. Pulled blocks are used only
when the pull provably ended inside the lease: either before ``LEASE_SAFETY`` of ``lease_s``
(which the ``prefilled`` message states) had passed since we sent the job, as the lease began
after that, or once the prefill side answers the release with ``held``. An expired lease
(``held`` false) discards the data: the request is recomputed (``leases_expired`` counts it).

A request whose prefill or transfer fails (the prefill process died, missed ``prefill_timeout_s``
or refused, a batch failed or missed ``transfer_timeout_s``) is recomputed here by an eager
prefill (``on_transfer_error="recompute"``) or ends with an error in ``failures``
(``"fail"``); either way its prefill-side blocks are released and other requests go on. Blocks an
abandoned transfer may still write to are held back until the transport has settled.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional, Union

from torch import nn

from ..engine.engine import Engine
from ..engine.scheduler import Request, Scheduler
from .auth import secret_from
from .control import Channel, PeerLost, WireError, connect
from .identity import model_identity
from .layout import (DEFAULT_MAX_DESCRIPTORS, REGISTRATION_ALIGN, CacheLayout, LayoutMismatch, check_drafting,
                     plan_transfer)
from .process import PrefillProcess
from .select import open_transport
from .transport import TransferError

log = logging.getLogger(__name__)
ON_ERROR = ("recompute", "fail")
LEASE_SAFETY = 0.9  # a pull that ends within this share of the lease since the job was sent is inside it


@dataclass
class TransferStats:
    """What moved from the prefill side, what failed, and how long first tokens took."""

    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0
    descriptors: int = 0
    batches: int = 0
    recomputed: int = 0
    failed_requests: int = 0
    leases_expired: int = 0  # pulls discarded: the prefill side's lease had expired (the fence)
    refused_messages: int = 0  # messages from the prefill side that broke the schema
    errors: Counter = field(default_factory=Counter)  # reason -> count
    ttft_seconds: list = field(default_factory=list)  # per request: admitted -> first token

    def to_dict(self) -> dict:
        rate = self.bytes / self.seconds / 2**30 if self.seconds else 0.0
        ttft = sorted(self.ttft_seconds)
        return {"transfers": self.transfers, "bytes": self.bytes, "seconds": round(self.seconds, 6),
                "gib_per_s": round(rate, 3), "descriptors": self.descriptors, "batches": self.batches,
                "recomputed": self.recomputed, "failed_requests": self.failed_requests,
                "leases_expired": self.leases_expired, "refused_messages": self.refused_messages,
                "errors": dict(self.errors), "ttft_mean_s": round(statistics.fmean(ttft), 6) if ttft else None,
                "ttft_max_s": round(ttft[-1], 6) if ttft else None}


class DecodeEngine(Engine):
    """Graph-mode decode over static tuple caches, prompts prefilled by a ``PrefillServer``.

    - ``prefill``: a started ``PrefillProcess`` (whose ``kill``/``suspend`` the fault hooks use,
      and whose per-run secret authenticates the channel) or the ``(host, port)`` of a server
      started elsewhere, with ``secret`` (else ``$ASCEND_GRAPH_PD_SECRET``; no default).
    - ``transport``: ``auto`` / ``mooncake`` / ``gloo`` (the same on both sides; checked at handshake).
    - ``on_transfer_error``: ``recompute`` (eager prefill here) or ``fail`` (see ``failures``).
    - ``max_descriptors`` / ``max_batch_bytes``: how plans are batched (``layout.plan_transfer``).
    - ``kill_prefill_after``: fault injection; kills the prefill process in the middle of the
      transfer after that many requests have landed (needs a ``PrefillProcess``).
    Other keyword arguments go to ``Engine``; its caches start ``REGISTRATION_ALIGN``-aligned
    unless ``cache_align_bytes`` says otherwise. Layouts that differ raise ``LayoutMismatch``.
    """

    def __init__(self, model: nn.Module, prefill: Union[PrefillProcess, tuple[str, int]], *,
                 transport: str = "auto", on_transfer_error: str = "recompute", prefill_timeout_s: float = 60.0,
                 transfer_timeout_s: float = 30.0, connect_timeout_s: float = 60.0,
                 max_descriptors: int = DEFAULT_MAX_DESCRIPTORS, max_batch_bytes: Optional[int] = None,
                 kill_prefill_after: Optional[int] = None, secret: Optional[bytes] = None, **engine_kwargs) -> None:
        if on_transfer_error not in ON_ERROR:
            raise ValueError(f"on_transfer_error must be one of {', '.join(ON_ERROR)}, got {on_transfer_error!r}")
        if kill_prefill_after is not None and not isinstance(prefill, PrefillProcess):
            raise ValueError("kill_prefill_after needs prefill to be a PrefillProcess (it kills that process)")
        if isinstance(prefill, PrefillProcess):
            if secret is not None:
                raise ValueError("secret: a PrefillProcess brings its own secret; pass secret only with (host, port)")
            secret = prefill.secret
        else:
            secret = secret_from(secret, what="pass secret=... (the prefill server's, given to it with --secret-file)")
        engine_kwargs.setdefault("cache_align_bytes", REGISTRATION_ALIGN)
        super().__init__(model, **engine_kwargs)
        self.on_transfer_error = on_transfer_error
        self.prefill_timeout_s = prefill_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.kill_prefill_after = kill_prefill_after
        self.plan_options = {"max_descriptors": max_descriptors, "max_batch_bytes": max_batch_bytes}
        self.transfer = TransferStats()
        self.failures: dict[int, str] = {}  # request index -> why it failed, for the last generate call
        self._process = prefill if isinstance(prefill, PrefillProcess) else None
        self._transport = open_transport(transport, "destination")
        self.layout = self._transport.register(self.runner.kv_caches).with_identity(model_identity(model))
        address = prefill.address if self._process else prefill
        self._channel: Optional[Channel] = None
        self._quarantine: list[object] = []
        self._quarantine_ids = itertools.count()
        self._pending: dict[int, tuple[Request, float]] = {}  # seq_id -> (request, admitted at)
        self._confirming: dict[int, tuple[object, float]] = {}  # pulled, awaiting "released": (logits, start)
        try:
            self._channel = connect(address, secret, connect_timeout_s)
            self.peer_layout = self._handshake(connect_timeout_s)
        except BaseException:
            self.close()
            raise

    def _handshake(self, timeout_s: float) -> CacheLayout:
        ours = self.spec.k if self.spec else 0
        self._channel.send("hello", layout=self.layout.to_dict(), endpoint=self._transport.endpoint(),
                           transport=self._transport.name, plan_options=self.plan_options, drafting=ours)
        reply = self._channel.recv(timeout_s)
        if reply is None:
            raise TimeoutError(f"the prefill process did not answer the handshake within {timeout_s:g} s")
        if reply["op"] == "error":
            raise LayoutMismatch(f"the prefill process refused the handshake: {reply['error']}")
        if reply["op"] != "hello":
            raise RuntimeError(f"the prefill process answered the handshake with {reply['op']!r}")
        peer = CacheLayout.from_dict(reply["layout"])
        self.layout.check_matches(peer, "prefill side")
        check_drafting(ours, reply.get("drafting", 0), "prefill side")
        try:
            self._transport.connect(reply["endpoint"], timeout_s)
        except (KeyError, TypeError) as e:
            raise LayoutMismatch(f"malformed transport endpoint from the prefill side: {e!r}") from None
        return peer

    @property
    def stats(self) -> dict:
        """``Engine.stats`` plus ``transfer`` (``TransferStats``)."""
        return {**super().stats, "transfer": self.transfer.to_dict()}

    def prefill_counters(self, timeout_s: float = 10.0) -> Optional[dict]:
        """The prefill server's counters (free blocks, held, released); ``None`` when it is gone."""
        if self._channel is None:
            return None
        try:
            self._channel.send("stats")
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                try:
                    msg = self._channel.recv(deadline - time.monotonic())
                except WireError:
                    self.transfer.refused_messages += 1
                    continue
                if msg is not None and msg["op"] == "stats":
                    return dict(msg["counters"])
                if msg is not None:
                    self._stray(msg)
        except PeerLost:
            self._lost()
        return None

    def close(self) -> None:
        """Tell the prefill server to stop and release the transport (idempotent)."""
        if self._channel is not None:
            try:
                self._channel.send("shutdown")
            except PeerLost:
                pass
            self._channel.close()
            self._channel = None
        self._drain_quarantine(self.transfer_timeout_s + 10.0)
        self._transport.close()

    # -- the serving loop -----------------------------------------------------------------------

    def _serve(self, requests, sampler, stops, step, show_progress) -> None:
        self.failures = {}
        scheduler = Scheduler(self.blocks, self.max_num_seqs)
        scheduler.add(requests)
        self.counters.requests += len(requests)
        self.counters.prompt_tokens += sum(len(r.prompt) for r in requests)
        try:
            while scheduler.has_work:
                admitted = scheduler.admit()
                if admitted:
                    self._dispatch(scheduler, admitted, sampler, stops, step)
                batch = scheduler.decoding()
                self._collect(scheduler, sampler, stops, step, wait_s=0.0 if batch else 0.05)
                batch = scheduler.decoding()
                if batch:
                    self._step(scheduler, batch, False, sampler, stops, step)
                self._release_settled()
        finally:
            for seq_id in list(self._pending):
                self._tell("cancel", seq_id)
            self._pending.clear()
            self._confirming.clear()
            scheduler.release_all()
            self._drain_quarantine(self.transfer_timeout_s + 10.0)

    def _dispatch(self, scheduler: Scheduler, admitted: list[Request], sampler, stops, step) -> None:
        now = time.monotonic()
        jobs = [{"id": r.seq_id, "prompt": [int(t) for t in r.prompt], "dst_blocks": self._prompt_blocks(r),
                 "timeout_s": self.transfer_timeout_s} for r in admitted]
        for r in admitted:
            self._pending[r.seq_id] = (r, now)
        try:
            if self._channel is None:
                raise PeerLost("the prefill process is gone")
            self._channel.send("prefill", jobs=jobs)
        except PeerLost as e:
            self._lost()
            for r in admitted:
                self._give_up(scheduler, r, f"prefill unavailable: {e}", sampler, stops, step)

    def _collect(self, scheduler: Scheduler, sampler, stops, step, wait_s: float) -> None:
        """Handle every message the prefill side has sent (waiting up to ``wait_s`` for the first)."""
        try:
            timeout = wait_s
            while self._channel is not None and self._pending:
                try:
                    msg = self._channel.recv(timeout)
                except WireError as e:  # dropped; its request, if any, runs into its deadline
                    self.transfer.refused_messages += 1
                    log.warning("decode engine: refused a message from the prefill side: %s", e)
                    continue
                if msg is None:
                    break
                timeout = 0.0
                self._on_message(scheduler, msg, sampler, stops, step)
        except PeerLost:
            self._lost()
        if self._channel is None:
            for r, _ in list(self._pending.values()):
                self._give_up(scheduler, r, "the prefill process is gone before the request's blocks were confirmed",
                              sampler, stops, step)
        now = time.monotonic()
        for r, admitted_at in list(self._pending.values()):
            if now - admitted_at > self.prefill_timeout_s:
                self._tell("cancel", r.seq_id)
                self._give_up(scheduler, r, f"no prefill reply within {self.prefill_timeout_s:g} s", sampler,
                              stops, step)

    def _on_message(self, scheduler: Scheduler, msg: dict, sampler, stops, step) -> None:
        entry = self._pending.get(msg.get("id"))
        if entry is None:
            return self._stray(msg)
        request, admitted_at = entry
        if msg["op"] == "released":
            return self._on_released(scheduler, request, msg["held"], sampler, stops, step)
        if msg["op"] == "failed":
            return self._give_up(scheduler, request, f"the prefill side refused it: {msg['error']}", sampler,
                                 stops, step)
        if msg["op"] != "prefilled" or request.seq_id in self._confirming:
            return self._stray(msg)
        start = time.perf_counter()
        logits, width = msg["logits"], self._row_width()
        try:
            if tuple(logits.shape) != (width,) or not logits.is_floating_point():
                raise ValueError(f"logits of shape {tuple(logits.shape)} and dtype {logits.dtype}, expected "
                                 f"[{width}] floats")
            self._receive(msg["src_blocks"], request)
        except (TransferError, ValueError) as e:
            self._tell("release", request.seq_id)
            return self._give_up(scheduler, request, f"transfer failed: {e}", sampler, stops, step,
                                 in_flight=getattr(e, "in_flight", False))
        self._tell("release", request.seq_id)
        if time.monotonic() < admitted_at + LEASE_SAFETY * msg["lease_s"]:  # the lease began after admitted_at
            return self._first_token(scheduler, request, logits.unsqueeze(0), sampler, stops, start, prefill=False)
        self._confirming[request.seq_id] = (logits, start)  # the pull may have outlived the lease: ask

    def _on_released(self, scheduler: Scheduler, request: Request, held: bool, sampler, stops, step) -> None:
        """The prefill side's answer to our release of a pull that waits for it (the fence)."""
        entry = self._confirming.pop(request.seq_id, None)
        if entry is None:
            return None  # used already (it ended well inside the lease) or given up
        logits, start = entry
        if held:
            return self._first_token(scheduler, request, logits.unsqueeze(0), sampler, stops, start, prefill=False)
        self.transfer.leases_expired += 1
        self._give_up(scheduler, request, "lease expired: the prefill side freed the blocks before the pull was "
                      "confirmed; the data read is discarded", sampler, stops, step)

    def _receive(self, src_blocks: list[int], request: Request) -> None:
        """Pull ``src_blocks`` into the request's prompt blocks; ``ValueError`` for bad block ids
        (nothing read), ``TransferError`` from the transport."""
        plan = plan_transfer(self.peer_layout, self.layout, src_blocks, self._prompt_blocks(request),
                             **self.plan_options)
        if self.kill_prefill_after is not None and self.transfer.transfers >= self.kill_prefill_after:
            self._transport.after_batch = lambda i: self._process.kill() if i == 0 else None
        start = time.perf_counter()
        try:
            self._transport.receive(plan, self.transfer_timeout_s)
        finally:
            self._transport.after_batch = None
        t = self.transfer
        t.transfers, t.bytes = t.transfers + 1, t.bytes + plan.num_bytes
        t.seconds += time.perf_counter() - start
        t.descriptors, t.batches = t.descriptors + plan.num_descriptors, t.batches + len(plan.batches)

    def _first_token(self, scheduler: Scheduler, request: Request, logits, sampler, stops, start: float,
                     prefill: bool) -> None:
        entry = self._pending.pop(request.seq_id, None)
        self._confirming.pop(request.seq_id, None)
        if entry is not None:
            self.transfer.ttft_seconds.append(time.monotonic() - entry[1])
        if prefill:  # recomputed here: an eager prefill step of our own
            self._step(scheduler, [request], True, sampler, stops, lambda plan, batches: [self.runner.execute(plan[0])])
        elif self.spec is not None:  # its first token and draft; a chain (k > 1) drafts on from our MTP cache
            self.spec.advance(scheduler, [request], logits, True, stops, self.counters)
            self._count(1, True, time.perf_counter() - start)
        else:
            self._advance(scheduler, [request], logits, True, sampler, stops, start)

    def _row_width(self) -> int:
        """A prefilled row's width: the logits, and with speculation the draft's (and at k > 1 the hidden states)."""
        c, k = self.model.config, self.spec.k if self.spec else 0
        return c.vocab_size * (1 + (k > 0)) + c.hidden_size * (k > 1)

    def _give_up(self, scheduler: Scheduler, request: Request, reason: str, sampler, stops, step,
                 in_flight: bool = False) -> None:
        self.transfer.errors[reason.split(":")[0]] += 1
        if in_flight:  # an abandoned batch may still land in these blocks: keep them out of use
            key = ("quarantine", next(self._quarantine_ids))
            self.blocks.rename(request.seq_id, key)
            self._quarantine.append(key)
        if self.on_transfer_error == "recompute" and self.blocks.can_hold(request.seq_id, request.reserved_tokens):
            self.blocks.ensure(request.seq_id, request.reserved_tokens)
            self.transfer.recomputed += 1
            self._first_token(scheduler, request, None, sampler, stops, time.perf_counter(), prefill=True)
            return
        self._pending.pop(request.seq_id, None)
        self._confirming.pop(request.seq_id, None)
        self.transfer.failed_requests += 1
        self.failures[request.index] = reason
        scheduler.finish(request)

    # -- helpers ---------------------------------------------------------------------------------

    def _prompt_blocks(self, request: Request) -> list[int]:
        need = -(-len(request.prompt) // self.block_size)
        return list(self.blocks.table(request.seq_id)[:need])

    def _tell(self, op: str, seq_id: int) -> None:
        if self._channel is None:
            return
        try:
            self._channel.send(op, id=seq_id)
        except PeerLost:
            self._lost()

    def _stray(self, msg: dict) -> None:
        """A reply for a request given up already: let the prefill side free its blocks. An ``error``
        (the prefill side refused one of our messages) is logged and counted."""
        if msg.get("op") == "prefilled":
            self._tell("release", msg["id"])
        elif msg.get("op") == "error":
            self.transfer.errors["the prefill side refused a message"] += 1
            log.warning("decode engine: the prefill side refused a message: %s", msg["error"])

    def _lost(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _release_settled(self) -> None:
        if self._quarantine and self._transport.settled():
            for key in self._quarantine:
                self.blocks.free(key)
            self._quarantine.clear()

    def _drain_quarantine(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._quarantine and time.monotonic() < deadline:
            self._release_settled()
            time.sleep(0.05)
