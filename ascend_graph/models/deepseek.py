"""DeepSeek V2/V3 decoder over per-layer ``MLACache(kv_c, k_pe)`` tuple caches.

Shape legend: T tokens in the step (decode rows first, then prefill tokens), E hidden size,
H heads, Dn qk_nope_head_dim, R qk_rope_head_dim, Dv v_head_dim, C kv_lora_rank,
Q q_lora_rank, V vocabulary.

Parameter names are the checkpoint's (``model.layers.N.self_attn.kv_b_proj.weight``, ...), except
that routed experts are stacked per layer (``mlp.experts.gate_up_proj [X, 2I, E]``,
``mlp.experts.down_proj [X, E, I]``); ``loader.py`` maps checkpoint tensors onto them.
On CPU a linear with more than ``runtime.LONG_REDUCTION`` input features (V2-Lite's dense
down projection, most of V3's) is a ``layers.ChunkedLinear``: its ``weight`` is ``[N, C, K/C]``,
the checkpoint's ``[N, K]`` viewed, stored chunk-major.
``kv_b_proj.weight`` keeps its name and shape (``[H*Dn + H*Dv, C]``) but not the checkpoint's
order (``[H, Dn + Dv, C]``, each head's ``W_UK`` rows then its ``W_UV`` rows; see
``kv_b_from_checkpoint``): it holds every head's ``W_UK`` transposed, ``[H, C, Dn]``, then every
head's ``W_UV``, ``[H, Dv, C]``. Each part is then one contiguous batch of matrices, which the
absorbed attention's batched matmuls read in place (sliced per head they were copied on every
call: V2-Lite dims, batch 8, 1.1 ms per layer and step for ``W_UV`` alone), and both products
reduce along contiguous memory: ``q_nope [H, B, Dn] @ W_UK`` runs over rows of ``Dn``, as
``o_lat @ W_UV.T`` runs over rows of ``C``. With ``W_UK`` stored ``[H, Dn, C]`` instead (rows of
``C`` summed down a column), the product was the slow one in both modes. Measured (torch 2.13, 1
thread, Zen 3 with AVX2, V2-Lite dims, 16 heads, weights read from memory, one-off): eager's
``bmm`` at batch 1 1.73 -> 0.40 ms, at batch 32 52 -> 12 ms; the compiled step's fused
reduction at batch 1 0.29 -> 0.16 ms per layer (profiled); whole V2-Lite-slice step at batch 1,
eager 86.3 -> 83.2 ms, graph within noise (40.7 / 41.4 ms, interleaved).
The model never chooses graph or eager: the runner compiles ``forward`` or not.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..attention import AttentionMetadata, MLABackend, select_attention_backend
from ..kv_cache import MLACache, MLACacheSpec
from .deepseek_config import DeepseekConfig
from ..layers import RMSNorm, linear
from ..moe import MLP, MoE
from .selection import ChoosesBackends
from .rope import RotaryEmbedding, apply_rope, softmax_scale

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps, not rms_norm_eps


class MLAttention(nn.Module):
    """Multi-head latent attention of one layer: writes the new tokens' latent and rope key into
    the layer's cache, then runs absorbed MLA for decode rows and plain MLA for prefills."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        e, h, bias = config.hidden_size, config.num_attention_heads, config.attention_bias
        self.num_heads, self.kv_lora_rank = h, config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.rope_interleave = config.v_head_dim, config.rope_interleave
        self.scale = softmax_scale(config)
        q_out = h * config.qk_head_dim
        self.q_lora = config.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = linear(e, q_out, dtype, device)
        else:
            self.q_a_proj = linear(e, config.q_lora_rank, dtype, device, bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, _LATENT_NORM_EPS, dtype, device)
            self.q_b_proj = linear(config.q_lora_rank, q_out, dtype, device)
        self.kv_a_proj_with_mqa = linear(e, config.kv_lora_rank + config.qk_rope_head_dim, dtype, device, bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, _LATENT_NORM_EPS, dtype, device)
        self.kv_b_proj = linear(config.kv_lora_rank, h * (config.qk_nope_head_dim + config.v_head_dim),
                                dtype, device)
        self.o_proj = linear(h * config.v_head_dim, e, dtype, device, bias)
        self.backend: MLABackend = select_attention_backend("mla", self.kv_a_proj_with_mqa.weight.device, dtype)

    def _query(self, x: Tensor) -> Tensor:
        if not self.q_lora:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: MLACache, meta: AttentionMetadata) -> Tensor:
        """``x [T, E]`` -> ``[T, E]``; writes the ``T`` new tokens into ``cache`` first."""
        t, h = x.shape[0], self.num_heads
        dn, r, c = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        q_nope, q_pe = self._query(x).view(t, h, dn + r).split([dn, r], dim=-1)  # [T, H, Dn], [T, H, R]
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([c, r], dim=-1)  # [T, C], [T, R]
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe = apply_rope(q_pe, cos, sin, self.rope_interleave)
        k_pe = apply_rope(k_pe[:, None, :], cos, sin, self.rope_interleave)  # [T, 1, R]
        self.backend.write(cache, kv_c[:, None, :], k_pe, meta.slot_mapping)
        w_uk, w_uv = kv_b_parts(self.kv_b_proj.weight, h, dn, self.v_head_dim)
        n_dec, outs = meta.num_decode_tokens, []
        if meta.decode is not None:
            outs.append(self.backend.decode(q_nope[:n_dec], q_pe[:n_dec], cache, meta.decode, w_uk, w_uv, self.scale))
        if meta.prefill is not None:
            outs.append(self.backend.prefill(q_nope[n_dec:], q_pe[n_dec:], cache, meta.prefill, w_uk, w_uv,
                                             self.scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, H, Dv]
        return self.o_proj(out.flatten(1))


def kv_b_parts(weight: Tensor, h: int, dn: int, dv: int) -> tuple[Tensor, Tensor]:
    """``W_UK [H, Dn, C]`` and ``W_UV [H, Dv, C]``, views of the model's ``kv_b_proj.weight``:
    ``W_UV`` contiguous, ``W_UK`` the transpose of a contiguous ``[H, C, Dn]``."""
    c = weight.shape[1]
    return weight[:h * dn].view(h, c, dn).transpose(1, 2), weight[h * dn:].view(h, dv, c)


def kv_b_from_checkpoint(weight: Tensor, h: int, dn: int, dv: int) -> Tensor:
    """A checkpoint's ``kv_b_proj.weight`` (rows per head: ``[H, Dn + Dv, C]``) in the model's
    layout: every head's ``W_UK`` transposed (``[H, C, Dn]``), then every head's ``W_UV``, as
    ``[H*Dn + H*Dv, C]``."""
    c = weight.shape[1]
    uk, uv = weight.view(h, dn + dv, c).split([dn, dv], dim=1)
    return torch.cat([uk.transpose(1, 2).reshape(h * dn, c), uv.reshape(h * dv, c)])


def kv_b_to_checkpoint(weight: Tensor, h: int, dn: int, dv: int) -> Tensor:
    """The inverse of ``kv_b_from_checkpoint``: rows back per head, as checkpoints store them."""
    uk, uv = kv_b_parts(weight, h, dn, dv)
    return torch.cat([uk, uv], dim=1).reshape(h * (dn + dv), weight.shape[1])


class DecoderLayer(nn.Module):
    """Pre-norm block: latent attention, then a dense MLP or a mixture of experts."""

    def __init__(self, config: DeepseekConfig, layer: int, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, dtype, device)
        self.mlp: nn.Module = (MoE(config, dtype, device) if config.is_moe_layer(layer)
                               else MLP(config.hidden_size, config.intermediate_size, dtype, device))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: MLACache, meta: AttentionMetadata) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            return x + self.mlp(h, prefill=meta.prefill is not None)  # a step with a prefill runs eager
        return x + self.mlp(h)


class DeepseekModel(nn.Module):
    """Embedding, decoder layers and the final norm (``model.*`` in the checkpoint)."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, device=None) -> None:
        super().__init__()
        self.embed_tokens = nn.utils.skip_init(nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype,
                                               device=torch.get_default_device() if device is None else device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, device)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: tuple[MLACache, ...],
                attn_metadata: AttentionMetadata) -> Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model has {len(self.layers)}")
        x = self.embed_tokens(input_ids)  # [T, E]
        cos, sin = self.rotary_emb(positions)  # [T, R/2] each, shared by all layers
        for layer, cache in zip(self.layers, kv_caches):
            x = layer(x, cos, sin, cache, attn_metadata)
        return self.norm(x)


class DeepseekForCausalLM(ChoosesBackends, nn.Module):
    """DeepSeek V2/V3 for decoding with tuple MLA caches.

    Attention and MoE run the backends chosen for the weights (``select_backends``, ``backends``).

    ``forward`` returns the final-normed hidden states; ``compute_logits`` applies ``lm_head``
    (so a runner can pick the rows it needs before the vocabulary projection). Weights are created
    in ``dtype`` on ``device``; with ``init_weights`` they are seeded-random (normal with
    ``config.initializer_range``, norms one), otherwise left for a loader to fill.
    """

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, init_weights: bool = True, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config, dtype, device)
        self.lm_head = linear(config.hidden_size, config.vocab_size, dtype, device,
                              chunked=not config.tie_word_embeddings)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if init_weights:
            self.init_random_weights_(seed)

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype (routing and rope frequencies stay float32 regardless)."""
        return self.model.embed_tokens.weight.dtype

    attention_kind = "mla"

    def attention_layers(self):
        return (layer.self_attn for layer in self.model.layers)

    def kv_cache_specs(self) -> list[MLACacheSpec]:
        """One ``MLACacheSpec`` per layer, in the model's dtype."""
        spec = MLACacheSpec(self.config.kv_lora_rank, self.config.qk_rope_head_dim, self.dtype)
        return [spec] * self.config.num_hidden_layers

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: tuple[MLACache, ...],
                attn_metadata: AttentionMetadata) -> Tensor:
        """``input_ids [T]``, ``positions [T]`` (int64) -> final-normed hidden states ``[T, E]``.

        Tokens are ordered as ``attn_metadata`` says: decode rows first, then prefill sequences.
        Each layer writes its new ``kv_c``/``k_pe`` into ``kv_caches[layer]`` in place.
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``hidden [T, E]`` (from ``forward``) -> float32 logits ``[T, V]``."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def init_random_weights_(self, seed: int = 0, std: float | None = None) -> None:
        """Seeded random weights (drawn on the CPU, so equal on every device): matrices
        ``normal(0, std or config.initializer_range)``, biases zero, norm weights one."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range if std is None else std
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))
            else:
                p.fill_(0.0 if name.endswith(".bias") else 1.0)
