"""Building blocks shared by the DeepSeek modules: uninitialised linears, RMSNorm, float32 islands.

Shape legend: T tokens, D the normalised width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def linear(in_features: int, out_features: int, dtype: torch.dtype, device=None, bias: bool = False) -> nn.Linear:
    """An ``nn.Linear`` whose weights are left uninitialised (the model or the loader fills them)."""
    device = torch.get_default_device() if device is None else device
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype, device=device)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32; the weight multiplies the result in ``x.dtype``."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        """``[T, D]`` -> ``[T, D]``."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Float32Module(nn.Module):
    """A module whose tensors stay float32 when the model is cast (``.to(torch.bfloat16)``,
    ``.half()``): they follow device moves only. Rope frequencies and routing need the precision."""

    def _apply(self, fn, recurse: bool = True):
        tensors = [t for t in (*self.parameters(recurse), *self.buffers(recurse)) if t is not None]
        if not tensors:
            return super()._apply(fn, recurse)
        target = fn(torch.empty(0, dtype=torch.float32, device=tensors[0].device))  # where fn sends float32
        return super()._apply(lambda t: t.to(device=target.device), recurse)
