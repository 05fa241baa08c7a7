"""The PD handshake's model identity (``pd/identity.py``) and its place in ``CacheLayout.check_matches``.

Every compared value comes from the code that computes it on a node: ``model_identity`` over a
real model whose attention layers run a real backend class. The NPU side is the real ``NpuMLA``
class (its ``cache_family`` and ``cached_rope_layout``), built without its constructor, which
would import torch_npu; nothing of it runs but those two declarations. Oracle: which field was
changed on purpose; the message must name that field and both values.
"""

import dataclasses

import pytest
import torch

from ascend_graph.attention.npu import NpuMLA
from ascend_graph.kv_cache import allocate_kv_caches
from ascend_graph.models.deepseek import DeepseekForCausalLM
from ascend_graph.models.deepseek_config import DeepseekConfig
from ascend_graph.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_graph.pd.identity import NO_K_PE, ModelIdentity, model_identity, weight_digest
from ascend_graph.pd.layout import CacheLayout, LayoutMismatch

SMALL = DeepseekConfig.small()


def deepseek(config=SMALL, seed=0, npu=False):
    model = DeepseekForCausalLM(config, seed=seed).eval()
    if npu:  # as an NPU node runs it: the real class's declarations, no torch_npu needed for them
        for layer in model.attention_layers():
            layer.backend = NpuMLA.__new__(NpuMLA)
    return model


def layout(model, num_blocks=6):
    kv = allocate_kv_caches(model.kv_cache_specs(), num_blocks, 4)
    return CacheLayout.of(kv).with_identity(model_identity(model))


def test_two_builds_of_one_model_have_one_identity():
    a, b = model_identity(deepseek()), model_identity(deepseek())
    assert a == b and a.difference(b, "prefill side") is None
    assert [(x.kind, x.family, x.rope_layout) for x in a.attention] == [("mla", "torch", "interleaved")] * 3
    assert [name for name, _ in a.weights] == ["embed_tokens.weight", "norm.weight", "lm_head.weight"]
    layout(deepseek()).check_matches(layout(deepseek(), num_blocks=9), "prefill side")  # block counts may differ


@pytest.mark.parametrize("peer, words", [
    (lambda: deepseek(npu=True),
     "layer 0 k_pe rope layout differs: interleaved here, deinterleaved on the prefill side"),
    (lambda: deepseek(seed=1), "model weights differ: embed_tokens.weight digest [0-9a-f]{12} here, [0-9a-f]{12} on"),
    (lambda: deepseek(dataclasses.replace(SMALL, rope_theta=20000.0)), "model config differs: digest"),
])
def test_an_equal_geometry_with_another_model_or_rope_layout_is_refused_naming_the_field(peer, words):
    mine, theirs = layout(deepseek()), layout(peer())
    assert [r.block_shape for r in mine.regions] == [r.block_shape for r in theirs.regions]  # geometry alone passes
    dataclasses.replace(mine, identity=None).check_matches(dataclasses.replace(theirs, identity=None))
    with pytest.raises(LayoutMismatch, match=words):
        mine.check_matches(theirs, "prefill side")
    assert mine.fingerprint != theirs.fingerprint


def test_the_backend_family_is_compared_where_the_rope_layouts_agree():
    half = dataclasses.replace(SMALL, rope_interleave=False)  # both families store k_pe as "half"
    mine, theirs = model_identity(deepseek(half)), model_identity(deepseek(half, npu=True))
    assert {a.rope_layout for a in mine.attention + theirs.attention} == {"half"}
    assert mine.difference(theirs, "prefill side") == \
        "layer 0 attention backend family differs: torch here, npu on the prefill side"


def test_paged_layers_record_that_they_have_no_k_pe():
    llama = model_identity(LlamaForCausalLM(LlamaConfig()))
    assert [(a.kind, a.family, a.rope_layout) for a in llama.attention] == [("paged", "torch", NO_K_PE)] * 2
    two_layers = model_identity(deepseek(dataclasses.replace(SMALL, num_hidden_layers=2)))
    assert two_layers.difference(llama, "peer") == "layer 0 attention kind differs: mla here, paged on the peer"


def test_an_identity_on_one_side_only_is_refused():
    mine = layout(deepseek())
    with pytest.raises(LayoutMismatch, match="model identity: given here, none on the prefill side"):
        mine.check_matches(dataclasses.replace(mine, identity=None), "prefill side")


def test_a_layout_survives_json_and_a_malformed_one_is_refused_naming_the_key():
    mine = layout(deepseek())
    assert CacheLayout.from_dict(mine.to_dict()) == mine
    data = mine.to_dict()
    bad = [({**data, "extra": 1}, "block_size, regions and"),
           ({**data, "identity": {**data["identity"], "code": "x"}}, "identity must be an object of exactly"),
           ({**data, "regions": [{**data["regions"][0], "dtype": 3}]}, r"regions\[0\].dtype must be str"),
           ({**data, "regions": [{**data["regions"][0], "block_shape": [4, -1, 2]}]}, "positive ints"),
           ({**data, "identity": {**data["identity"], "attention": [{"layer": "0"}]}}, r"attention\[0\]")]
    for value, words in bad:
        with pytest.raises(LayoutMismatch, match="malformed layout from the peer: .*" + words):
            CacheLayout.from_dict(value)


def test_a_weight_digest_sees_dtype_shape_and_sampled_rows():
    t = torch.randn(100_000, 64, generator=torch.Generator().manual_seed(0))
    base = weight_digest(t)
    assert weight_digest(t.clone()) == base
    assert weight_digest(t.to(torch.bfloat16)) != base and weight_digest(t[:-1]) != base
    for row in (0, -1):  # the first and last rows are always sampled
        u = t.clone()
        u[row, 0] += 1
        assert weight_digest(u) != base


def test_identity_round_trips_and_compares_by_value():
    a = model_identity(deepseek())
    assert ModelIdentity.from_dict(a.to_dict()) == a
