"""Building blocks shared by the DeepSeek modules: uninitialised linears, RMSNorm, float32 islands,
the rotary embedding's rotation (``apply_rope``, which attention backends apply too).

Shape legend: T tokens, D the normalised width, N output features, K input features, C chunks,
H heads, R rotated width, F = R / 2 rotation frequencies.
"""

from __future__ import annotations

from typing import Optional

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
    """A linear layer for CPU decode whose long rows are read in ``C`` chunks, accumulated in float32.

    ``weight`` is the checkpoint's ``[N, K]`` as built and as the loader fills it.
    ``process_weights_after_loading()`` re-lays it out chunk-major: ``weight`` becomes the same
    values seen as ``[N, C, K/C]`` (``weight.flatten(1)`` is the checkpoint tensor) over storage
    ``[C, N, K/C]`` contiguous, so each chunk is a contiguous ``[N, K/C]`` matrix that a one-row
    product streams with its piece of the input row held in L1 (why: ``runtime.LONG_REDUCTION``,
    ``python -m benchmarks --parts compute``). The re-laid-out weight replaces the parameter, so
    the module holds one copy; re-laying out briefly needs a second copy of this one weight.

    ``state_dict()`` always holds ``weight`` as the checkpoint's ``[N, K]`` (after processing, a
    row-major copy made when the state dict is built), and ``load_state_dict`` takes that form
    into either layout. The output is the sum of ``C`` linears, each rounded to ``x.dtype`` as
    ``F.linear`` rounds it, summed in float32, in both layouts and in eager and compiled alike.
    """

    def __init__(self, in_features: int, out_features: int, chunks: int, dtype: torch.dtype,
                 device=None, bias: bool = False) -> None:
        super().__init__()
        if in_features % chunks:
            raise ValueError(f"in_features {in_features} does not split into {chunks} equal chunks")
        self.in_features, self.out_features, self.chunks = in_features, out_features, chunks
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))  # [N, K]
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.register_state_dict_post_hook(_checkpoint_weight_hook)
        self.register_load_state_dict_pre_hook(_chunk_loaded_weight_hook)

    @property
    def chunk_major(self) -> bool:
        """Whether ``weight`` is in the chunk-major layout (``[N, C, K/C]`` over ``[C, N, K/C]``)."""
        w = self.weight
        return w.dim() == 3 and w.permute(1, 0, 2).is_contiguous()

    def checkpoint_weight(self) -> Tensor:
        """The weight as the checkpoint's ``[N, K]``: the parameter itself before processing,
        a row-major copy after."""
        return self.weight.flatten(1) if self.weight.dim() == 3 else self.weight

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Re-lay ``weight`` out chunk-major (no-op if it already is); call it after filling or
        replacing ``weight`` (``load_state_dict`` writes into either layout and needs no call)."""
        if self.chunk_major:
            return
        w = self.weight.detach().reshape(self.out_features, self.chunks, -1)  # [N, C, K/C]
        storage = torch.empty(self.chunks, *w.shape[::2], dtype=w.dtype, device=w.device)  # [C, N, K/C]
        storage.copy_(w.permute(1, 0, 2))
        del w
        self.weight = nn.Parameter(storage.permute(1, 0, 2), requires_grad=self.weight.requires_grad)

    def forward(self, x: Tensor) -> Tensor:
        """``[..., K]`` -> ``[..., N]``."""
        xs = x.unflatten(-1, (self.chunks, -1))  # [..., C, K/C]
        w = self.weight.view(self.out_features, self.chunks, -1)  # [N, C, K/C], a view in either layout
        out = F.linear(xs[..., 0, :], w[:, 0]).float()
        for c in range(1, self.chunks):
            out = out + F.linear(xs[..., c, :], w[:, c]).float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, chunks={self.chunks}, "
                f"bias={self.bias is not None}")


def _checkpoint_weight_hook(module: ChunkedLinear, state: dict, prefix: str, local_metadata) -> None:
    """State-dict hook: ``weight`` in the checkpoint's ``[N, K]`` form whatever the layout."""
    key = prefix + "weight"
    if key in state and state[key].dim() == 3:
        state[key] = state[key].flatten(1)


def _chunk_loaded_weight_hook(module: ChunkedLinear, state: dict, prefix: str, *args) -> None:
    """Load pre-hook: a checkpoint ``[N, K]`` weight viewed as the chunk-major parameter's ``[N, C, K/C]``."""
    key = prefix + "weight"
    w = state.get(key)
    if module.weight.dim() == 3 and isinstance(w, Tensor) and w.dim() == 2 and w.shape[1] == module.in_features:
        state[key] = w.view(w.shape[0], module.chunks, -1)


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


class ChosenBackend:
    """Mixin for a module whose ``backend`` (how it computes) is chosen for its weights' dtype and
    device: ``use_backend(name)`` chooses by name, or the first that runs there (None), and
    ``.to()`` chooses again with the same request. Subclasses say how (``_choose_backend``)."""

    _backend_request: Optional[str] = None

    def _choose_backend(self, name: Optional[str]):
        raise NotImplementedError

    def use_backend(self, name: Optional[str] = None):
        """Choose and keep ``self.backend``; ValueError where a named one cannot run here."""
        self._backend_request, self.backend = name, self._choose_backend(name)
        return self.backend

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self.use_backend(self._backend_request)
        return out


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = True) -> Tensor:
    """Rotate ``x [T, H, R]`` by ``cos``/``sin [T, F]`` (in float32, returned in ``x.dtype``)."""
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, F]
    xf = x.float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]  # [T, H, F] each
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
