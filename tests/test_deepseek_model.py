"""DeepSeek V2/V3 model behaviour over paged tuple caches, without transformers.

Oracles: per-token float64 loops for the MoE, the same model run as separate steps for mixed
batches, the unpadded step for padded ones, and eager for the compiled step.
"""

from __future__ import annotations

import pytest
import torch

from ascend_graph import allocate_kv_caches
from ascend_graph.attention import build_attention_metadata, pad_decode
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
from ascend_graph.moe.layer import MoE

BLOCK_SIZE = 4

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


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_moe_paths_match_per_token_loop(prefill):
    model = DeepseekForCausalLM(DeepseekConfig.small_v3(), seed=3)
    moe = model.model.layers[1].mlp
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(moe(x, prefill=prefill).double(), _moe_oracle(moe, x), atol=1e-5, rtol=1e-5)


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
