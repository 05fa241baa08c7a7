"""DeepSeek V3's multi-token-prediction (MTP) layer: loaded from the checkpoint's layer
``num_hidden_layers`` into ``mtp.0``, with its own cache, and computed as vLLM's
``DeepSeekMultiTokenPredictorLayer`` does.

Oracles: the checkpoint layout DeepSeek-V3 publishes (the MTP layer as one more
``model.layers.N`` block plus ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``:
../shared/MTP.md), and a float64 reference of the MTP layer whose decoder block is transformers'
own ``DeepseekV3DecoderLayer`` (the rest written here from vLLM's documented forward, which takes
the target's embedding and lm_head in place of the layer's copies). Stock vLLM's own MTP drafter
is the oracle of the drafts in test_vllm_plugin.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("safetensors")

from checkpoints import read_checkpoint, write_checkpoint  # noqa: E402
from hf_models import tiny_hf_model  # noqa: E402

from ascend_graph import allocate_kv_caches  # noqa: E402
from ascend_graph.attention import build_attention_metadata  # noqa: E402
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM, load_deepseek  # noqa: E402
from ascend_graph.models.loader import CheckpointError, checkpoint_tensors  # noqa: E402

MTP_OWN = {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"}
SHARED = {"embed_tokens.weight", "shared_head.head.weight"}  # the target's, in the checkpoint as copies
BLOCK = 4


def _layer_names(names, layer: int) -> set[str]:
    prefix = f"model.layers.{layer}."
    return {n[len(prefix):] for n in names if n.startswith(prefix)}


def test_the_mtp_layer_is_the_checkpoints_layer_after_the_target_and_round_trips(tmp_path) -> None:
    """small-v3 with its MTP layer: written in checkpoint form, the MTP layer is layer 3 (after the
    3 target layers): the block's tensors as a target MoE layer's, plus the MTP's own; loading
    it back gives every tensor, and a published checkpoint's copies of the embedding and head
    there are read past; without ``mtp_layers`` the same checkpoint loads the target alone."""
    config = DeepseekConfig.small_v3()
    model = DeepseekForCausalLM(config, mtp_layers=1)
    plain = DeepseekForCausalLM(config)
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in plain.state_dict().items())  # same draws
    tensors = {n: t.contiguous() for n, t in checkpoint_tensors(model).items()}
    assert _layer_names(tensors, 3) == _layer_names(tensors, 2) | MTP_OWN
    assert not any(n.startswith("mtp.") for n in tensors)
    tensors |= {f"model.layers.3.{n}": torch.randn(tensors[n.replace("shared_head.head", "lm_head")
                                                           .replace("embed_tokens", "model.embed_tokens")].shape)
                for n in SHARED}  # as DeepSeek-V3 ships them (there, equal to the target's)
    write_checkpoint(tmp_path, tensors, config_json(config))
    loaded = load_deepseek(tmp_path, torch.float32, mtp_layers=1)
    assert loaded.state_dict().keys() == model.state_dict().keys()
    assert all(torch.equal(t, model.state_dict()[n]) for n, t in loaded.state_dict().items())
    assert len(loaded.kv_cache_specs()) == len(list(loaded.attention_layers())) == 4
    target = load_deepseek(tmp_path, torch.float32)
    assert len(target.mtp) == 0 and len(target.kv_cache_specs()) == 3
    assert all(torch.equal(t, plain.state_dict()[n]) for n, t in target.state_dict().items())


def test_a_missing_mtp_tensor_is_named_only_where_the_mtp_layer_is_asked_for(tmp_path) -> None:
    config = DeepseekConfig.small_v3()
    tensors = {n: t.contiguous() for n, t in checkpoint_tensors(DeepseekForCausalLM(config, mtp_layers=1)).items()}
    del tensors["model.layers.3.eh_proj.weight"]
    write_checkpoint(tmp_path, tensors, config_json(config))
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): model\.layers\.3\.eh_proj\.weight"):
        load_deepseek(tmp_path, mtp_layers=1)
    assert len(load_deepseek(tmp_path).mtp) == 0


@pytest.mark.parametrize("bad", [2, -1, "1"])
def test_more_mtp_layers_than_the_checkpoint_has_names_the_argument(bad) -> None:
    with pytest.raises(ValueError, match=r"mtp_layers must be an int in \[0, num_nextn_predict_layers=1\]"):
        DeepseekForCausalLM(DeepseekConfig.small_v3(), init_weights=False, mtp_layers=bad)


def config_json(config: DeepseekConfig) -> dict:
    """``config.json`` of ``config`` as a checkpoint writes it (rope as ``rope_scaling``)."""
    from dataclasses import asdict

    d = {k: v for k, v in asdict(config).items() if v is not None and k != "quantization_config"}
    d["architectures"] = list(config.architectures)
    return d


# ---- the MTP layer's forward against transformers' block in float64 ----

@pytest.fixture(scope="module")
def mtp_checkpoint(tmp_path_factory):
    """A tiny V3 checkpoint with one MTP layer: the target is transformers' 3-layer model, the MTP
    block transformers' layer 3 of the same model built with 4; the MTP's own tensors random,
    and its copies of the embedding and head random too (vLLM's MTP drafts use the target's)."""
    full = tiny_hf_model("v3", num_hidden_layers=4)
    config = full.config.to_dict() | {"num_hidden_layers": 3, "num_nextn_predict_layers": 1}
    gen = torch.Generator().manual_seed(3)
    e, v = full.config.hidden_size, full.config.vocab_size
    own = {"embed_tokens.weight": torch.randn(v, e, generator=gen) * 0.2,  # read past: the target's is used
           "enorm.weight": 1 + 0.1 * torch.randn(e, generator=gen), "hnorm.weight": 1 + 0.1 * torch.randn(e, generator=gen),
           "eh_proj.weight": torch.randn(e, 2 * e, generator=gen) * 0.2,
           "shared_head.norm.weight": 1 + 0.1 * torch.randn(e, generator=gen),
           "shared_head.head.weight": torch.randn(v, e, generator=gen) * 0.2}
    tensors = {n: t for n, t in full.state_dict().items() if not n.startswith("model.layers.3.")}
    tensors |= {f"model.layers.3.{n}": t for n, t in full.model.layers[3].state_dict().items()}
    tensors |= {f"model.layers.3.{n}": t for n, t in own.items()}
    path = tmp_path_factory.mktemp("mtp")
    write_checkpoint(path, {n: t.contiguous() for n, t in tensors.items()}, config)
    return path, full, own


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def reference_mtp_logits(full, own: dict, ids: list[int], after: list[int]) -> torch.Tensor:
    """float64: the target (``full``'s first 3 layers) over ``ids``, then the MTP layer at every
    position p with the token after it ``after[p]`` (vLLM: embedding zeroed at position 0)."""
    full = full.double()
    full.config._experts_implementation = "eager"  # grouped_mm takes no float64
    c, n = full.config, len(ids)
    pos = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    x = full.model.embed_tokens(torch.tensor(ids)[None])
    cos_sin = full.model.rotary_emb(x, pos)
    for layer in full.model.layers[:3]:
        x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    h = full.model.norm(x)  # the target's final-normed hidden states
    o = {k: t.double() for k, t in own.items()}
    embeds = full.model.embed_tokens(torch.tensor(after))[None]  # the target's embedding and head
    embeds[:, 0] = 0
    eps = c.rms_norm_eps
    x = torch.cat([_rms(embeds, o["enorm.weight"], eps), _rms(h, o["hnorm.weight"], eps)], -1) @ o["eh_proj.weight"].T
    x = full.model.layers[3](x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    logits = full.lm_head(_rms(x, o["shared_head.norm.weight"], eps))[0]
    full.float()
    return logits


@torch.no_grad()
def test_the_mtp_layer_equals_transformers_block_in_float64_over_a_prefill_and_a_decode_step(mtp_checkpoint) -> None:
    """Prefill a prompt, run the MTP layer over it (token after each position); then one decode
    row of the target and one of the MTP layer reading its own cache: every row's MTP logits
    equal the float64 reference's; the target's caches are those of the target alone."""
    path, full, own = mtp_checkpoint
    model = load_deepseek(path, dtype=torch.float32, mtp_layers=1)
    ids = [5, 17, 3, 99, 42, 8, 61]
    after = ids[1:] + [77, 12]  # the tokens at positions 1..8
    n = len(ids)
    caches = allocate_kv_caches(model.kv_cache_specs(), 8, BLOCK)
    layout = dict(block_size=BLOCK, num_blocks=8, max_model_len=64)
    table = [[5, 2, 7]]
    positions, meta = build_attention_metadata(table, [0], [n], **layout)
    hidden = model(torch.tensor(ids), positions, caches, meta)
    target_caches = [[t.clone() for t in cache] for cache in caches[:3]]
    got = [model.compute_mtp_logits(model.mtp_predict(torch.tensor(after[:n]), positions, hidden, caches, meta))]
    assert all(torch.equal(t, s) for cache, saved in zip(caches[:3], target_caches) for t, s in zip(cache, saved))
    assert caches[3].kv_c.abs().sum() > 0  # the MTP layer wrote its own cache
    positions, meta = build_attention_metadata(table, [n], [1], **layout)
    hidden = model(torch.tensor([after[n - 1]]), positions, caches, meta)
    got.append(model.compute_mtp_logits(model.mtp_predict(torch.tensor([after[n]]), positions, hidden, caches, meta)))
    want = reference_mtp_logits(full, own, ids + [after[n - 1]], after[:n + 1])
    torch.testing.assert_close(torch.cat(got).double(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(torch.cat(got).argmax(-1), want.argmax(-1))
