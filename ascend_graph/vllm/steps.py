"""A vLLM step in the runner's terms, without importing vLLM.

vLLM's ``CommonAttentionMetadata`` (``v1/attention/backend.py``) lists a step's requests in
batch order, decodes first: ``query_start_loc_cpu [R + 1]`` (each request's span of the
flattened tokens), ``seq_lens [R]`` (its length after this step), ``block_table_tensor [R', W]``
(its blocks, rows past ``R`` and columns past its length being padding) and ``num_reqs`` (R).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..runner import SequenceStep


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


def logits_at_last_tokens(logits: Tensor, meta: Any, num_tokens: int) -> Tensor:
    """``[T, V]``: each request's ``logits`` row at its last token (the row vLLM samples), zeros elsewhere.

    Where every request has one token (``T`` equals the request count), row ``i`` is request
    ``i``'s last token: ``logits`` itself, nothing materialised."""
    if num_tokens == meta.num_reqs:
        return logits
    out = logits.new_zeros(num_tokens, logits.shape[-1])
    out[meta.query_start_loc_cpu[1: meta.num_reqs + 1].to(torch.long) - 1] = logits
    return out
