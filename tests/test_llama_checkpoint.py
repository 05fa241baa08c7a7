"""transformers ``LlamaForCausalLM`` checkpoints in ascend_graph's Llama: the config read by
``LlamaConfig.from_dict``, the tensors by ``models.llama_loader``, and the logits against
transformers' own float32 forward (the oracle) at every position, prefill and decode steps alike.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")
import torch  # noqa: E402

from ascend_graph.config import GraphConfig  # noqa: E402
from ascend_graph.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from ascend_graph.models.llama_loader import load_llama_weights  # noqa: E402
from ascend_graph.models.loader import CheckpointError  # noqa: E402
from ascend_graph.runner import GraphRunner, SequenceStep  # noqa: E402

BLOCK = 4
HF_SIZES = dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-5,
                initializer_range=0.2, rope_parameters={"rope_type": "default", "rope_theta": 500.0})


def hf_llama(tie: bool, **overrides) -> "transformers.LlamaForCausalLM":
    """A seeded random transformers Llama (norm weights moved off one, so that they matter)."""
    config = transformers.LlamaConfig(**{**HF_SIZES, **overrides}, tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def ours_from(hf) -> LlamaForCausalLM:
    model = LlamaForCausalLM(LlamaConfig.from_dict(hf.config.to_dict()))
    load_llama_weights(model, hf.state_dict().items())
    return model.eval()


@pytest.mark.parametrize("tie", [False, True])
def test_logits_equal_transformers_at_every_position(tie):
    hf = hf_llama(tie)
    ours = ours_from(hf)
    assert ours.config.head_dim == 32 and ours.config.rope_theta == 500.0 and ours.config.rms_norm_eps == 1e-5
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == tie
    ids = torch.randint(0, HF_SIZES["vocab_size"], (13,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]  # [13, V]
    runner = GraphRunner(ours, GraphConfig(enabled=False), num_blocks=8, block_size=BLOCK, max_model_len=32)
    blocks, prompt = [1, 2, 3, 4], 6
    got = [runner.execute([SequenceStep(ids[:prompt], 0, blocks[:2])])[0]]  # prefill: logits of token 5
    for i in range(prompt, len(ids)):  # a decode step per further token
        got.append(runner.execute([SequenceStep([ids[i]], i, blocks[: i // BLOCK + 1])])[0])
    torch.testing.assert_close(torch.stack(got), expected[prompt - 1:], atol=1e-4, rtol=1e-4)


def test_a_checkpoint_without_head_dim_takes_hidden_over_heads():
    d = {k: v for k, v in hf_llama(False).config.to_dict().items() if k != "head_dim"}
    assert LlamaConfig.from_dict(d).head_dim == 16
    legacy = {**d, "rope_parameters": None, "rope_theta": 1234.0, "rope_scaling": None}
    assert LlamaConfig.from_dict(legacy).rope_theta == 1234.0


@pytest.mark.parametrize("update, named", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}, "rope_parameters.rope_type"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"architectures": ["MistralForCausalLM"]}, "architectures"),
    ({"vocab_size": None}, "vocab_size"),
])
def test_what_the_model_does_not_compute_fails_naming_the_key(update, named):
    with pytest.raises(ValueError, match=named):
        LlamaConfig.from_dict({**hf_llama(False).config.to_dict(), **update})


def test_bad_tensors_fail_naming_them():
    hf = hf_llama(False)
    state = dict(hf.state_dict())
    model = LlamaForCausalLM(LlamaConfig.from_dict(hf.config.to_dict()))
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model.layers.1.mlp.up_proj.weight"):
        load_llama_weights(model, missing.items())
    extra = {**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}
    with pytest.raises(CheckpointError, match="unexpected tensor.*q_proj.bias"):
        load_llama_weights(model, extra.items())
    wrong = {**state, "model.norm.weight": torch.ones(63)}
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \[63\]"):
        load_llama_weights(model, wrong.items())
