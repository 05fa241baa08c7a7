"""Oracles for the tests (not a backend): attention on contiguous per-sequence tensors, no cache, no paging.

Shape legend: L context length, Q query length (the last Q of L tokens), H heads,
Hk kv heads, Dn / R / Dv / C as in ``mla.py``, D head size.

Computed in float64 with plain matmuls and softmax, independently of the paged kernels.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _causal_softmax_attention(scores: Tensor, v: Tensor) -> Tensor:
    """``scores [H, Q, L]``, ``v [H, L, Dv]``: mask the future, softmax, weight."""
    q_len, ctx = scores.shape[-2:]
    future = torch.ones(q_len, ctx, dtype=torch.bool).triu(ctx - q_len + 1)
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return weights @ v


def naive_mla(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor,
              w_uk: Tensor, w_uv: Tensor, scale: float) -> Tensor:
    """MLA with K and V fully up-projected: ``[Q, H, Dn]``, ``[Q, H, R]``, ``kv_c [L, C]``,
    ``k_pe [L, R]`` -> ``[Q, H, Dv]`` (float64)."""
    f = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731
    k_nope = torch.einsum("lc,hdc->hld", f(kv_c), f(w_uk))  # [H, L, Dn]
    v = torch.einsum("lc,hvc->hlv", f(kv_c), f(w_uv))  # [H, L, Dv]
    scores = (f(q_nope).transpose(0, 1) @ k_nope.transpose(1, 2)
              + f(q_pe).transpose(0, 1) @ f(k_pe).T) * scale  # [H, Q, L]
    return _causal_softmax_attention(scores, v).transpose(0, 1)


def dense_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal GQA attention: ``q [Q, Hq, D]``, ``k``/``v [L, Hk, D]`` -> ``[Q, Hq, D]`` (float64)."""
    f = lambda t: t.detach().to("cpu", torch.float64).transpose(0, 1)  # noqa: E731
    g = q.shape[1] // k.shape[1]
    kk, vv = f(k).repeat_interleave(g, 0), f(v).repeat_interleave(g, 0)  # [Hq, L, D]
    scores = f(q) @ kk.transpose(1, 2) * scale  # [Hq, Q, L]
    return _causal_softmax_attention(scores, vv).transpose(0, 1)
