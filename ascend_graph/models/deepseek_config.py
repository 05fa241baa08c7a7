"""DeepSeek V2/V3 model arguments, read from a checkpoint's ``config.json``.

Field names are the checkpoint's own keys. Two spellings of the rope settings exist in the wild:
published checkpoints write ``rope_scaling`` (with ``rope_theta`` at the top level); recent
transformers releases save ``rope_parameters`` (with ``rope_theta`` inside). ``from_dict``
accepts both and stores one form: ``rope_theta`` plus ``rope_scaling`` (``None`` = plain rope).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Optional

SUPPORTED_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_MODEL_TYPES = {"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class RopeScaling:
    """YaRN settings (the ``rope_scaling`` entry); names and defaults as DeepSeek's own code."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    attention_factor: Optional[float] = None  # overrides the mscale ratio on cos/sin when set
    truncate: bool = True
    type: str = "yarn"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], max_position_embeddings: int) -> Optional["RopeScaling"]:
        """Parse a ``rope_scaling`` / ``rope_parameters`` dict; ``None`` for plain rope."""
        kind = d.get("rope_type", d.get("type", "default"))
        if kind in (None, "default"):
            return None
        if kind != "yarn":
            raise ValueError(f"unsupported rope type {kind!r}: DeepSeek V2/V3 use 'yarn' (or plain rope)")
        orig = d.get("original_max_position_embeddings") or max_position_embeddings
        factor = d.get("factor") or max_position_embeddings / orig
        names = {f.name for f in fields(cls)} - {"factor", "original_max_position_embeddings", "type"}
        extra = {k: d[k] for k in names if d.get(k) is not None}
        return cls(factor=float(factor), original_max_position_embeddings=int(orig), **extra)


@dataclass(frozen=True)
class QuantizationConfig:
    """Block-scaled FP8 weights (``quantization_config`` of DeepSeek-V3): dequantized at load."""

    quant_method: str = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantizationConfig":
        if d.get("quant_method") != "fp8":
            raise ValueError(f"unsupported quantization_config.quant_method {d.get('quant_method')!r}: "
                             "only block-scaled 'fp8' checkpoints are supported")
        block = tuple(d.get("weight_block_size") or (128, 128))
        if len(block) != 2:
            raise ValueError(f"quantization_config.weight_block_size must have 2 entries, got {list(block)}")
        return cls("fp8", (int(block[0]), int(block[1])))


@dataclass(frozen=True)
class DeepseekConfig:
    """DeepSeek V2/V3 arguments under their ``config.json`` names (the first nine are required)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: Optional[int] = None
    n_routed_experts: Optional[int] = None  # None: every layer is dense
    n_shared_experts: Optional[int] = None
    num_experts_per_tok: Optional[int] = None
    moe_intermediate_size: Optional[int] = None
    n_group: Optional[int] = None
    topk_group: Optional[int] = None
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScaling] = None
    rope_interleave: bool = True  # DeepSeek's pair layout (x0, x1), (x2, x3), ...
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    initializer_range: float = 0.02
    quantization_config: Optional[QuantizationConfig] = None
    num_nextn_predict_layers: int = 0  # V3's multi-token-prediction layers (models/mtp.py)
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int | tuple[int, ...]] = None
    architectures: tuple[str, ...] = field(default=("DeepseekV2ForCausalLM",))

    def __post_init__(self) -> None:
        _validate(self)

    # -- derived sizes ------------------------------------------------------------------------

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_groups(self) -> int:
        """Expert groups (``n_group``; 1 when unset)."""
        return self.n_group or 1

    def is_moe_layer(self, layer: int) -> bool:
        """Layer ``layer`` has routed experts (else a dense SiLU-gated MLP)."""
        return (self.n_routed_experts is not None and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeepseekConfig":
        """Build from a ``config.json`` dict; unknown keys are ignored, unsupported ones rejected."""
        d = dict(d)
        arch = _architecture(d)
        if arch == "DeepseekV3ForCausalLM":  # transformers' V3 config saves neither key
            d.setdefault("topk_method", "noaux_tc")
            d.setdefault("scoring_func", "sigmoid")
        max_pos = d.get("max_position_embeddings", 4096)
        rope = d.get("rope_parameters") or None
        theta = d.get("rope_theta")
        if rope is not None:
            theta = rope.get("rope_theta", theta)
        else:
            rope = d.get("rope_scaling") or {}
        if d.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported: DeepSeek's MLPs have no biases")
        known = {f.name for f in fields(cls)} - {"rope_scaling", "quantization_config", "architectures",
                                                "rope_theta"}
        missing = [k for k in _REQUIRED if k not in d]
        if missing:
            raise ValueError(f"config is missing required key(s): {', '.join(missing)}")
        kwargs = {k: v for k, v in d.items() if k in known and v is not None}
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = tuple(kwargs["eos_token_id"])
        quant = d.get("quantization_config")
        return cls(**kwargs, rope_theta=float(theta if theta is not None else 10000.0),
                   rope_scaling=RopeScaling.from_dict(rope, max_pos),
                   quantization_config=QuantizationConfig.from_dict(quant) if quant else None,
                   architectures=(arch,))

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "DeepseekConfig":
        """Read ``config.json`` (a file, or a checkpoint directory that holds one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def small(cls, **overrides: Any) -> "DeepseekConfig":
        """A tiny DeepSeek-V2-Lite-shaped model for demos and tests.

        Three layers (the first dense, then MoE with 8 routed + 2 shared experts, top-2, softmax
        greedy routing), no query low-rank (``q_lora_rank=None``), V2-Lite's YaRN rope settings,
        vocabulary 256, hidden size 64, 4 heads. ``overrides`` replace any field.
        """
        base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                    num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                    v_head_dim=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
                    moe_intermediate_size=32, first_k_dense_replace=1, max_position_embeddings=163840,
                    rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                             mscale=0.707, mscale_all_dim=0.707),
                    initializer_range=0.1)
        return cls(**{**base, **overrides})

    @classmethod
    def small_v3(cls, **overrides: Any) -> "DeepseekConfig":
        """A tiny DeepSeek-V3-shaped model: query low-rank, sigmoid ``noaux_tc`` grouped routing,
        one multi-token-prediction layer (built where a model asks for ``mtp_layers``)."""
        base = dict(q_lora_rank=24, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                    n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid",
                    norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=1,
                    rope_scaling=RopeScaling(factor=40.0, original_max_position_embeddings=4096,
                                             mscale=1.0, mscale_all_dim=1.0),
                    architectures=("DeepseekV3ForCausalLM",))
        return cls.small(**{**base, **overrides})


def _architecture(d: Mapping[str, Any]) -> str:
    """The one supported architecture named by ``architectures`` (or ``model_type``)."""
    archs = d.get("architectures") or []
    if not archs and d.get("model_type") in _MODEL_TYPES:
        archs = [_MODEL_TYPES[d["model_type"]]]
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {archs or d.get('model_type')!r}: "
                         f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _validate(c: DeepseekConfig) -> None:
    """Reject configurations this implementation does not compute correctly."""
    if len(c.architectures) != 1 or c.architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architectures {list(c.architectures)}: "
                         f"expected one of {', '.join(SUPPORTED_ARCHITECTURES)}")
    if c.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {c.hidden_act!r}: only 'silu' is supported")
    if c.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even, got {c.qk_rope_head_dim}")
    if c.n_routed_experts is None:
        return
    if c.scoring_func not in SCORING_FUNCS:
        raise ValueError(f"unsupported scoring_func {c.scoring_func!r}: expected one of {SCORING_FUNCS}")
    if c.topk_method not in TOPK_METHODS:
        raise ValueError(f"unsupported topk_method {c.topk_method!r}: expected one of {TOPK_METHODS}")
    if not c.num_experts_per_tok or not c.moe_intermediate_size:
        raise ValueError("num_experts_per_tok and moe_intermediate_size are required with n_routed_experts")
    groups, top_groups = c.num_groups, c.topk_group or 1
    if c.n_routed_experts % groups or not 1 <= top_groups <= groups:
        raise ValueError(f"n_routed_experts={c.n_routed_experts} must split into n_group={groups} groups "
                         f"and 1 <= topk_group={top_groups} <= n_group")
    if c.num_experts_per_tok > top_groups * (c.n_routed_experts // groups):
        raise ValueError(f"num_experts_per_tok={c.num_experts_per_tok} exceeds the experts in "
                         f"topk_group={top_groups} groups")
    if c.topk_method == "noaux_tc" and c.n_routed_experts // groups < 2:
        raise ValueError("topk_method='noaux_tc' scores groups by their top-2 experts: "
                         "each group needs at least 2 experts")
    if c.moe_layer_freq < 1:
        raise ValueError(f"moe_layer_freq must be >= 1, got {c.moe_layer_freq}")
