"""One DeepSeek V2/V3 decoder layer: multi-head latent attention (``MLAttention``) over the
layer's ``MLACache(kv_c, k_pe)``, then a dense MLP or a mixture of experts (``DecoderLayer``).
Shapes, weight forms and tensor-parallel splits: ``deepseek.py``'s module docstring."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..attention import AttentionMetadata, MLABackend, select_attention_backend
from ..attention.base import AttentionShape
from ..distributed import Group, all_reduce
from ..kv_cache import MLACache
from ..layers import ChosenBackend, RMSNorm, linear
from ..moe import MLP, MoE
from .deepseek_config import DeepseekConfig
from .rope import softmax_scale
from .tensor_parallel import local_size

_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the default eps, not rms_norm_eps


class MLAttention(ChosenBackend, nn.Module):
    """Multi-head latent attention of one layer: writes the new tokens' latent and rope key into
    the layer's cache, then runs absorbed MLA for decode rows and plain MLA for prefills."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, device=None, tp: Group = Group.single()) -> None:
        super().__init__()
        e, bias, self.tp = config.hidden_size, config.attention_bias, tp
        h = local_size(config.num_attention_heads, tp, "num_attention_heads")  # this rank's heads
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
        self.backend: MLABackend = self.use_backend()
        # derived from kv_b_proj.weight by process_weights_after_loading(); never in the state dict
        self.register_buffer("w_uk_t", None, persistent=False)  # [H, C, Dn]
        self.register_buffer("w_uv", None, persistent=False)  # [H, Dv, C]
        self.register_load_state_dict_post_hook(_rebuild_after_load)

    @property
    def cached_rope_layout(self) -> str:
        """How this layer's ``k_pe`` lies in its cache (``MLABackend.cached_rope_layout``)."""
        return self.backend.cached_rope_layout(self.rope_interleave)

    def _choose_backend(self, name: str | None) -> MLABackend:
        weight = self.kv_a_proj_with_mqa.weight
        shape = AttentionShape(self.num_heads, 1, self.qk_nope_head_dim + self.qk_rope_head_dim, self.kv_lora_rank,
                               self.qk_rope_head_dim, self.v_head_dim)
        return select_attention_backend("mla", weight.device, weight.dtype, name, shape)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Build ``w_uk_t`` and ``w_uv`` from ``kv_b_proj.weight`` (``kv_b_parts``)."""
        self.w_uk_t, self.w_uv = kv_b_parts(self.kv_b_proj.weight.detach(), self.num_heads, self.qk_nope_head_dim,
                                            self.v_head_dim)

    def _query(self, x: Tensor) -> Tensor:
        if not self.q_lora:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: MLACache, meta: AttentionMetadata) -> Tensor:
        """``x [T, E]`` -> ``[T, E]``; writes the ``T`` new tokens into ``cache`` first."""
        if self.w_uv is None:  # before the cache write: a failed step leaves the cache as it was
            raise RuntimeError("MLAttention's W_UK / W_UV are not built: call process_weights_after_loading()")
        t, h = x.shape[0], self.num_heads
        dn, r, c = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        q_nope, q_pe = self._query(x).view(t, h, dn + r).split([dn, r], dim=-1)  # [T, H, Dn], [T, H, R]
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([c, r], dim=-1)  # [T, C], [T, R]
        q_pe = self.backend.rope_query(q_pe, cos, sin, self.rope_interleave)
        cache = self.backend.write_latent(cache, kv_c, k_pe, self.kv_a_layernorm, cos, sin, meta.slot_mapping,
                                          self.rope_interleave)  # read what the write returns
        w_uk, w_uv = self.w_uk_t.transpose(1, 2), self.w_uv  # [H, Dn, C], [H, Dv, C]
        n_dec, outs = meta.num_decode_tokens, []
        if meta.decode is not None:
            outs.append(self.backend.decode(q_nope[:n_dec], q_pe[:n_dec], cache, meta.decode, w_uk, w_uv, self.scale))
        if meta.prefill is not None:
            outs.append(self.backend.prefill(q_nope[n_dec:], q_pe[n_dec:], cache, meta.prefill, w_uk, w_uv,
                                             self.scale))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)  # [T, H, Dv]
        return all_reduce(self.o_proj(out.flatten(1)), self.tp)  # [T, E]


def kv_b_parts(weight: Tensor, h: int, dn: int, dv: int) -> tuple[Tensor, Tensor]:
    """A checkpoint's ``kv_b_proj.weight`` (``[H*(Dn + Dv), C]``, rows per head: ``W_UK`` then
    ``W_UV``) -> ``(W_UK transposed [H, C, Dn], W_UV [H, Dv, C])``, new contiguous tensors."""
    per_head = weight.view(h, dn + dv, weight.shape[1])  # [H, Dn + Dv, C]
    return per_head[:, :dn].transpose(1, 2).contiguous(), per_head[:, dn:].contiguous()


def _earlier_kv_b_order(draw: Tensor, h: int, dn: int, dv: int) -> Tensor:
    """``draw [H*Dn + H*Dv, C]`` read as earlier versions laid ``kv_b_proj.weight`` out (every
    head's ``W_UK`` transposed, ``[H, C, Dn]``, then every head's ``W_UV``, ``[H, Dv, C]``), in
    the checkpoint's order (per head ``W_UK`` then ``W_UV``): the seeded models, and the results
    recorded with them, stay the same."""
    c = draw.shape[1]
    uk_t, uv = draw[:h * dn].reshape(h, c, dn), draw[h * dn:].reshape(h, dv, c)
    return torch.cat([uk_t.transpose(1, 2), uv], dim=1).reshape(h * (dn + dv), c)


def _rebuild_after_load(module: MLAttention, incompatible_keys) -> None:
    """``load_state_dict`` post-hook: the derived forms follow the loaded ``kv_b_proj.weight``."""
    module.process_weights_after_loading()


class DecoderLayer(nn.Module):
    """Pre-norm block: latent attention, then a dense MLP or a mixture of experts."""

    def __init__(self, config: DeepseekConfig, layer: int, dtype: torch.dtype, device=None,
                 tp: Group = Group.single(), dp: Group = Group.single(), ep: Group = Group.single()) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, dtype, device, tp)
        self.mlp: nn.Module = (MoE(config, dtype, device, tp=tp, dp=dp, ep=ep) if config.is_moe_layer(layer)
                               else MLP(config.hidden_size, config.intermediate_size, dtype, device, tp))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: MLACache, meta: AttentionMetadata,
                valid: Optional[Tensor] = None) -> Tensor:
        """``valid [T]`` bool: which rows are not padding (None: all), for the MoE."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):  # a step with a prefill runs eager
            return x + self.mlp(h, prefill=meta.prefill is not None, valid=valid)
        return x + self.mlp(h)
