"""Reading a sequence's tokens through its block table, and the masks that go with it.

Shape legend: N num_blocks, S block_size, B rows, M block-table width, T = M * S token slots,
H heads of the cache element, D its width, L a sequence's context length, Q its query length.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_rows(cache: Tensor, block_tables: Tensor) -> Tensor:
    """Tokens of each row's blocks, in order: ``[N, S, H, D]`` by ``[B, M]`` -> ``[B, T, H, D]``.

    Reads only the ``B * M`` blocks named, so the cost follows the batch and table width,
    never the cache capacity ``N``.
    """
    b, m = block_tables.shape
    return cache[block_tables.long()].reshape(b, m * cache.shape[1], *cache.shape[2:])


def gather_sequence(cache: Tensor, block_table: Tensor, length: int) -> Tensor:
    """The first ``length`` tokens of one sequence: ``[M]`` -> ``[L, H, D]``."""
    n_blocks = -(-length // cache.shape[1])
    return cache[block_table[:n_blocks].long()].flatten(0, 1)[:length]


def valid_slots(context_lens: Tensor, num_slots: int) -> Tensor:
    """``[B, T]`` bool: slot ``t`` of row ``b`` holds one of its ``context_lens[b]`` tokens."""
    t = torch.arange(num_slots, device=context_lens.device)
    return t[None, :] < context_lens[:, None]


def reads_one(context_lens: Tensor) -> Tensor:
    """``context_lens`` with each 0 (a padding row) read as 1: the gathered forms' softmax then
    has a slot (the null block's first) and stays finite."""
    return context_lens.clamp(min=1)


def causal_mask(query_len: int, context_len: int, device: torch.device) -> Tensor:
    """``[Q, L]`` bool: the queries are the last ``Q`` of ``L`` tokens; each sees itself and before."""
    q_pos = torch.arange(context_len - query_len, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= q_pos[:, None]


def masked_softmax(scores: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Softmax in float32 over the last dim of ``scores * scale`` where ``mask`` is True."""
    scores = scores.float() * scale
    return scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)


def _probe_aten_bf16_emulated() -> bool:
    try:
        return not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return True


_ATEN_BF16_EMULATED = _probe_aten_bf16_emulated()  # asked once, at import: a constant when compiled


def aten_bf16_emulated() -> bool:
    """Whether aten multiplies bfloat16 CPU tensors without oneDNN's bfloat16 path (which needs
    AVX-512 or AMX): ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` False or missing. There
    its bfloat16 matmuls run a generic loop, slow for some layouts (docs/cpu-kernels.md)."""
    return _ATEN_BF16_EMULATED


def float32_products(t: Tensor) -> bool:
    """Whether attention's products over ``t`` (gathered cache rows) run faster in float32: a
    bfloat16 CPU tensor where ``aten_bf16_emulated()``. Each such product is then rounded once to
    bfloat16 (``by_rows``), which is what aten's own bfloat16 product computes: float32 sums of
    the same values, one rounding per output."""
    return t.device.type == "cpu" and t.dtype == torch.bfloat16 and aten_bf16_emulated()


def by_rows(equation: str, x: Tensor, rows: Tensor, dtype: torch.dtype) -> Tensor:
    """``torch.einsum(equation, x, rows)`` in ``rows``' dtype, as ``dtype``."""
    return torch.einsum(equation, x.to(rows.dtype), rows).to(dtype)
