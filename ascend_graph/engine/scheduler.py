"""Continuous batching: which requests run, when waiting ones join, and their cache blocks.

Admission is first come, first served: the request at the head of the queue joins when fewer
than ``max_num_seqs`` requests run and the free blocks hold its whole prompt plus
``max_new_tokens``. Its blocks are reserved at admission, so a running request never waits for
memory and nothing is ever preempted. A finished request leaves at once and frees its blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Optional

from torch import Tensor

from .block_manager import BlockManager
from ..runner.step import SequenceStep


@dataclass
class Request:
    """One prompt being served: its tokens so far and, optionally, the logits that chose them."""

    index: int  # position in the caller's list
    seq_id: int  # unique within the engine (the block manager's key)
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    logits: Optional[list[Tensor]] = None  # per generated token, [V] float32, when kept
    finished: bool = False
    lookahead: int = 0  # cache slots past its last token a step may write (speculative drafts)
    drafts: list[int] = field(default_factory=list)  # speculative decoding: the next tokens drafted

    @property
    def reserved_tokens(self) -> int:
        """Tokens its blocks are reserved for: the prompt, every token it may generate, its lookahead."""
        return len(self.prompt) + self.max_new_tokens + self.lookahead

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt) + len(self.output)


class Scheduler:
    """The waiting queue and the running set of one ``generate`` call, over the engine's blocks."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, requests: Iterable[Request]) -> None:
        """Queue ``requests`` in order."""
        self.waiting.extend(requests)

    @property
    def has_work(self) -> bool:
        """Whether any request waits or runs."""
        return bool(self.waiting or self.running)

    def admit(self) -> list[Request]:
        """Move waiting requests into the running set while seats and blocks allow (in order)."""
        admitted = []
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            if not self.blocks.can_hold(head.seq_id, head.reserved_tokens):
                break
            self.blocks.ensure(head.seq_id, head.reserved_tokens)
            self.running.append(self.waiting.popleft())
            admitted.append(head)
        if not admitted and not self.running and self.waiting:
            head = self.waiting[0]
            raise RuntimeError(f"request {head.index} cannot be admitted into an idle engine: it needs "
                               f"{self.blocks.blocks_needed(head.seq_id, head.reserved_tokens)} blocks, "
                               f"{self.blocks.num_free} are free")
        return admitted

    def decoding(self) -> list[Request]:
        """Running requests that have been prefilled and still generate."""
        return [r for r in self.running if r.output and not r.finished]

    def finish(self, request: Request) -> None:
        """Mark ``request`` done, take it out of the running set and free its blocks."""
        request.finished = True
        self.running.remove(request)
        self.blocks.free(request.seq_id)

    def release_all(self) -> None:
        """Free the blocks of every running request and drop the queue (after an error)."""
        for request in self.running:
            self.blocks.free(request.seq_id)
        self.running.clear()
        self.waiting.clear()

    def prefill_entries(self, requests: list[Request]) -> list[SequenceStep]:
        """The step entries that write ``requests``' prompts into their blocks."""
        return [SequenceStep(r.prompt, 0, self.blocks.table(r.seq_id)) for r in requests]

    def decode_entries(self, requests: list[Request]) -> list[SequenceStep]:
        """The step entries that feed each request's last generated token."""
        return [SequenceStep(r.output[-1:], r.num_tokens - 1, self.blocks.table(r.seq_id)) for r in requests]


def append_token(scheduler: Scheduler, request: Request, token: int, row: Tensor, stops: frozenset[int]) -> int:
    """Append ``token`` (chosen from logits ``row [V]``) to ``request``, finishing it at a stop
    token or at its budget; returns the progress count: 1, plus the budget a stop leaves unused."""
    request.output.append(token)
    if request.logits is not None:
        request.logits.append(row.float().cpu())
    if token in stops or len(request.output) == request.max_new_tokens:
        scheduler.finish(request)
        return 1 + request.max_new_tokens - len(request.output)
    return 1
