"""Greedy speculative decoding with DeepSeek V3's MTP layer (``num_speculative_tokens=1``).

Every step of such an engine returns the MTP layer's draft logits beside the target's
(``DeepseekForCausalLM.step_logits`` with ``drafting`` on): a prefill gives a request its first
token and a draft of the token after it. Each decode step is a verify step: it feeds the
request's last token and its draft as two decode rows (positions p and p + 1, one block table),
so the same captured graphs run it, sized in rows (``verify_config``: 2 rows per request).

Acceptance, on the host from the step's logits: where the target's choice at p equals the draft,
the draft and the target's choice at p + 1 (the bonus token) are kept and the next draft is the
MTP layer's at p + 1; otherwise the target's choice at p alone, and the MTP layer's draft at p.
A rejected draft's cache entries (target and MTP layer, position p + 1) lie past the context:
no step reads them before the next verify step writes that position again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from torch import Tensor

from ..config import GraphConfig
from ..runner.step import SequenceStep
from .sampling import SamplingParams
from .scheduler import append_token

if TYPE_CHECKING:  # pragma: no cover
    from .scheduler import Request, Scheduler
    from .stats import EngineStats

SUPPORTED = (0, 1)  # draft tokens per step this engine runs (the MTP layer once per step)


@dataclass
class SpecStats:
    """Drafts made and accepted, per draft position, and the verify steps that checked them."""

    k: int
    drafted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    verify_steps: int = 0

    def to_dict(self) -> dict:
        accepted = sum(self.accepted_per_position)
        per_position = [round(a / self.verify_rows, 4) if self.verify_rows else 0.0 for a in self.accepted_per_position]
        return {"num_speculative_tokens": self.k, "drafted_tokens": self.drafted, "accepted_tokens": accepted,
                "acceptance_rate": round(accepted / self.drafted, 4) if self.drafted else 0.0,
                "acceptance_rate_per_position": per_position, "verify_steps": self.verify_steps}

    @property
    def verify_rows(self) -> int:
        return self.drafted // self.k


def check_speculation(k: object, model: object, world_size: int) -> int:
    """``num_speculative_tokens`` as an int this engine runs on ``model``, or ``ValueError`` naming it."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"num_speculative_tokens must be an int >= 0, got {k!r}")
    if k == 0:
        return 0
    if k not in SUPPORTED:
        raise ValueError(f"num_speculative_tokens={k}: one draft token per step is supported (1), "
                         "not a chain of several")
    if world_size > 1:
        raise ValueError(f"num_speculative_tokens={k} runs on one process: tensor_parallel_size and "
                         "data_parallel_size must be 1")
    if not len(getattr(model, "mtp", ())):
        raise ValueError(f"num_speculative_tokens={k} needs a model with an MTP layer: load the checkpoint "
                         "with load_deepseek(..., mtp_layers=1) (its config's num_nextn_predict_layers >= 1)")
    return k


def verify_config(config: GraphConfig, k: int) -> GraphConfig:
    """``config``'s capture sizes, counted in requests, as the runner's rows: ``1 + k`` per request."""
    sizes = tuple(s * (1 + k) for s in config.resolved_capture_sizes())
    return dataclasses.replace(config, capture_sizes=sizes, max_batch_size=sizes[-1])


def speculation(k: object, model, parallel, config: GraphConfig) -> tuple[Optional["Speculation"], GraphConfig]:
    """An engine's ``Speculation`` for ``num_speculative_tokens=k`` (None for 0) and its runner's
    graph config (``verify_config``); turns the model's drafting on. ``ValueError`` naming ``k``."""
    k = check_speculation(k, model, parallel.world_size)
    if not k:
        if getattr(model, "drafting", False):  # another engine's: this one's logits would be twice as wide
            raise ValueError("num_speculative_tokens=0 on a model that drafts for an engine with "
                             "num_speculative_tokens=1: give this engine the same setting or its own model")
        return None, config
    model.drafting = True  # every step also drafts
    return Speculation(k, model.config.vocab_size), verify_config(config, k)


class Speculation:
    """An engine's draft-and-verify decoding: the verify step's entries and the greedy acceptance."""

    def __init__(self, k: int, vocab_size: int) -> None:
        self.k, self.vocab = k, vocab_size
        self.stats = SpecStats(k, accepted_per_position=[0] * k)

    def check_greedy(self, params: SamplingParams) -> None:
        """A draft is accepted where it is the target's greedy choice: sampling is refused."""
        if not params.greedy:
            raise ValueError(f"num_speculative_tokens={self.k} decodes greedily: temperature must be 0, "
                             f"got {params.temperature}")

    def decode_entries(self, scheduler: "Scheduler", batch: list["Request"]) -> list[SequenceStep]:
        """Per request: its last token, then its draft, each a decode row."""
        out = []
        for r in batch:
            table, p = scheduler.blocks.table(r.seq_id), r.num_tokens - 1
            out += [SequenceStep(r.output[-1:], p, table), SequenceStep([r.draft], p + 1, table)]
        return out

    def advance(self, scheduler: "Scheduler", batch: list["Request"], logits: Tensor, prefill: bool,
                stops: frozenset[int], counters: "EngineStats") -> int:
        """Keep each request's accepted tokens (from its rows of ``logits [rows, 2V]``), store its
        next draft, finish requests that stop; returns the progress count as ``Engine._advance``
        does. ``counters`` gains the tokens beyond one per request."""
        target, drafts = logits[:, :self.vocab], logits[:, self.vocab:].argmax(-1).tolist()
        choice = target.argmax(-1).tolist()
        rows = 1 if prefill else 1 + self.k
        done, extra = 0, 0
        for i, request in enumerate(batch):
            r = i * rows
            keep = [r]
            if not prefill:
                self.stats.drafted += self.k
                if choice[r] == request.draft:
                    self.stats.accepted_per_position[0] += 1
                    keep.append(r + 1)
            request.draft = drafts[keep[-1]]
            for j, row in enumerate(keep):
                extra += j > 0
                done += append_token(scheduler, request, choice[row], target[row], stops)
                if request.finished:
                    break
        if not prefill:
            self.stats.verify_steps += 1
            counters.generated_tokens += extra
            counters.decode_tokens += extra
        return done
