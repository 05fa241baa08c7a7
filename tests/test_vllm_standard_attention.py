"""Standard attention inside the real vLLM: with the flag on, a transformers ``LlamaForCausalLM``
checkpoint decodes as ascend_graph's per-size graphs over ``KVCache(k, v)`` tuples.

Harness (a subprocess of the vLLM python, the plugin found by entry point): tests/test_vllm_plugin.py.
Oracles: transformers' float32 greedy tokens (a full forward per token) and stock vLLM, the same
``LLM`` without the flag. Three vLLM runs in all (stock, graph, two failing constructions).

The checkpoint: GQA (4 query heads, 2 kv heads), head 32 (vLLM's CPU attention takes heads of 32,
64, 80, ...: ``CPUAttentionBackend.get_supported_head_sizes``), hidden 64 (so the heads are not
hidden / heads wide), rope theta 500, tied embeddings. Block 32: stock vLLM's CPU attention takes
multiples of 32 only (``get_supported_kernel_block_sizes``); ours takes any. Prefix caching and
chunked prefill stay on (vLLM's CPU defaults for standard attention): in the second generation
of the same prompts vLLM finds the 40-token prompt's first block cached (in our tensors) and
the eager step prefills the other 8 tokens over it (seen when writing this test, not counted).
Three requests decode in the graph of capture size 4: one padded row, which writes only into the
null block; parity checks run graph and eager on the same step and compare the blocks too.
"""

from __future__ import annotations

import json
import pathlib

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0")
import torch  # noqa: E402

from test_vllm_plugin import (NEW_TOKENS, SIZES, assert_captured_at_start, assert_graph_counters,  # noqa: E402,F401
                              generate_in_turn, greedy_tokens, vllm_run)

pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.slow]

VOCAB = 128
PROMPTS = [torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist(),
           [7, 8, 9, 10, 11, 12, 13, 14, 15], [20, 21, 22]]
LLM_ARGS = dict(dtype="float32", max_model_len=128, block_size=32, max_num_seqs=4, skip_tokenizer_init=True,
                seed=0, kv_cache_memory_bytes=64 << 20)
ON = {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": SIZES},
      "ascend_graph": {"parity_interval": 3}}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny seeded transformers Llama saved with ``save_pretrained``, and its greedy tokens."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, tie_word_embeddings=True,
        initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms start at one: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    assert "lm_head.weight" not in _tensor_names(path)  # tied: the checkpoint has no head
    return str(path), greedy_tokens(model, PROMPTS)


def _tensor_names(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


def generation(path: str, additional_config: dict | None = None) -> dict:
    llm = dict(LLM_ARGS, **({"additional_config": additional_config} if additional_config else {}))
    return {"model": path, "llm": llm, "prompts": PROMPTS, "max_tokens": NEW_TOKENS, "repeats": 2}


def test_llama_graph_mode_tokens_equal_stock_vllm_and_transformers(vllm_run, llama):
    path, expected = llama
    stock, graph = generate_in_turn(vllm_run, generation(path), generation(path, ON))  # one vLLM subprocess
    assert stock["plugin_loaded"] and stock["model_class"] == "LlamaForCausalLM"  # loaded, inert
    assert stock["tokens"] == expected
    assert graph["model_class"] == "AscendGraphLlamaForCausalLM"
    assert graph["tokens"] == expected
    stats = graph["stats"]
    assert_graph_counters(stats, generations=2)  # max_num_seqs 4, as test_vllm_plugin's
    assert_captured_at_start(graph)
    assert stats["parity_checks"] == 2 * (NEW_TOKENS - 1) // 3 and stats["parity_failures"] == 0


def test_an_unsupported_config_or_a_missing_tensor_fails_at_llm_construction_naming_it(vllm_run, llama, tmp_path):
    from safetensors.torch import load_file, save_file

    source = pathlib.Path(llama[0])
    scaled, partial = tmp_path / "llama3_rope", tmp_path / "missing"
    for path in (scaled, partial):
        path.mkdir()
        (path / "generation_config.json").write_bytes((source / "generation_config.json").read_bytes())
    config = json.loads((source / "config.json").read_text())
    rope = {"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (scaled / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    (scaled / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    (partial / "config.json").write_text(json.dumps(config))
    missing = "model.layers.1.mlp.up_proj.weight"
    tensors = load_file(str(source / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if k != missing}, str(partial / "model.safetensors"))
    attempts = [dict(LLM_ARGS, model=str(p), additional_config=ON) for p in (scaled, partial)]
    errors = vllm_run({"model": str(source), "attempts": attempts})["errors"]
    for error, named in zip(errors, ("rope_parameters.rope_type='llama3'", missing)):
        assert error is not None and named in error["message"], error
