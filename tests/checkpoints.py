"""Small DeepSeek checkpoints written from a seeded model, shared by the loader and weight tests.

The per-expert split here is written independently of ``models.loader`` so that it can serve
as the loader's oracle.
"""

from __future__ import annotations

import json

import pytest
import torch

from ascend_graph.models import DeepseekForCausalLM

SMALL_JSON = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=200, hidden_size=160,
                  intermediate_size=300, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=24,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                  n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=12, n_group=2, topk_group=1,
                  first_k_dense_replace=1, initializer_range=0.1, dtype="float32",
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=64))


def hf_named_tensors(model: DeepseekForCausalLM) -> dict[str, torch.Tensor]:
    """The model's state dict with the stacked experts one by one, as published checkpoints hold them."""
    out = {}
    for name, t in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for x, w in enumerate(t):
                out[f"{prefix}.{x}.gate_proj.weight"], out[f"{prefix}.{x}.up_proj.weight"] = w.chunk(2)
        elif leaf == "down_proj" and prefix.endswith("experts"):
            for x, w in enumerate(t):
                out[f"{prefix}.{x}.down_proj.weight"] = w
        else:
            out[name] = t
    return {k: v.clone().contiguous() for k, v in out.items()}


def write_checkpoint(path, tensors, config=SMALL_JSON, shards=1):
    """config.json plus ``model.safetensors``, or ``shards`` files with an index."""
    save_file = pytest.importorskip("safetensors.torch").save_file
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return
    names, weight_map = sorted(tensors), {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def read_checkpoint(path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint directory ``path`` (one file or shards), by name."""
    safe_open = pytest.importorskip("safetensors").safe_open
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Same names, and bit-identical tensors (dtype and shape included) under each."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        bits = [t.contiguous().flatten().view(torch.uint8) for t in (a[name], b[name])]
        assert torch.equal(*bits), name
