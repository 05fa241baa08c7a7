"""Loading DeepSeek HF checkpoints (safetensors, sharded, FP8), without transformers.

Oracles: the seeded model the checkpoint was written from (its state dict, experts split one by
one in ``checkpoints.py``), and block-by-block loops for FP8 dequantisation.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from ascend_graph.distributed import Group
from ascend_graph.layers import ChunkedLinear
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM, load_deepseek
from ascend_graph.models.loader import CheckpointError
from checkpoints import SMALL_JSON, hf_named_tensors, write_checkpoint


@pytest.fixture
def small_model():
    return DeepseekForCausalLM(DeepseekConfig.from_dict(SMALL_JSON), seed=7)


def assert_same_weights(a: DeepseekForCausalLM, b: DeepseekForCausalLM):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_sharded_checkpoint_with_mtp_layer_loads_every_weight(tmp_path, small_model):
    tensors = hf_named_tensors(small_model)
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(4, 4)  # a V3 multi-token-prediction layer
    write_checkpoint(tmp_path, tensors, shards=3)
    assert_same_weights(load_deepseek(tmp_path), small_model)


def test_long_checkpoint_rows_load_into_a_chunk_major_weight(tmp_path):
    config = {**SMALL_JSON, "intermediate_size": 8200}  # the dense down projection: 4 chunks of 2050
    model = DeepseekForCausalLM(DeepseekConfig.from_dict(config), seed=3)
    tensors = hf_named_tensors(model)
    assert tensors["model.layers.0.mlp.down_proj.weight"].shape == (160, 8200)
    write_checkpoint(tmp_path, tensors, config=config)
    loaded = load_deepseek(tmp_path, huge_pages=True)
    assert_same_weights(loaded, model)  # the state dicts hold the checkpoint's [160, 8200]
    down = loaded.model.layers[0].mlp.down_proj
    assert isinstance(down, ChunkedLinear) and down.chunk_major and down.weight.shape == (160, 4, 2050)
    assert torch.equal(down.weight[:, 1], tensors["model.layers.0.mlp.down_proj.weight"][:, 2050:4100])


def test_stacked_expert_tensors_load_like_per_expert_ones(tmp_path, small_model):
    tensors = {k: v for k, v in hf_named_tensors(small_model).items() if ".experts." not in k}
    experts = small_model.model.layers[1].mlp.experts
    tensors["model.layers.1.mlp.experts.gate_up_proj"] = experts.gate_up_proj.detach().clone()
    tensors["model.layers.1.mlp.experts.down_proj"] = experts.down_proj.detach().clone()
    write_checkpoint(tmp_path, tensors)
    assert_same_weights(load_deepseek(tmp_path), small_model)


def quantize_fp8_blockwise(w: torch.Tensor, block: int = 128):
    """Per 128x128 block: scale = amax / 448, stored = (w / scale) in float8_e4m3fn."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(rows / block), math.ceil(cols / block))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            scale[i, j] = w[blk].abs().max().clamp(min=1e-12) / 448.0
            q[blk] = (w[blk] / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_by_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            out[blk] = q[blk].float() * scale[i, j]
    return out


def test_fp8_block_scaled_weights_are_dequantized_at_load(tmp_path, small_model):
    tensors = hf_named_tensors(small_model)
    quantized = ["model.layers.0.mlp.gate_proj.weight",  # [300, 160]: partial blocks both ways
                 "model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_b_proj.weight",
                 "model.layers.1.mlp.experts.3.up_proj.weight"]
    originals = {}
    for name in quantized:
        originals[name] = tensors[name]
        tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blockwise(tensors[name])
    config = dict(SMALL_JSON, quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128]))
    write_checkpoint(tmp_path, tensors, config)
    loaded = hf_named_tensors(load_deepseek(tmp_path))
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 2)
    for name, w in originals.items():
        scale = tensors[name + "_scale_inv"]
        assert torch.equal(loaded[name], dequantize_by_blocks(tensors[name], scale)), name
        bound = 2.0 ** -4 * w.abs() + 2.0 ** -9 * scale.max()  # e4m3: 3 mantissa bits, subnormals
        assert ((loaded[name] - w).abs() <= bound).all(), name
        assert not torch.equal(loaded[name], w), "quantisation should not be lossless here"


def test_a_tensor_parallel_rank_takes_its_share_of_dequantized_fp8_weights(tmp_path, small_model):
    tensors = hf_named_tensors(small_model)
    quantized = {"model.layers.0.mlp.gate_proj.weight": 0, "model.layers.0.mlp.down_proj.weight": 1,
                 "model.layers.1.mlp.experts.3.up_proj.weight": 0}  # the dim each rank's share is cut along
    for name in quantized:
        tensors[name], tensors[name + "_scale_inv"] = quantize_fp8_blockwise(tensors[name])
    config = dict(SMALL_JSON, quantization_config=dict(quant_method="fp8", weight_block_size=[128, 128]))
    write_checkpoint(tmp_path, tensors, config)
    loaded = hf_named_tensors(load_deepseek(tmp_path, tp=Group(None, (0, 1), 1)))
    for name, dim in quantized.items():
        full = dequantize_by_blocks(tensors[name], tensors[name + "_scale_inv"])
        n = full.shape[dim] // 2
        assert torch.equal(loaded[name], full.narrow(dim, n, n)), name


@pytest.mark.parametrize("mutate, message", [
    (lambda t: t.pop("model.layers.1.mlp.experts.2.down_proj.weight"),
     "missing tensor.*model.layers.1.mlp.experts.2.down_proj.weight"),
    (lambda t: t.pop("lm_head.weight"), "missing tensor.*lm_head.weight"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2)}),
     "unexpected tensor.*model.layers.0.self_attn.q_proj.weight"),
    (lambda t: t.update({"model.layers.1.self_attn.kv_b_proj.weight": torch.zeros(32, 17)}),
     r"model.layers.1.self_attn.kv_b_proj.weight has shape \[32, 17\], the model expects \[32, 16\]"),
    (lambda t: t.update({"model.norm.weight": torch.ones(160).to(torch.float8_e4m3fn)}),
     "model.norm.weight is FP8 but its block scale model.norm.weight_scale_inv is missing"),
])
def test_checkpoint_errors_name_the_tensor(tmp_path, small_model, mutate, message):
    tensors = hf_named_tensors(small_model)
    mutate(tensors)
    write_checkpoint(tmp_path, tensors)
    with pytest.raises(CheckpointError, match=message):
        load_deepseek(tmp_path)


def test_loader_without_safetensors_says_what_to_install(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(SMALL_JSON))
    (tmp_path / "model.safetensors").write_bytes(b"")
    monkeypatch.setitem(__import__("sys").modules, "safetensors", None)
    with pytest.raises(ImportError, match="pip install safetensors"):
        load_deepseek(tmp_path)
