"""Tiny random transformers DeepSeek models, shared by the parity tests (needs transformers >= 5).

Importing this module requires transformers; test modules guard it with
``pytest.importorskip("transformers", minversion="5.0")`` first.
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 128
PROMPT_LENS = (5, 9, 13)


def _yarn(mscale: float, mscale_all_dim: float) -> dict:
    # A small original context so the YaRN ramp falls inside the 4 rope frequencies.
    return {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1, "mscale": mscale, "mscale_all_dim": mscale_all_dim}


def _common(**overrides) -> dict:
    # initializer_range well above the default 0.02, so that logits differ clearly between tokens.
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                num_experts_per_tok=3, first_k_dense_replace=1, max_position_embeddings=2560,
                initializer_range=0.2) | overrides


def tiny_hf_model(flavour: str, **overrides):
    """A random float32 transformers DeepSeek model: ``v2_greedy``, ``v2_group_limited`` or ``v3``.

    Three layers, the first dense. V3: query low-rank, sigmoid ``noaux_tc`` grouped routing.
    ``overrides`` replace the shared sizes (``intermediate_size=8200``: a dense MLP whose down
    projection is chunk-major in our model).
    """
    if flavour.startswith("v2"):
        method = "greedy" if flavour == "v2_greedy" else "group_limited_greedy"
        config = transformers.DeepseekV2Config(
            **_common(**overrides), q_lora_rank=None, n_shared_experts=2, n_group=4, topk_group=2, topk_method=method,
            routed_scaling_factor=1.5, norm_topk_prob=False, rope_parameters=_yarn(0.707, 0.707))
        cls = transformers.DeepseekV2ForCausalLM
    else:  # V3: query low-rank, sigmoid noaux_tc grouped routing; mscale != mscale_all_dim scales cos/sin
        config = transformers.DeepseekV3Config(
            **_common(**overrides), q_lora_rank=24, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
            norm_topk_prob=True, rope_parameters=_yarn(1.0, 0.8))
        cls = transformers.DeepseekV3ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():  # norms start at one and the routing bias at zero: make both matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


def random_prompts(seed: int = 1, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    """Seeded random prompts of the given lengths over the tiny vocabulary."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lens]
