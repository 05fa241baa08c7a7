"""What a runner step is made of: the caller's sequences, the prepared batch, the captured
module with one code object per capture size, the counters and the runner's errors.

Shape legend: T tokens in the step, n sequences in it, s capture size, V vocabulary.
"""

from __future__ import annotations

import types
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from ..attention import AttentionMetadata


class RecompileError(RuntimeError):
    """A capture size compiled again after warm-up (``on_recompile="error"``)."""


class GraphCompileError(RuntimeError):
    """Compiling a capture size failed and ``fallback_on_compile_error`` is off."""


class GraphCompileWarning(RuntimeWarning):
    """Compiling a capture size (or a compile group) failed and it falls back: the size runs
    eagerly, or the group's sizes compile one by one. The message names the sizes and the
    exception (``RunnerStats.compile_errors`` keeps the same text per size)."""


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's share of a step: its new tokens, how many it has cached, its blocks."""

    token_ids: Sequence[int]
    num_cached: int
    block_table: Sequence[int]


@dataclass
class RunnerStats:
    """Counters of a runner: what ran as a graph, what ran eagerly and why, compiles, capture."""

    graph_steps: int = 0
    graph_sizes_run: Counter = field(default_factory=Counter)  # capture size -> graph steps run at it
    idle_steps: int = 0  # data parallel: steps this rank ran on padding alone (its replica had no sequences)
    eager_steps: Counter = field(default_factory=Counter)
    compiles: int = 0
    recompiles: int = 0
    compile_failures: int = 0
    # capture size (int) or failed compile group ("2-8") -> "ExceptionType: message" of its compile failure
    compile_errors: dict = field(default_factory=dict)
    packages_loaded: int = 0  # capture sizes loaded from AOTInductor packages without compiling
    capture_seconds: float = 0.0
    # size -> {"seconds": .., "memory_bytes": .., "compile_cache": "hit" | "miss" | "bypass" | None,
    #          "compile_group": "8" (compiled alone) or "2-8" (one compile shared by sizes 2..8, whose
    #          outcome every size of the group reports; ``compiles`` counts that compile once)}
    capture: dict = field(default_factory=dict)
    parity_checks: int = 0
    parity_failures: int = 0
    last_parity_failure: Optional[str] = None  # ``ParityReport.summary()`` of the latest failed check
    # reason -> calls per layer that an attention backend handed to a slower form (``fallbacks()``)
    attention_fallbacks: dict = field(default_factory=dict)
    recaptures: int = 0  # graph recaptures the backend counted since capture (npugraph_ex: a cache's address changed)

    def to_dict(self) -> dict:
        """A JSON-safe copy."""
        return {
            "graph_steps": self.graph_steps, "idle_steps": self.idle_steps,
            "graph_sizes_run": {str(k): v for k, v in sorted(self.graph_sizes_run.items())},
            "eager_steps": dict(self.eager_steps),
            "eager_steps_total": sum(self.eager_steps.values()), "compiles": self.compiles,
            "recompiles": self.recompiles, "compile_failures": self.compile_failures,
            "compile_errors": {str(k): v for k, v in self.compile_errors.items()},
            "packages_loaded": self.packages_loaded,
            "capture_seconds": round(self.capture_seconds, 3),
            "capture": {str(k): v for k, v in sorted(self.capture.items())},
            "parity_checks": self.parity_checks, "parity_failures": self.parity_failures,
            "last_parity_failure": self.last_parity_failure,
            "recaptures": self.recaptures, "attention_fallbacks": dict(self.attention_fallbacks),
        }


@dataclass
class PreparedStep:
    """A validated batch: flat inputs and metadata, rows reordered decodes first."""

    input_ids: Tensor   # [T]
    positions: Tensor   # [T]
    meta: AttentionMetadata
    order: list[int]    # batch row i is the caller's sequence order[i]
    last: Tensor        # [n] index of each row's last token


class DecodeStep(nn.Module):
    """The captured unit: the model's forward and its logits, as one module method."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: tuple,
                attn_metadata: AttentionMetadata) -> Tensor:
        """``[s]`` ids and positions, the caches, decode metadata -> ``[s, V]`` logits (``step_logits``)."""
        return step_logits(self.model, self.model(input_ids, positions, kv_caches, attn_metadata), None,
                           input_ids, positions, kv_caches, attn_metadata)


def step_logits(model: nn.Module, hidden: Tensor, rows: Optional[Tensor], input_ids: Tensor, positions: Tensor,
                kv_caches: tuple, attn_metadata: AttentionMetadata) -> Tensor:
    """A step's logits from the model's ``hidden`` states at ``rows`` (None: all): the model's
    own ``step_logits`` where it has one (DeepSeek's MTP drafting adds columns), else
    ``compute_logits``."""
    own = getattr(model, "step_logits", None)
    if own is not None:
        return own(hidden, rows, input_ids, positions, kv_caches, attn_metadata)
    return model.compute_logits(hidden if rows is None else hidden[rows])


def step_for_size(step: nn.Module, size: int | str, name: str = "decode_step") -> Callable:
    """``step.forward`` bound again, with its own code object named ``<name>_<size>``.

    Dynamo keeps compiled entries (and counts its recompile limit) per code object, and
    torchair's graph cache is per code object too: one copy per capture size (or per compile
    group, ``size`` then its label ``"2-8"``, named ``decode_step_2_8``) gives each exactly one
    entry, so a second compile of it is a real recompile.
    """
    forward = type(step).forward
    code = forward.__code__.replace(co_name=f"{name}_{str(size).replace('-', '_')}")
    fn = types.FunctionType(code, forward.__globals__, code.co_name)
    return types.MethodType(fn, step)


def unpermute(logits: Tensor, order: list[int]) -> Tensor:
    """``logits`` of the rows in batch order back in the caller's (``PreparedStep.order``)."""
    if all(i == row for row, i in enumerate(order)):
        return logits  # already in the caller's order (decode-only batches always are)
    out = torch.empty_like(logits)
    out[torch.tensor(order, device=logits.device)] = logits
    return out
