"""Building blocks shared by the DeepSeek modules: uninitialised linears, RMSNorm, float32 islands.

Shape legend: T tokens, D the normalised width, N output features, K input features, C chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .runtime import reduction_chunks


def linear(in_features: int, out_features: int, dtype: torch.dtype, device=None, bias: bool = False,
           chunked: bool = True) -> nn.Module:
    """An uninitialised linear (the model or the loader fills it): an ``nn.Linear``, or on CPU,
    for ``in_features`` over ``runtime.LONG_REDUCTION`` (and ``chunked``), a ``ChunkedLinear``."""
    device = torch.device(torch.get_default_device() if device is None else device)
    chunks = reduction_chunks(in_features) if chunked and device.type == "cpu" else 1
    if chunks > 1:
        return ChunkedLinear(in_features, out_features, chunks, dtype, device, bias)
    return nn.utils.skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype, device=device)


class ChunkedLinear(nn.Module):
    """A linear layer whose weight is stored chunk-major, for CPU decode.

    ``weight`` is ``[N, C, K/C]``: the checkpoint's ``[N, K]`` with its rows cut into ``C`` equal
    chunks (``weight.flatten(1)`` is the checkpoint tensor; ``view`` a checkpoint tensor to fill
    it). Its storage is ``[C, N, K/C]`` contiguous, so each chunk is a contiguous ``[N, K/C]``
    matrix and the output is the sum of ``C`` linears, accumulated in float32. A one-row product
    then streams each chunk with its piece of the input row held in L1: rows of 10944 (the V2-Lite
    dense MLP's down projection, C = 3) read 12.5-13 GB/s row-major and 25-33 GB/s chunk-major
    over runs (``runtime.LONG_REDUCTION``). Eager computes the same sum.
    """

    def __init__(self, in_features: int, out_features: int, chunks: int, dtype: torch.dtype,
                 device=None, bias: bool = False) -> None:
        super().__init__()
        if in_features % chunks:
            raise ValueError(f"in_features {in_features} does not split into {chunks} equal chunks")
        self.in_features, self.out_features, self.chunks = in_features, out_features, chunks
        storage = torch.empty(chunks, out_features, in_features // chunks, dtype=dtype, device=device)
        self.weight = nn.Parameter(storage.permute(1, 0, 2))  # [N, C, K/C]
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        """``[..., K]`` -> ``[..., N]``."""
        xs = x.unflatten(-1, (self.chunks, -1))  # [..., C, K/C]
        out = F.linear(xs[..., 0, :], self.weight[:, 0]).float()
        for c in range(1, self.chunks):
            out = out + F.linear(xs[..., c, :], self.weight[:, c]).float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, chunks={self.chunks}, "
                f"bias={self.bias is not None}")


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
