"""A CPU stand-in for the torch_npu operators the npu attention backend calls (test code, not
the package): each implements the operator's documented semantics in plain torch, checks the
arguments the documentation requires, and records what it was handed (``CALLS``) for the
contract tests. Each is a ``torch.library`` op with a fake implementation, so a compiled graph
keeps it as one call, its ``SymInt[]`` lengths included, as it keeps the real operator.

``install(monkeypatch)`` puts the stand-in in ``sys.modules["torch_npu"]`` and lets the npu
backends run on CPU tensors.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Optional

import torch
from torch import Tensor

CALLS: list[tuple[str, dict]] = []  # (op, arguments) per call from Python (not from inside a graph)
RUNS: list[list[int]] = []  # actual_seq_lengths_kv of every fused-attention run


def _record(op: str, arguments: dict) -> None:
    if not torch.compiler.is_compiling():  # a graph replays the op, not this Python wrapper
        CALLS.append((op, arguments))


def _rows(cache: Tensor, table: Tensor, length: int, layout: str) -> Tensor:
    """The first ``length`` tokens of one row from a paged key: ``[L, Hk, D]``."""
    if layout == "BNSD":  # [N, Hk, S, D]
        s = cache.shape[2]
        blocks = cache[table[:-(-length // s)].long()]  # [n, Hk, S, D]
        return blocks.transpose(1, 2).flatten(0, 1)[:length]
    s = cache.shape[1]  # BSH: [N, S, Hk * D]
    return cache[table[:-(-length // s)].long()].flatten(0, 1)[:length]


def _attend(q: Tensor, k: Tensor, v: Tensor, qr: Optional[Tensor], kr: Optional[Tensor], scale: float,
            causal_offset: Optional[int]) -> Tensor:
    """``q [Q, N, D]`` over ``k [L, Hk, D]``, ``v [L, Hk, Dv]`` in float32 (grouped heads)."""
    g = q.shape[1] // k.shape[1]
    f = lambda t: t.float().repeat_interleave(g, dim=1).transpose(0, 1)  # noqa: E731  [N, L, D]
    scores = q.float().transpose(0, 1) @ f(k).transpose(1, 2)  # [N, Q, L]
    if qr is not None:
        scores = scores + qr.float().transpose(0, 1) @ f(kr).transpose(1, 2)
    scores = scores * scale
    if causal_offset is not None:  # query i sees keys j <= causal_offset + i (bottom-right causal)
        i = torch.arange(q.shape[0])[:, None]
        j = torch.arange(k.shape[0])[None, :]
        scores = scores.masked_fill(j > causal_offset + i, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ f(v)).transpose(0, 1)  # [Q, N, Dv]


@torch.library.custom_op("npu_standin::fused_infer_attention_score", mutates_args=())
def _fia(query: Tensor, key: Tensor, value: Tensor, query_rope: Optional[Tensor], key_rope: Optional[Tensor],
         block_table: Optional[Tensor], atten_mask: Optional[Tensor], actual_seq_lengths: Optional[list[int]],
         actual_seq_lengths_kv: list[int], num_heads: int, num_key_value_heads: int, input_layout: str,
         scale: float, sparse_mode: int, block_size: int) -> tuple[Tensor, Tensor]:
    out = query.new_zeros(_fia_shape(query, value, input_layout, num_heads, num_key_value_heads))
    RUNS.append(list(actual_seq_lengths_kv))  # at run time, in eager steps and graph replays alike
    if block_table is not None:  # paged decode: one query token per row
        assert input_layout in ("BNSD", "BSH") and sparse_mode == 0 and atten_mask is None
        assert block_table.dtype == torch.int32 and len(actual_seq_lengths_kv) == query.shape[0]
        b = query.shape[0]
        q = query.view(b, num_heads, -1) if input_layout == "BNSD" else query.view(b, num_heads, -1)
        qr = None if query_rope is None else query_rope.view(b, num_heads, -1)
        for row, length in enumerate(actual_seq_lengths_kv):
            if length == 0:
                continue  # nothing to read: the row's output stays zero
            k = _rows(key, block_table[row], length, input_layout).reshape(length, num_key_value_heads, -1)
            v = _rows(value, block_table[row], length, input_layout).reshape(length, num_key_value_heads, -1)
            kr = None if key_rope is None else _rows(key_rope, block_table[row], length, input_layout)
            o = _attend(q[row:row + 1], k, v, qr if qr is None else qr[row:row + 1], kr, scale, None)
            out.view(b, num_heads, -1)[row] = o[0].to(out.dtype)
        return out, query.new_zeros(1)
    assert input_layout == "TND" and sparse_mode == 3, "prefill: TND, bottom-right causal"
    assert atten_mask is not None and atten_mask.shape == (2048, 2048) and atten_mask.dtype == torch.bool
    assert torch.equal(atten_mask[:4, :4], torch.ones(4, 4, dtype=torch.bool).triu(1))
    q0 = k0 = 0
    for q1, k1 in zip(actual_seq_lengths, actual_seq_lengths_kv):  # cumulative ends
        o = _attend(query[q0:q1], key[k0:k1], value[k0:k1], None, None, scale, (k1 - k0) - (q1 - q0))
        out[q0:q1] = o.to(out.dtype)
        q0, k0 = q1, k1
    return out, query.new_zeros(1)


def _fia_shape(query, value, layout, num_heads, num_kv_heads):
    if layout == "BNSD":  # value [N, Hk, S, Dv]
        return (*query.shape[:-1], value.shape[-1])
    if layout == "BSH":  # value [N, S, Hk * Dv]
        return (*query.shape[:-1], num_heads * (value.shape[-1] // num_kv_heads))
    return (*query.shape[:-1], value.shape[-1])  # TND


@_fia.register_fake
def _(query, key, value, query_rope, key_rope, block_table, atten_mask, actual_seq_lengths, actual_seq_lengths_kv,
      num_heads, num_key_value_heads, input_layout, scale, sparse_mode, block_size):
    return query.new_empty(_fia_shape(query, value, input_layout, num_heads, num_key_value_heads)), query.new_empty(1)


def npu_fused_infer_attention_score(query, key, value, *, query_rope=None, key_rope=None, block_table=None,
                                    atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                    num_heads=1, num_key_value_heads=0, input_layout="BSH", scale=1.0,
                                    sparse_mode=0, block_size=0, antiquant_mode=0, antiquant_scale=None):
    _record("npu_fused_infer_attention_score", dict(
        query=query, key=key, value=value, query_rope=query_rope, key_rope=key_rope, block_table=block_table,
        atten_mask=atten_mask, actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
        num_heads=num_heads, num_key_value_heads=num_key_value_heads, input_layout=input_layout, scale=scale,
        sparse_mode=sparse_mode, block_size=block_size, antiquant_mode=antiquant_mode,
        antiquant_scale=antiquant_scale))
    assert query.dtype in (torch.float16, torch.bfloat16) and key.dtype == query.dtype
    return torch.ops.npu_standin.fused_infer_attention_score(
        query, key, value, query_rope, key_rope, block_table, atten_mask,
        None if actual_seq_lengths is None else list(actual_seq_lengths), list(actual_seq_lengths_kv),
        num_heads, num_key_value_heads or num_heads, input_layout, scale, sparse_mode, block_size)


@torch.library.custom_op("npu_standin::kv_rmsnorm_rope_cache", mutates_args=("k_cache", "ckv_cache"))
def _kv_rmsnorm_rope_cache(kv: Tensor, gamma: Tensor, cos: Tensor, sin: Tensor, index: Tensor, k_cache: Tensor,
                           ckv_cache: Tensor, epsilon: float, cache_mode: str) -> tuple[Tensor, Tensor]:
    assert cache_mode == "PA" and index.dtype == torch.int64 and bool((index >= 0).all())
    c, r = ckv_cache.shape[-1], k_cache.shape[-1]
    x = kv.float()
    normed = x[..., :c] * torch.rsqrt(x[..., :c].pow(2).mean(-1, keepdim=True) + epsilon) * gamma.float()
    rope_in = x[..., c:]
    x1, x2 = rope_in[..., 0::2], rope_in[..., 1::2]  # the documented interleaved rope
    rotated = torch.cat((x1, x2), -1) * cos.float() + torch.cat((-x2, x1), -1) * sin.float()
    ckv_cache.view(-1, c)[index] = normed.reshape(-1, c).to(ckv_cache.dtype)
    k_cache.view(-1, r)[index] = rotated.reshape(-1, r).to(k_cache.dtype)
    return rotated.to(kv.dtype), normed.to(kv.dtype)


@_kv_rmsnorm_rope_cache.register_fake
def _(kv, gamma, cos, sin, index, k_cache, ckv_cache, epsilon, cache_mode):
    c = ckv_cache.shape[-1]
    return kv.new_empty((*kv.shape[:-1], kv.shape[-1] - c)), kv.new_empty((*kv.shape[:-1], c))


def npu_kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache, *, epsilon=1e-5, cache_mode="Norm",
                              is_output_kv=False):
    _record("npu_kv_rmsnorm_rope_cache", dict(kv=kv, gamma=gamma, cos=cos, sin=sin, index=index,
                                                    k_cache=k_cache, ckv_cache=ckv_cache, epsilon=epsilon,
                                                    cache_mode=cache_mode, is_output_kv=is_output_kv))
    assert kv.dim() == 4 and kv.shape[1] == 1 and kv.shape[-1] == ckv_cache.shape[-1] + k_cache.shape[-1]
    assert cos.shape == sin.shape == (*kv.shape[:-1], k_cache.shape[-1]) and gamma.shape == (ckv_cache.shape[-1],)
    k_rope, c_kv = torch.ops.npu_standin.kv_rmsnorm_rope_cache(kv, gamma, cos, sin, index, k_cache, ckv_cache,
                                                                epsilon, cache_mode)
    return k_cache, ckv_cache, k_rope, c_kv


@torch.library.custom_op("npu_standin::scatter_nd_update_", mutates_args=("data",))
def _scatter_nd_update(data: Tensor, indices: Tensor, updates: Tensor) -> None:
    data[tuple(indices[:, i] for i in range(indices.shape[1]))] = updates


@_scatter_nd_update.register_fake
def _(data, indices, updates):
    return None


def npu_scatter_nd_update_(data, indices, updates):
    _record("npu_scatter_nd_update_", dict(data=data, indices=indices, updates=updates))
    assert indices.dtype == torch.int64 and updates.dtype == data.dtype
    assert updates.shape == (*indices.shape[:-1], *data.shape[indices.shape[-1]:])
    torch.ops.npu_standin.scatter_nd_update_(data, indices, updates)
    return data


def module() -> types.ModuleType:
    m = types.ModuleType("torch_npu")
    m.__spec__ = importlib.machinery.ModuleSpec("torch_npu", None)
    m.npu_fused_infer_attention_score = npu_fused_infer_attention_score
    m.npu_kv_rmsnorm_rope_cache = npu_kv_rmsnorm_rope_cache
    m.npu_scatter_nd_update_ = npu_scatter_nd_update_
    return m


OPS = ("npu_fused_infer_attention_score", "npu_kv_rmsnorm_rope_cache", "npu_scatter_nd_update_")


def npu_available() -> bool:
    """Whether the real torch_npu imports and sees an NPU."""
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def recording(real: types.ModuleType) -> types.ModuleType:
    """The real torch_npu with ``OPS`` recorded into ``CALLS`` (keyword arguments by name) before
    each call: the contract tests' view of an NPU run."""
    import inspect

    proxy = types.ModuleType("torch_npu")
    proxy.__spec__ = real.__spec__
    proxy.__getattr__ = lambda name: getattr(real, name)
    for name in OPS:
        stand_in, target = globals()[name], getattr(real, name)
        params = list(inspect.signature(stand_in).parameters)

        def call(*args, _target=target, _name=name, _params=params, **kwargs):
            CALLS.append((_name, {**dict(zip(_params, args)), **kwargs}))
            return _target(*args, **kwargs)

        setattr(proxy, name, call)
    return proxy


def install_device(monkeypatch) -> None:
    """The real torch_npu, recorded, for the same tests on an NPU."""
    import torch_npu

    monkeypatch.setitem(sys.modules, "torch_npu", recording(torch_npu))
    CALLS.clear()
    RUNS.clear()


def install(monkeypatch) -> None:
    """The stand-in as ``torch_npu``; the npu backends accept CPU tensors of their dtypes."""
    from ascend_graph.attention import npu

    monkeypatch.setitem(sys.modules, "torch_npu", module())
    runs = classmethod(lambda cls, device, dtype: dtype in npu.DTYPES)
    monkeypatch.setattr(npu.NpuMLA, "supports", runs)
    monkeypatch.setattr(npu.NpuPaged, "supports", runs)
    CALLS.clear()
    RUNS.clear()
