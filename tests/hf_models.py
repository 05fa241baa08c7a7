"""Tiny random transformers DeepSeek models, shared by the parity tests (needs transformers >= 5).

Importing this module requires transformers; test modules guard it with
``pytest.importorskip("transformers", minversion="5.0")`` first.
"""

from __future__ import annotations

import json

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


def tiny_v3_with_mtp(path, repeat: bool = False, **overrides) -> transformers.PreTrainedModel:
    """Write a tiny V3 checkpoint with one multi-token-prediction layer into ``path`` (per-expert
    tensors, as published) and return the transformers model whose first layers are its target.

    The MTP block is transformers' last layer of a model built one layer deeper; its own tensors are
    random, its copies of the embedding and head the target's (as DeepSeek-V3 ships them). With
    ``repeat`` the MTP layer drafts the token it is given (block silenced, ``eh_proj`` passing the
    embedding, head = embedding): accepted wherever the target repeats a token.
    """
    from safetensors.torch import save_file

    layers = overrides.pop("num_hidden_layers", 2)
    full = tiny_hf_model("v3", num_hidden_layers=layers + 1, **overrides)
    gen, e = torch.Generator().manual_seed(3), full.config.hidden_size
    own = {"enorm.weight": 1 + 0.1 * torch.randn(e, generator=gen), "hnorm.weight": 1 + 0.1 * torch.randn(e, generator=gen),
           "eh_proj.weight": torch.randn(e, 2 * e, generator=gen) * 0.2,
           "shared_head.norm.weight": 1 + 0.1 * torch.randn(e, generator=gen)}
    block = full.model.layers[layers]
    if repeat:
        own.update({"enorm.weight": torch.ones(e), "shared_head.norm.weight": torch.ones(e),
                    "eh_proj.weight": torch.cat([torch.eye(e), torch.zeros(e, e)], 1)})
        with torch.no_grad():
            full.lm_head.weight.copy_(full.model.embed_tokens.weight)
            for w in (block.self_attn.o_proj.weight, block.mlp.experts.down_proj, block.mlp.shared_experts.down_proj.weight):
                w.zero_()
    own |= {"embed_tokens.weight": full.model.embed_tokens.weight, "shared_head.head.weight": full.lm_head.weight}
    state = {n: t for n, t in full.state_dict().items() if not n.startswith(f"model.layers.{layers}.")}
    state |= {f"model.layers.{layers}.{n}": t for n, t in (*block.state_dict().items(), *own.items())}
    tensors = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for x, w in enumerate(t):
                tensors[f"{prefix}.{x}.gate_proj.weight"], tensors[f"{prefix}.{x}.up_proj.weight"] = w.chunk(2)
        elif leaf == "down_proj" and prefix.endswith("experts"):
            tensors.update({f"{prefix}.{x}.down_proj.weight": w for x, w in enumerate(t)})
        else:
            tensors[name] = t
    save_file({n: t.detach().clone().contiguous() for n, t in tensors.items()}, f"{path}/model.safetensors")
    config = full.config.to_dict() | {"num_hidden_layers": layers, "num_nextn_predict_layers": 1,
                                      "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                                      "architectures": ["DeepseekV3ForCausalLM"], "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    return full
