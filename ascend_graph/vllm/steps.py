"""A vLLM step in the runner's terms, and the logits rows it hands back, without importing vLLM.

vLLM's ``CommonAttentionMetadata`` (``v1/attention/backend.py``) lists a step's requests in
batch order, decodes first: ``query_start_loc_cpu [R + 1]`` (each request's span of the
flattened tokens), ``seq_lens [R]`` (its length after this step), ``block_table_tensor [R', W]``
(its blocks, rows past ``R`` and columns past its length being padding) and ``num_reqs`` (R).

Logits rows. vLLM's runner does ``logits = model.compute_logits(forward(...)[logits_indices])``.
The runner computes logits only where vLLM samples: ``[R, V]``, one row per request at its last
token. So ``forward`` returns ``token_rows``, a ``[T, 2]`` float64 tensor (``ROW``: the request
whose last token this is, or ``NO_ROW``; ``STEP``: the forward's serial number), and
``compute_logits`` maps vLLM's selection of it to the runner's rows with ``select_logits``,
which refuses a token without logits (e.g. prompt logprobs) and rows of another forward.

Speculative decoding (``speculative_config`` with ``num_speculative_tokens=k``): vLLM samples
at every token of a verify request (its last token and its drafts) and its MTP drafter reads
the target's hidden state at every token. ``speculative_rows`` lays a step out for that: where
no request brings more than ``1 + k`` tokens, every token is a decode row (one captured graph);
otherwise those requests' tokens are one-token steps and each longer one (a prompt) one step,
run eagerly, its hidden states taken whole from the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from ..runner import SequenceStep

ROW, STEP = 0, 1  # the columns of token_rows
NO_ROW = -1.0  # a token vLLM gets no logits for (not a request's last token, or a dummy run)


def sequence_steps(token_ids: list[int], meta: Any, block_size: int) -> list[SequenceStep]:
    """Per request: its new tokens, how many it has cached, the blocks its length needs.

    One host conversion per metadata tensor: the block table's live rows and columns come
    over as one list, each request's row then cut to the blocks its length needs."""
    n = meta.num_reqs
    starts = meta.query_start_loc_cpu[: n + 1].tolist()
    seq_lens = meta.seq_lens[:n].tolist()
    widths = [-(-length // block_size) for length in seq_lens]  # ceil without floats
    tables = meta.block_table_tensor[:n, :max(widths, default=0)].tolist()
    return [SequenceStep(token_ids[starts[i]:starts[i + 1]], seq_lens[i] - (starts[i + 1] - starts[i]),
                         tables[i][:widths[i]]) for i in range(n)]


@dataclass
class SpeculativeRows:
    """A step as ``speculative_rows`` lays it out: ``decode`` (every token a decode row: the
    lengths ``[T]`` after each and the index ``[T]`` of its request's block-table row) or
    ``seqs`` (one-token steps first, in vLLM's order, then the longer requests'), ``rows [T]``
    (each token's logits row in the runner's output, ``NO_ROW`` for none) and ``order [T]`` (each
    token's place in the runner's token order: the hidden state it reads)."""

    decode: Optional[tuple[Tensor, Tensor]]
    seqs: Optional[list[SequenceStep]]
    rows: Tensor
    order: Tensor


def speculative_rows(token_ids: list[int], meta: Any, block_size: int, k: int) -> SpeculativeRows:
    """The step's tokens as the runner's rows when vLLM speculates ``k`` tokens (module docstring)."""
    n = meta.num_reqs
    starts = meta.query_start_loc_cpu[: n + 1].to(torch.long)
    counts = starts[1:] - starts[:-1]
    total = int(starts[n])
    request = torch.repeat_interleave(torch.arange(n), counts)  # [T] each token's request
    every = torch.arange(total)
    if int(counts.max()) <= 1 + k:
        within = every - starts[:-1][request]  # [T] each token's place in its request's span
        lens = meta.seq_lens[:n].to(torch.long).cpu()[request] - counts[request] + within + 1
        return SpeculativeRows((lens, request), None, every.to(torch.float64), every)
    short = (counts <= 1 + k)[request]  # [T] a token of a request with at most 1 + k tokens
    singles, longs = every[short], every[~short]
    order = torch.empty(total, dtype=torch.long)
    order[singles] = torch.arange(len(singles))
    order[longs] = len(singles) + torch.arange(len(longs))
    steps = sequence_steps(token_ids, meta, block_size)
    seqs = [SequenceStep([t], s.num_cached + j, s.block_table)
            for s in steps if len(s.token_ids) <= 1 + k for j, t in enumerate(s.token_ids)]
    seqs += [s for s in steps if len(s.token_ids) > 1 + k]
    rows = torch.full((total,), NO_ROW, dtype=torch.float64)
    rows[singles] = torch.arange(len(singles), dtype=torch.float64)
    ends = starts[1:][counts > 1 + k] - 1  # each longer request's last token
    rows[ends] = len(singles) + torch.arange(len(ends), dtype=torch.float64)
    return SpeculativeRows(None, seqs, rows, order)


def token_rows(num_tokens: int, step: int, meta: Optional[Any] = None, rows: Optional[Tensor] = None) -> Tensor:
    """``[T, 2]`` float64: per token, the request whose last token it is (``NO_ROW`` elsewhere,
    and everywhere without ``meta``: a dummy run), or where ``rows`` is given (``[t <= T]``,
    ``SpeculativeRows.rows``) its logits row; and ``step``. Exact up to 2**53."""
    out = torch.full((num_tokens, 2), NO_ROW, dtype=torch.float64)
    out[:, STEP] = step
    if rows is not None:
        out[:len(rows), ROW] = rows
        return out
    if meta is not None:
        n = meta.num_reqs
        last = meta.query_start_loc_cpu[1: n + 1].to(torch.long) - 1
        out[last, ROW] = torch.arange(n, dtype=torch.float64)
    return out


def select_logits(selected: Tensor, logits: Optional[Tensor], step: int, what: str = "the latest forward") -> Tensor:
    """The runner's ``logits [R, V]`` rows that ``selected`` (vLLM's ``token_rows[logits_indices]``,
    ``[k, 2]``) names, in its order: ``logits`` itself where that is ``0..R-1``, no copy.

    ``ValueError`` naming the problem for: another shape or dtype; rows of another forward than
    ``step`` (``what`` says which); a token without logits (``logits`` is ``None`` for all of
    them: ``what`` names that forward); a row past ``R``."""
    if selected.dim() != 2 or selected.shape[1] != 2 or selected.dtype != torch.float64:
        raise ValueError("compute_logits takes the rows forward returned, selected at the sampled tokens "
                         f"([k, 2] float64), got {selected.dtype} {list(selected.shape)}")
    pairs = selected.tolist()
    stale = sorted({s for _, s in pairs if s != step})
    if stale:
        named = ", ".join(f"{s:g}" for s in stale[:4])
        raise ValueError(f"compute_logits was given rows of another forward (step {named}), not of "
                         f"{what} (step {step}): only the latest forward's rows have logits")
    rows = [r for r, _ in pairs]
    missing = [i for i, r in enumerate(rows) if r == NO_ROW]
    if missing or logits is None:
        raise ValueError(f"vLLM asked for logits at token rows {missing[:8] or list(range(len(rows)))[:8]} of "
                         f"{what}, which has none: graph mode computes logits only at each request's last "
                         "token (prompt logprobs are not supported) and none in vLLM's dummy runs")
    if any(not float(r).is_integer() or not 0 <= r < logits.shape[0] for r in rows):
        raise ValueError(f"token rows {rows[:8]} name logits rows outside [0, {logits.shape[0]})")
    if rows == list(range(logits.shape[0])):
        return logits
    return logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]
