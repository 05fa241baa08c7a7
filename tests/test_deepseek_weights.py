"""DeepSeek weights keep the checkpoint's names, shapes and order; derived forms follow them.

Oracles: the checkpoint files themselves (read back with safetensors), transformers' own model
and its ``save_pretrained`` files, and per-head slices of the checkpoint's ``kv_b_proj.weight``.
"""

from __future__ import annotations

import pytest
import torch

from ascend_graph import allocate_kv_caches
from ascend_graph.attention import build_attention_metadata
from ascend_graph.layers import ChunkedLinear
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM, load_deepseek
from ascend_graph.models.loader import checkpoint_tensors
from checkpoints import SMALL_JSON, assert_same_tensors, hf_named_tensors, read_checkpoint, write_checkpoint

LONG_ROWS = {**SMALL_JSON, "intermediate_size": 8200}  # the dense down projection: a ChunkedLinear


def kv_b_slices(weight: torch.Tensor, attn) -> tuple[torch.Tensor, torch.Tensor]:
    """Per head, ``W_UK [H, Dn, C]`` and ``W_UV [H, Dv, C]`` cut row by row from the checkpoint weight."""
    h, dn, dv = attn.num_heads, attn.qk_nope_head_dim, attn.v_head_dim
    rows = [weight[i * (dn + dv):(i + 1) * (dn + dv)] for i in range(h)]
    return torch.stack([r[:dn] for r in rows]), torch.stack([r[dn:] for r in rows])


def assert_derived_forms_follow_kv_b(model: DeepseekForCausalLM) -> None:
    for layer in model.model.layers:
        attn = layer.self_attn
        uk, uv = kv_b_slices(attn.kv_b_proj.weight.detach(), attn)
        assert attn.w_uk_t.is_contiguous() and attn.w_uv.is_contiguous()
        assert torch.equal(attn.w_uk_t, uk.transpose(1, 2)) and torch.equal(attn.w_uv, uv)


@pytest.mark.parametrize("shards", [1, 3])
def test_loaded_weights_saved_back_are_the_checkpoint_bit_for_bit(tmp_path, shards):
    written = tmp_path / "written"
    written.mkdir()
    write_checkpoint(written, hf_named_tensors(DeepseekForCausalLM(DeepseekConfig.from_dict(LONG_ROWS), seed=5)),
                     config=LONG_ROWS, shards=shards)
    loaded = load_deepseek(written)
    assert loaded.model.layers[0].mlp.down_proj.chunk_major
    saved = tmp_path / "saved"
    saved.mkdir()
    write_checkpoint(saved, {k: v.contiguous() for k, v in checkpoint_tensors(loaded).items()}, config=LONG_ROWS)
    assert_same_tensors(read_checkpoint(saved), read_checkpoint(written))


def test_state_dict_is_transformers_state_dict_after_loading_its_checkpoint(tmp_path):
    pytest.importorskip("transformers", minversion="5.0")
    from hf_models import tiny_hf_model

    hf = tiny_hf_model("v3", intermediate_size=8200)
    hf.save_pretrained(tmp_path)
    ours = load_deepseek(tmp_path, dtype=torch.float32)
    assert isinstance(ours.model.layers[0].mlp.down_proj, ChunkedLinear)
    assert_same_tensors(ours.state_dict(), {k: v.detach() for k, v in hf.state_dict().items()})
    assert_same_tensors(checkpoint_tensors(ours), read_checkpoint(tmp_path))


def test_derived_forms_are_not_in_the_state_dict():
    model = DeepseekForCausalLM(DeepseekConfig.from_dict(LONG_ROWS), seed=1)
    buffers = {name for name, _ in model.named_buffers()}
    assert "model.layers.0.self_attn.w_uk_t" in buffers and "model.layers.1.self_attn.w_uv" in buffers
    state = model.state_dict()
    assert not any(name.endswith(("w_uk_t", "w_uv")) for name in state)
    assert state["model.layers.0.self_attn.kv_b_proj.weight"].shape == (2 * (8 + 8), 16)
    assert state["model.layers.0.mlp.down_proj.weight"].shape == (160, 8200)


def test_w_uk_and_w_uv_are_the_checkpoints_per_head_slices():
    model = DeepseekForCausalLM(DeepseekConfig.small_v3(), seed=2)
    assert_derived_forms_follow_kv_b(model)
    model.to(torch.bfloat16)  # cast with the weights, still their exact layout copies
    assert model.model.layers[0].self_attn.w_uv.dtype == torch.bfloat16
    assert_derived_forms_follow_kv_b(model)


def test_changed_weights_reach_the_derived_forms_after_processing_again():
    model = DeepseekForCausalLM(DeepseekConfig.from_dict(LONG_ROWS), seed=3)
    gen = torch.Generator().manual_seed(4)
    attn, down = model.model.layers[1].self_attn, model.model.layers[0].mlp.down_proj
    with torch.no_grad():
        attn.kv_b_proj.weight.copy_(torch.randn(attn.kv_b_proj.weight.shape, generator=gen))  # in place
    new_down = torch.randn(160, 8200, generator=gen)
    down.weight = torch.nn.Parameter(new_down.clone())  # replaced, row-major
    model.process_weights_after_loading()
    assert_derived_forms_follow_kv_b(model)
    assert down.chunk_major and torch.equal(down.weight.flatten(1), new_down)
    assert down.weight.untyped_storage().nbytes() == new_down.numel() * new_down.element_size()  # one copy


def test_load_state_dict_rebuilds_the_derived_forms_and_takes_checkpoint_shapes():
    config = DeepseekConfig.from_dict(LONG_ROWS)
    model, source = DeepseekForCausalLM(config, seed=3), DeepseekForCausalLM(config, seed=8)
    down = model.model.layers[0].mlp.down_proj
    storage = down.weight.data_ptr()
    model.load_state_dict(source.state_dict())  # down_proj.weight arrives as [160, 8200]
    assert_derived_forms_follow_kv_b(model)
    assert down.chunk_major and down.weight.data_ptr() == storage  # written in place
    assert_same_tensors(model.state_dict(), source.state_dict())


def test_a_model_never_processed_refuses_to_run_before_writing_its_cache():
    model = DeepseekForCausalLM(DeepseekConfig.small(), init_weights=False)
    caches = allocate_kv_caches(model.kv_cache_specs(), 4, 4)
    positions, meta = build_attention_metadata([[1]], [0], [3], block_size=4, num_blocks=4, max_model_len=16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="process_weights_after_loading"):
        model(torch.tensor([1, 2, 3]), positions, caches, meta)
    assert all(not c.kv_c.any() and not c.k_pe.any() for c in caches)


def test_a_seed_draws_kv_b_as_earlier_versions_stored_it():
    """The random draw for ``kv_b_proj`` is read in the layout earlier versions kept (every head's
    W_UK transposed, then every W_UV), so seeded models stay the models recorded results used."""
    from ascend_graph.models.deepseek import _earlier_kv_b_order, kv_b_parts

    h, dn, dv, c = 3, 4, 5, 6
    draw = torch.randn(h * (dn + dv), c, generator=torch.Generator().manual_seed(0))
    uk_t, uv = kv_b_parts(_earlier_kv_b_order(draw, h, dn, dv), h, dn, dv)
    assert torch.equal(uk_t, draw[:h * dn].reshape(h, c, dn)) and torch.equal(uv, draw[h * dn:].reshape(h, dv, c))
