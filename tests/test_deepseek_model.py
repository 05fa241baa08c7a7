"""DeepSeek V2/V3 model, config and loader, without transformers.

Oracles: the public config numbers in DESIGN.md, per-token float64 loops for the MoE, the same
model run as separate steps for mixed batches, eager for the compiled step, and block-by-block
loops for FP8 dequantisation.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from ascend_graph import allocate_kv_caches
from ascend_graph.attention import build_attention_metadata, pad_decode
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM, load_deepseek, softmax_scale
from ascend_graph.models.deepseek import kv_b_to_checkpoint
from ascend_graph.models.loader import CheckpointError
from ascend_graph.moe.layer import MoE

BLOCK_SIZE = 4

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


# ---------------------------------------------------------------------------------------------
# Config


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


# ---------------------------------------------------------------------------------------------
# Helpers: run steps through paged caches


def prefill(model, prompts, tables, caches, num_blocks):
    """Prefill ``prompts`` from scratch; returns the last-token logits ``[P, V]``."""
    positions, meta = build_attention_metadata(tables, [0] * len(prompts), [len(p) for p in prompts],
                                               block_size=BLOCK_SIZE, num_blocks=num_blocks, max_model_len=512)
    hidden = model(torch.tensor(sum(prompts, [])), positions, caches, meta)
    return model.compute_logits(hidden[torch.tensor([len(p) for p in prompts]).cumsum(0) - 1])


def decode_inputs(tables, cached, num_blocks):
    return build_attention_metadata(tables, cached, [1] * len(tables), block_size=BLOCK_SIZE,
                                    num_blocks=num_blocks, max_model_len=512)


def clone_caches(caches):
    return tuple(type(c)(*(t.clone() for t in c)) for c in caches)


# ---------------------------------------------------------------------------------------------
# Model behaviour


def test_kv_cache_specs_are_one_latent_spec_per_layer_in_model_dtype():
    model = DeepseekForCausalLM(DeepseekConfig.small(), dtype=torch.bfloat16)
    specs = model.kv_cache_specs()
    assert len(specs) == 3
    assert {(s.kv_lora_rank, s.qk_rope_head_dim, s.dtype) for s in specs} == {(32, 8, torch.bfloat16)}


def _moe_oracle(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per-token float64 loop over the router's chosen experts, plus the shared experts."""
    weights, experts = moe.gate(x)
    f = lambda t: t.detach().double()  # noqa: E731
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), experts[t].tolist()):
            gate, up = (f(moe.experts.gate_up_proj[e]) @ f(x[t])).chunk(2)
            out[t] += w * (f(moe.experts.down_proj[e]) @ (torch.nn.functional.silu(gate) * up))
    shared = moe.shared_experts
    h = torch.nn.functional.silu(f(x) @ f(shared.gate_proj.weight).T) * (f(x) @ f(shared.up_proj.weight).T)
    return out + h @ f(shared.down_proj.weight).T


@pytest.mark.parametrize("grouped", [False, True], ids=["gathered_decode", "grouped_prefill"])
def test_moe_paths_match_per_token_loop(grouped):
    model = DeepseekForCausalLM(DeepseekConfig.small_v3(), seed=3)
    moe = model.model.layers[1].mlp
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(moe(x, grouped=grouped).double(), _moe_oracle(moe, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["group_limited_greedy", "noaux_tc"])
def test_grouped_routing_chooses_top_experts_inside_best_groups(method):
    config = DeepseekConfig.small_v3(topk_method=method, n_group=4, topk_group=2, num_experts_per_tok=3)
    gate = DeepseekForCausalLM(config, seed=5).model.layers[1].mlp.gate
    if gate.e_score_correction_bias is not None:
        gate.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)) * 0.1)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    _, experts = gate(x)
    scores = (x @ gate.weight.T).sigmoid()
    for t in range(16):
        choice = scores[t] + (0 if gate.e_score_correction_bias is None else gate.e_score_correction_bias)
        groups = choice.view(4, 2)
        rank = groups.sum(1) if method == "noaux_tc" else groups.max(1).values  # 2 experts a group
        allowed = [e for g in rank.argsort(descending=True)[:2].tolist() for e in (2 * g, 2 * g + 1)]
        best = sorted(allowed, key=lambda e: -choice[e].item())[:3]
        assert sorted(experts[t].tolist()) == sorted(best), f"token {t}"


def test_mixed_batch_equals_separate_steps():
    model = DeepseekForCausalLM(DeepseekConfig.small_v3(), seed=1)
    a, b = list(range(3, 9)), list(range(40, 47))
    tables, num_blocks = [[5, 2], [3, 6, 7]], 8
    with torch.no_grad():
        sep = allocate_kv_caches(model.kv_cache_specs(), num_blocks, BLOCK_SIZE)
        tok_a = prefill(model, [a], tables[:1], sep, num_blocks).argmax(-1)
        pos, meta = decode_inputs(tables[:1], [len(a)], num_blocks)
        want_a = model.compute_logits(model(tok_a, pos, sep, meta))
        want_b = prefill(model, [b], tables[1:], sep, num_blocks)

        mixed = allocate_kv_caches(model.kv_cache_specs(), num_blocks, BLOCK_SIZE)
        prefill(model, [a], tables[:1], mixed, num_blocks)
        pos, meta = build_attention_metadata(tables, [len(a), 0], [1, len(b)], block_size=BLOCK_SIZE,
                                             num_blocks=num_blocks, max_model_len=512)
        assert meta.decode is not None and meta.prefill is not None
        logits = model.compute_logits(model(torch.cat([tok_a, torch.tensor(b)]), pos, mixed, meta))
    torch.testing.assert_close(logits[:1], want_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[-1:], want_b, atol=1e-5, rtol=1e-5)
    for s, m in zip(sep, mixed):
        torch.testing.assert_close(m.kv_c, s.kv_c)
        torch.testing.assert_close(m.k_pe, s.k_pe)


def test_padded_decode_rows_are_finite_and_leave_live_blocks_untouched():
    model = DeepseekForCausalLM(DeepseekConfig.small(), seed=2)
    tables, num_blocks = [[1, 2, 3], [4, 5, 6]], 7
    caches = allocate_kv_caches(model.kv_cache_specs(), num_blocks, BLOCK_SIZE)
    with torch.no_grad():
        toks = prefill(model, [[1, 2, 3, 4, 5], [9, 8, 7]], tables, caches, num_blocks).argmax(-1)
        pos, meta = decode_inputs(tables, [5, 3], num_blocks)
        before, plain = clone_caches(caches), clone_caches(caches)
        want = model(toks, pos, plain, meta)
        pos4, meta4 = pad_decode(pos, meta, 4)
        got = model(torch.cat([toks, torch.zeros(2, dtype=torch.long)]), pos4, caches, meta4)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:2], want, atol=1e-5, rtol=1e-5)
    for layer, (c, p, b) in enumerate(zip(caches, plain, before)):
        for name in ("kv_c", "k_pe"):
            live = slice(1, None)  # everything but the null block equals the unpadded step
            torch.testing.assert_close(getattr(c, name)[live], getattr(p, name)[live])
            assert not torch.equal(getattr(c, name)[live], getattr(b, name)[live]), f"layer {layer} not written"


def test_casting_the_model_keeps_rope_frequencies_and_routing_float32():
    model = DeepseekForCausalLM(DeepseekConfig.small_v3())
    inv_freq, gate = model.model.rotary_emb.inv_freq.clone(), model.model.layers[1].mlp.gate.weight.clone()
    model.to(torch.bfloat16)
    assert model.dtype == torch.bfloat16 and model.kv_cache_specs()[0].dtype == torch.bfloat16
    assert model.model.layers[1].mlp.experts.down_proj.dtype == torch.bfloat16
    assert torch.equal(model.model.rotary_emb.inv_freq, inv_freq)  # bfloat16 frequencies ruin long contexts
    assert torch.equal(model.model.layers[1].mlp.gate.weight, gate)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_model_decodes_finite_logits(dtype):
    model = DeepseekForCausalLM(DeepseekConfig.small_v3(), dtype=dtype)
    caches = allocate_kv_caches(model.kv_cache_specs(), 4, BLOCK_SIZE)
    with torch.no_grad():
        tok = prefill(model, [[1, 2, 3]], [[2]], caches, 4).argmax(-1)
        pos, meta = decode_inputs([[2]], [3], 4)
        logits = model.compute_logits(model(tok, pos, caches, meta))
    assert caches[0].kv_c.dtype == dtype and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_decode_step_compiles_fullgraph_and_matches_eager():
    model = DeepseekForCausalLM(DeepseekConfig.small_v3(num_hidden_layers=2), seed=4)
    tables, num_blocks = [[3, 1], [2, 4]], 5
    caches = allocate_kv_caches(model.kv_cache_specs(), num_blocks, BLOCK_SIZE)
    with torch.no_grad():
        toks = prefill(model, [[5, 6, 7], [8, 9, 10, 11, 12]], tables, caches, num_blocks).argmax(-1)
        pos, meta = decode_inputs(tables, [3, 5], num_blocks)
        eager_caches, graph_caches = clone_caches(caches), clone_caches(caches)
        want = model(toks, pos, eager_caches, meta)
        torch._dynamo.reset()
        step = torch.compile(model, backend="inductor", fullgraph=True)
        got = step(toks, pos, graph_caches, meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for g, e in zip(graph_caches, eager_caches):  # the in-place cache write happened in the graph
        torch.testing.assert_close(g.kv_c, e.kv_c)
        torch.testing.assert_close(g.k_pe, e.k_pe)


# ---------------------------------------------------------------------------------------------
# Loader

SMALL_JSON = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=200, hidden_size=160,
                  intermediate_size=300, num_hidden_layers=2, num_attention_heads=2, q_lora_rank=24,
                  kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                  n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=12, n_group=2, topk_group=1,
                  first_k_dense_replace=1, initializer_range=0.1, dtype="float32",
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=64))


def hf_named_tensors(model: DeepseekForCausalLM) -> dict[str, torch.Tensor]:
    """The model's tensors under checkpoint names, experts one by one (as published checkpoints)."""
    out = {}
    for name, t in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for x, w in enumerate(t):
                gate, up = w.chunk(2)
                out[f"{prefix}.{x}.gate_proj.weight"], out[f"{prefix}.{x}.up_proj.weight"] = gate, up
        elif leaf == "down_proj" and prefix.endswith("experts"):
            for x, w in enumerate(t):
                out[f"{prefix}.{x}.down_proj.weight"] = w
        elif name.endswith("kv_b_proj.weight"):  # checkpoints keep W_UK / W_UV rows per head
            c = model.config
            out[name] = kv_b_to_checkpoint(t, c.num_attention_heads, c.qk_nope_head_dim, c.v_head_dim)
        else:
            out[name] = t.flatten(1) if t.dim() == 3 else t  # a ChunkedLinear's [N, C, K/C] weight
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
    assert_same_weights(loaded, model)
    down = loaded.model.layers[0].mlp.down_proj.weight
    assert down.shape == (160, 4, 2050) and down.permute(1, 0, 2).is_contiguous()
    assert torch.equal(down[:, 1], tensors["model.layers.0.mlp.down_proj.weight"][:, 2050:4100])


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


def test_kv_b_layout_round_trips_and_its_parts_are_the_checkpoints_per_head_slices():
    from ascend_graph.models.deepseek import kv_b_from_checkpoint, kv_b_parts

    h, dn, dv, c = 3, 4, 5, 6
    ckpt = torch.randn(h * (dn + dv), c)
    ours = kv_b_from_checkpoint(ckpt, h, dn, dv)
    uk, uv = kv_b_parts(ours, h, dn, dv)
    per_head = ckpt.view(h, dn + dv, c)
    assert torch.equal(uk, per_head[:, :dn]) and torch.equal(uv, per_head[:, dn:])
    assert uk.transpose(1, 2).is_contiguous() and uv.is_contiguous()  # each product sums along rows
    assert torch.equal(kv_b_to_checkpoint(ours, h, dn, dv), ckpt)
