"""DeepSeek's rotary embedding with YaRN scaling, and the MLA softmax scale that goes with it.

Shape legend: T tokens, H heads, R qk_rope_head_dim, F = R / 2 rotation frequencies.

Layout: DeepSeek rotates interleaved pairs ``(x0, x1), (x2, x3), ...`` (pair ``i`` by frequency
``i``) and keeps that layout in its output, as DeepSeek's reference code and transformers'
DeepseekV2 (complex multiplication) do. transformers' DeepseekV3 writes the rotated pairs out
de-interleaved instead; that is the same rotation followed by one fixed permutation applied to
both q and k, so every score ``q_pe . k_pe`` (and hence every output) is identical. The cached
``k_pe`` here uses DeepSeek's own layout. ``rope_interleave=False`` checkpoints pair ``x[i]``
with ``x[i + F]`` (half-split layout).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .deepseek_config import DeepseekConfig, RopeScaling
from ..layers import Float32Module, apply_rope  # noqa: F401  (apply_rope: re-exported)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config: DeepseekConfig) -> float:
    """MLA score scale: ``(Dn + R) ** -0.5``, times ``m ** 2`` with ``m = yarn_mscale(factor,
    mscale_all_dim)`` under YaRN (older V2 ports omitted ``m ** 2``)."""
    scale = config.qk_head_dim ** -0.5
    rope = config.rope_scaling
    if rope is not None and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def _correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The rotary dimension whose wavelength fits ``rotations`` times into ``max_pos`` tokens."""
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_inv_freq(dim: int, base: float, rope: RopeScaling) -> Tensor:
    """``[F]`` float32 frequencies: high ones kept, low ones divided by ``factor``, a linear
    ramp between the dimensions set by ``beta_fast`` / ``beta_slow``."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    low = _correction_dim(rope.beta_fast, dim, base, rope.original_max_position_embeddings)
    high = _correction_dim(rope.beta_slow, dim, base, rope.original_max_position_embeddings)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
    return (1.0 / (rope.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_inv_freq(config: DeepseekConfig) -> Tensor:
    """``[F]`` float32 rotation frequencies of ``config`` (YaRN or plain)."""
    dim = config.qk_rope_head_dim
    if config.rope_scaling is None:
        return 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    return yarn_inv_freq(dim, config.rope_theta, config.rope_scaling)


def rope_attention_factor(rope: RopeScaling | None) -> float:
    """The factor YaRN puts on cos/sin: ``mscale(mscale) / mscale(mscale_all_dim)`` (1 for the
    published V2/V3 configs, where the two are equal)."""
    if rope is None:
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


class RotaryEmbedding(Float32Module):
    """cos/sin for the step's positions, computed from the frequencies (no position table)."""

    def __init__(self, config: DeepseekConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq if device is None else inv_freq.to(device), persistent=False)
        self.attention_factor = rope_attention_factor(config.rope_scaling)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``positions [T]`` -> ``(cos, sin)``, each ``[T, F]`` float32."""
        angles = positions.float()[:, None] * self.inv_freq  # [T, F]
        return angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
