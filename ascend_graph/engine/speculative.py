"""Greedy speculative decoding with DeepSeek V3's MTP layer (``num_speculative_tokens=k``).

Every step of such an engine returns the MTP layer's draft logits beside the target's
(``DeepseekForCausalLM.step_logits`` with ``drafting = k``): a prefill gives a request its first
token and a first draft of the token after it. Each decode step is a verify step: it feeds the
request's last token and its k drafts as 1 + k decode rows (positions p .. p + k, one block
table), so the same captured graphs run it, sized in rows (``verify_config``).

Acceptance, on the host from the step's logits: drafts are kept while each equals the target's
choice at the row before it (a drafts), then the target's choice at row a (the bonus token). The
MTP layer's draft at row a is the next first draft; with k > 1 a draft chain continues from it
(``runner.draft_chain``): k - 1 steps of the MTP layer alone, one row per request, each from the
previous draft and the MTP output hidden states that drafted it (row a's, then the chain's), at
positions q, q + 1, .. (q the new last token's), as vLLM's MTP proposer chains its one layer.
Entries of rejected rows and of the chain (target and MTP caches, past the new last token) lie
past the context: the next verify step writes every one of them again before any step reads it.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Optional

from torch import Tensor

from ..config import GraphConfig
from ..runner.draft_chain import DraftChain
from ..runner.step import SequenceStep
from .sampling import SamplingParams
from .scheduler import append_token

if TYPE_CHECKING:  # pragma: no cover
    from ..runner import GraphRunner
    from ..runner.parity import ParityReport
    from .scheduler import Request, Scheduler
    from .stats import EngineStats


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
    if world_size > 1:
        raise ValueError(f"num_speculative_tokens={k} runs on one process: tensor_parallel_size and "
                         "data_parallel_size must be 1")
    if not len(getattr(model, "mtp", ())):
        raise ValueError(f"num_speculative_tokens={k} needs a model with an MTP layer: load the checkpoint "
                         "with load_deepseek(..., mtp_layers=1) (its config's num_nextn_predict_layers >= 1)")
    drafting = getattr(model, "drafting", 0)
    if drafting and drafting != k:  # another engine's: this one's logits would be another width
        raise ValueError(f"num_speculative_tokens={k} on a model that drafts for an engine with "
                         f"num_speculative_tokens={drafting}: give this engine the same setting or its own model")
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
        if getattr(model, "drafting", 0):  # another engine's: this one's logits would be wider
            raise ValueError("num_speculative_tokens=0 on a model that drafts for an engine with "
                             f"num_speculative_tokens={model.drafting}: give this engine the same setting "
                             "or its own model")
        return None, config
    model.drafting = k  # every step also drafts
    return Speculation(k, model.config.vocab_size, config.resolved_capture_sizes()), verify_config(config, k)


class Speculation:
    """An engine's draft-and-verify decoding: the verify step's entries, the greedy acceptance and
    the draft chain (k > 1) on the engine's runner (``attach``)."""

    def __init__(self, k: int, vocab_size: int, capture_sizes: tuple[int, ...]) -> None:
        self.k, self.vocab, self.capture_sizes = k, vocab_size, capture_sizes
        self.stats = SpecStats(k, accepted_per_position=[0] * k)
        self.chain: Optional[DraftChain] = None
        self._on_report = None  # generate_checked: (report, request indices) of each checked chain step

    def attach(self, runner: "GraphRunner") -> None:
        """Run the draft chain (k > 1) on ``runner``'s caches, as graphs of the capture sizes in requests."""
        if self.k > 1:
            self.chain = DraftChain(runner, self.capture_sizes)

    def to_dict(self) -> dict:
        """``SpecStats.to_dict``, with the chain steps' runner counters (k > 1) as ``draft_chain``."""
        out = self.stats.to_dict()
        return out | {"draft_chain": self.chain.stats.to_dict()} if self.chain else out

    @contextmanager
    def checked(self, reports: list, produced: list) -> Iterator[None]:
        """``Engine.generate_checked``: every chain step that runs as a graph is compared with eager;
        its report goes to ``reports``, each routing flip naming its request and the step
        (``len(produced) - 1``) as the engine names a verify step's."""
        def on_report(report: "ParityReport", indices: list[int]) -> None:
            for flip in report.routing_flips:
                flip.update(request=indices[flip["token"]], step=len(produced) - 1)
            reports.append(report)

        self._on_report = on_report
        try:
            yield
        finally:
            self._on_report = None

    def check_greedy(self, params: SamplingParams) -> None:
        """A draft is accepted where it is the target's greedy choice: sampling is refused."""
        if not params.greedy:
            raise ValueError(f"num_speculative_tokens={self.k} decodes greedily: temperature must be 0, "
                             f"got {params.temperature}")

    def decode_entries(self, scheduler: "Scheduler", batch: list["Request"]) -> list[SequenceStep]:
        """Per request: its last token, then its drafts, each a decode row."""
        out = []
        for r in batch:
            table, p = scheduler.blocks.table(r.seq_id), r.num_tokens - 1
            out += [SequenceStep(r.output[-1:], p, table)]
            out += [SequenceStep([d], p + 1 + j, table) for j, d in enumerate(r.drafts)]
        return out

    def advance(self, scheduler: "Scheduler", batch: list["Request"], logits: Tensor, prefill: bool,
                stops: frozenset[int], counters: "EngineStats") -> int:
        """Keep each request's accepted tokens (from its rows of ``logits``: ``[rows, 2V]``, with
        k > 1 ``[rows, 2V + E]``), draft its next tokens, finish requests that stop; returns the
        progress count as ``Engine._advance`` does. ``counters`` gains the tokens beyond one per request."""
        v = self.vocab
        target = logits[:, :v]
        choice, first = target.argmax(-1).tolist(), logits[:, v:2 * v].argmax(-1).tolist()
        rows = 1 if prefill else 1 + self.k
        done, extra, chained = 0, 0, []
        for i, request in enumerate(batch):
            r = i * rows
            keep = [r]
            if not prefill:
                self.stats.drafted += self.k
                for j, draft in enumerate(request.drafts):
                    if choice[r + j] != draft:
                        break
                    self.stats.accepted_per_position[j] += 1
                    keep.append(r + j + 1)
            for j, row in enumerate(keep):
                extra += j > 0
                done += append_token(scheduler, request, choice[row], target[row], stops)
                if request.finished:
                    break
            request.drafts = [first[keep[-1]]]
            if self.k > 1 and not request.finished:
                chained.append((request, keep[-1]))
        if chained:
            self._chain(scheduler, [r for r, _ in chained], logits[[row for _, row in chained], 2 * v:])
        if not prefill:
            self.stats.verify_steps += 1
            counters.generated_tokens += extra
            counters.decode_tokens += extra
        return done

    def _chain(self, scheduler: "Scheduler", requests: list["Request"], hidden: Tensor) -> None:
        """Draft each request's tokens 2 .. k: ``k - 1`` chain steps from its first draft and ``hidden [n, E]``."""
        chain = self.chain
        indices = [r.index for r in requests]
        chain.on_report = None if self._on_report is None else lambda report: self._on_report(report, indices)
        for _ in range(self.k - 1):
            entries = [SequenceStep(r.drafts[-1:], r.num_tokens + len(r.drafts) - 2, scheduler.blocks.table(r.seq_id))
                       for r in requests]
            out = chain.execute(entries, hidden)
            for r, d in zip(requests, out[:, :self.vocab].argmax(-1).tolist()):
                r.drafts.append(d)
            hidden = out[:, self.vocab:]
