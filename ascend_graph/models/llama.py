"""A small Llama-style GQA decoder over the ``KVCache(k, v)`` tuple cache.

It is the paged-attention counterpart of the DeepSeek model: the runner tests and demos use it
to show that graph mode works for standard attention too, and it serves plain transformers
``LlamaForCausalLM`` checkpoints (``LlamaConfig.from_dict``, ``models.llama_loader``): rope in
the half-split (``rotate_half``) layout, RMSNorm in float32, a SiLU-gated MLP, no biases.
Field names follow Llama's config.json.

Shape legend: T tokens in the step, E hidden size, Hq query heads, Hk kv heads, D head size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import AttentionMetadata, PagedBackend, select_attention_backend
from ..attention.base import AttentionShape
from ..distributed import Group, all_reduce
from ..kv_cache import KVCache, KVCacheSpec
from ..layers import ChosenBackend, RMSNorm
from .selection import ChoosesBackends
from .tensor_parallel import local_size, split_dim, tp_slice

# how a tensor-parallel rank splits each linear's checkpoint weight: by output rows (0, column
# parallel) or by input columns (1, row parallel, its output all-reduced over the TP group)
TP_SPLIT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}


@dataclass(frozen=True)
class LlamaConfig:
    """Llama-style model arguments (checkpoint key names); the defaults are a tiny test model."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LlamaConfig":
        """A checkpoint's ``config.json`` (transformers' ``LlamaConfig`` keys); unknown keys are
        ignored, what this model does not compute is a ``ValueError`` naming the key."""
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ValueError(f"Llama config is missing required key(s): {', '.join(missing)}")
        _check_supported(d)
        heads = int(d["num_attention_heads"])
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        kv_heads = int(d.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"Llama config: num_attention_heads={heads} is not a multiple of "
                             f"num_key_value_heads={kv_heads}")
        optional = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False}
        kwargs = {k: d[k] for k in _REQUIRED} | {k: d[k] if d.get(k) is not None else v for k, v in optional.items()}
        return cls(**kwargs, num_key_value_heads=kv_heads, head_dim=int(head_dim), rope_theta=_rope_theta(d))


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
ARCHITECTURE = "LlamaForCausalLM"


def _check_supported(d: Mapping[str, Any]) -> None:
    arch = d.get("architectures")
    if arch and list(arch) != [ARCHITECTURE]:
        raise ValueError(f"Llama config: architectures={list(arch)} is not [{ARCHITECTURE!r}]")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ValueError(f"Llama config: {key}=true is not supported (the model's projections have no biases)")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"Llama config: hidden_act={d['hidden_act']!r} is not supported; the MLP is SiLU-gated")
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if rope is None:
            continue
        if not isinstance(rope, Mapping):
            raise TypeError(f"Llama config: {key} must be a dict or null, got {type(rope).__name__}")
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise ValueError(f"Llama config: {key}.rope_type={kind!r} is not supported: only plain rope "
                             "(rope_type 'default', no rope scaling)")
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"Llama config: {key}.partial_rotary_factor={rope['partial_rotary_factor']} "
                             "is not supported: rope covers the whole head")


def _rope_theta(d: Mapping[str, Any]) -> float:
    """``rope_parameters.rope_theta`` (transformers 5) or the top-level ``rope_theta`` (older)."""
    theta = (d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta"))
    return float(theta if theta is not None else 10000.0)


def rotate_neox(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotary embedding, half-split layout: ``[T, H, D]`` by ``positions [T]``."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * inv_freq  # [T, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class LlamaAttention(ChosenBackend, nn.Module):
    """GQA self-attention: writes k/v into the tuple cache, then paged decode / prefill. Under
    tensor parallelism this rank's heads and kv heads only (``tp``), ``o_proj`` all-reduced."""

    def __init__(self, cfg: LlamaConfig, tp: Group = Group.single()) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        self.num_heads = local_size(cfg.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = local_size(cfg.num_key_value_heads, tp, "num_key_value_heads")
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.use_backend()

    def _choose_backend(self, name: str | None) -> PagedBackend:
        weight, cfg = self.q_proj.weight, self.cfg
        shape = AttentionShape(self.num_heads, self.num_kv_heads, cfg.head_dim)
        return select_attention_backend("paged", weight.device, weight.dtype, name, shape)

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache, meta: AttentionMetadata) -> Tensor:
        cfg, t = self.cfg, x.shape[0]
        q = rotate_neox(self.q_proj(x).view(t, -1, cfg.head_dim), positions, cfg.rope_theta)  # [T, Hq, D]
        k = rotate_neox(self.k_proj(x).view(t, -1, cfg.head_dim), positions, cfg.rope_theta)  # [T, Hk, D]
        v = self.v_proj(x).view(t, -1, cfg.head_dim)
        self.backend.write(cache, k, v, meta.slot_mapping)
        scale = cfg.head_dim ** -0.5
        n_dec = meta.num_decode_tokens
        outs = []
        if meta.decode is not None:
            outs.append(self.backend.decode(q[:n_dec], cache, meta.decode, scale))
        if meta.prefill is not None:
            outs.append(self.backend.prefill(q[n_dec:], cache, meta.prefill, scale))
        return all_reduce(self.o_proj(torch.cat(outs).reshape(t, -1)), self.tp)  # [T, E]


class LlamaMLP(nn.Module):
    """SiLU-gated feed-forward; under tensor parallelism this rank's ``1/tp`` of the intermediate
    features, ``down_proj`` all-reduced."""

    def __init__(self, hidden: int, inter: int, tp: Group = Group.single()) -> None:
        super().__init__()
        self.tp = tp
        inter = local_size(inter, tp, "intermediate_size")
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), self.tp)


class LlamaLayer(nn.Module):
    """Pre-norm decoder layer."""

    def __init__(self, cfg: LlamaConfig, tp: Group = Group.single()) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
        self.self_attn = LlamaAttention(cfg, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, tp)

    def forward(self, x: Tensor, positions: Tensor, cache: KVCache, meta: AttentionMetadata) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(ChoosesBackends, nn.Module):
    """Small Llama-style causal LM following the runner's step contract.

    With ``tp`` (a tensor-parallel group of ``distributed``, e.g. ``get_parallel_state().tp``) the
    model is this rank's share: its heads, kv heads and intermediate features (``TP_SPLIT``),
    embedding, norms and head replicated; ``tp_shard`` cuts a full checkpoint tensor to it."""

    def __init__(self, cfg: LlamaConfig = LlamaConfig(), tp: Group = Group.single()) -> None:
        super().__init__()
        self.config, self.tp = cfg, tp
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, torch.float32)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With ``tie_word_embeddings`` the head is the embedding, one tensor as in transformers (a
        move off the meta device, ``to_empty``, makes two: call this again afterwards)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def attention_layers(self):
        return (layer.self_attn for layer in self.layers)

    def tp_shard(self, name: str, tensor: Tensor) -> Tensor:
        """This rank's share (a view) of the full checkpoint tensor of state-dict entry ``name``."""
        return tp_slice(tensor, split_dim(name, TP_SPLIT), self.tp, name)

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """One ``KVCacheSpec`` per layer, in the model's dtype, of this rank's kv heads."""
        dtype = self.embed_tokens.weight.dtype
        return [KVCacheSpec(layer.self_attn.num_kv_heads, self.config.head_dim, dtype) for layer in self.layers]

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: tuple[KVCache, ...],
                attn_metadata: AttentionMetadata) -> Tensor:
        """``[T]`` token ids -> ``[T, E]`` final-normed hidden states."""
        x = self.embed_tokens(input_ids)
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, positions, cache, attn_metadata)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``[T, E]`` -> ``[T, vocab]`` float32 logits."""
        return self.lm_head(hidden).float()
