"""DeepSeek V2/V3 config parsing and the softmax scale.

Oracle: the public config numbers in DESIGN.md.
"""

from __future__ import annotations

import pytest

from ascend_graph.models import DeepseekConfig, softmax_scale

# config.json of the two public checkpoints, reduced to the keys the scale depends on (DESIGN.md).
V2_LITE_JSON = dict(architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048,
                    intermediate_size=10944, num_hidden_layers=27, num_attention_heads=16, q_lora_rank=None,
                    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, moe_intermediate_size=1408,
                    n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax", norm_topk_prob=False,
                    routed_scaling_factor=1.0, first_k_dense_replace=1, rope_theta=10000, rms_norm_eps=1e-6,
                    max_position_embeddings=163840,
                    rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                                      beta_slow=1, mscale=0.707, mscale_all_dim=0.707))
V3_JSON = dict(V2_LITE_JSON, architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168,
               intermediate_size=18432, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
               n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, moe_intermediate_size=2048,
               n_group=8, topk_group=4, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
               routed_scaling_factor=2.5, first_k_dense_replace=3,
               rope_scaling=dict(V2_LITE_JSON["rope_scaling"], mscale=1.0, mscale_all_dim=1.0))


@pytest.mark.parametrize("raw, expected", [(V2_LITE_JSON, 0.114721), (V3_JSON, 0.135234)])
def test_softmax_scale_includes_yarn_mscale_squared(raw, expected):
    assert softmax_scale(DeepseekConfig.from_dict(raw)) == pytest.approx(expected, abs=5e-7)


def test_rope_parameters_form_reads_like_rope_scaling_form():
    new_form = {k: v for k, v in V3_JSON.items() if k not in ("rope_scaling", "rope_theta")}
    new_form["rope_parameters"] = dict(V3_JSON["rope_scaling"], rope_type="yarn", rope_theta=10000.0)
    del new_form["rope_parameters"]["type"]
    assert DeepseekConfig.from_dict(new_form) == DeepseekConfig.from_dict(V3_JSON)


def test_transformers_v3_config_without_routing_keys_means_sigmoid_noaux_tc():
    raw = {k: v for k, v in V3_JSON.items() if k not in ("topk_method", "scoring_func")}
    config = DeepseekConfig.from_dict(raw)
    assert (config.topk_method, config.scoring_func) == ("noaux_tc", "sigmoid")


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["LlamaForCausalLM"]}, "unsupported architecture"),
    ({"scoring_func": "sqrtsoftplus"}, "unsupported scoring_func"),
    ({"topk_method": "random"}, "unsupported topk_method"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope type"),
    ({"hidden_act": "gelu"}, "unsupported hidden_act"),
    ({"n_group": 3}, "n_group=3"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
])
def test_config_rejects_unsupported_settings(change, message):
    with pytest.raises(ValueError, match=message):
        DeepseekConfig.from_dict({**V3_JSON, **change})


def test_config_names_missing_required_keys():
    raw = {k: v for k, v in V2_LITE_JSON.items() if k != "kv_lora_rank"}
    with pytest.raises(ValueError, match="kv_lora_rank"):
        DeepseekConfig.from_dict(raw)


def test_layers_before_first_k_dense_replace_are_dense():
    config = DeepseekConfig.from_dict(V3_JSON)
    assert [config.is_moe_layer(i) for i in range(5)] == [False, False, False, True, True]
