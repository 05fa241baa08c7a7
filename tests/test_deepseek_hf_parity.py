"""Our DeepSeek V2/V3 against transformers' implementation, through a save_pretrained checkpoint.

Tiny random models are built with transformers (float32, eager attention), saved, and loaded
with ``load_deepseek``. Our model prefills a batch of prompts of different lengths into paged
tuple caches (shuffled block tables), then decodes greedily step by step. The oracle is
transformers run on each finished sequence at once (teacher forcing): its logits at every
position must match ours, and its argmax must be the token we chose — which is exactly
"transformers' own greedy generation produces the same tokens".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pytest
import torch

# transformers 5 (rope_parameters, stacked experts in memory); tested with 5.24.
transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("safetensors")

from ascend_graph import allocate_kv_caches  # noqa: E402
from ascend_graph.attention import build_attention_metadata  # noqa: E402
from ascend_graph.models import DeepseekForCausalLM, load_deepseek  # noqa: E402
from ascend_graph.layers import ChunkedLinear  # noqa: E402
from hf_models import random_prompts, tiny_hf_model  # noqa: E402

NEW_TOKENS = 32
BLOCK_SIZE = 4
FLOAT32_LOGIT_ATOL = 1e-4  # float32 against float32: a few units of rounding in the logits' sums


class Generation(NamedTuple):
    """Greedy continuations and the logits that chose them."""

    tokens: list[list[int]]  # per prompt, NEW_TOKENS ids
    logits: torch.Tensor  # [prompts, NEW_TOKENS, V] float32


def shuffled_block_tables(num_seqs: int, max_tokens: int, seed: int = 0) -> tuple[list[list[int]], int]:
    """Non-contiguous block tables (block 0 reserved) and the number of blocks they need."""
    per_seq = math.ceil(max_tokens / BLOCK_SIZE)
    num_blocks = 1 + per_seq * num_seqs
    perm = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(seed)) + 1).tolist()
    return [perm[i * per_seq:(i + 1) * per_seq] for i in range(num_seqs)], num_blocks


@torch.no_grad()
def generate_greedy(model: DeepseekForCausalLM, prompts: list[list[int]], new_tokens: int) -> Generation:
    """One batched prefill of all prompts, then ``new_tokens - 1`` batched decode steps."""
    tables, num_blocks = shuffled_block_tables(len(prompts), max(map(len, prompts)) + new_tokens)
    caches = allocate_kv_caches(model.kv_cache_specs(), num_blocks, BLOCK_SIZE)
    layout = dict(block_size=BLOCK_SIZE, num_blocks=num_blocks, max_model_len=4096)
    seqs = [list(p) for p in prompts]
    positions, meta = build_attention_metadata(tables, [0] * len(seqs), [len(p) for p in prompts], **layout)
    hidden = model(torch.tensor(sum(prompts, [])), positions, caches, meta)
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    logits = model.compute_logits(hidden[last])
    steps = []
    for step in range(new_tokens):
        steps.append(logits)
        chosen = logits.argmax(dim=-1)
        for seq, tok in zip(seqs, chosen.tolist()):
            seq.append(tok)
        if step + 1 < new_tokens:
            positions, meta = build_attention_metadata(tables, [len(s) - 1 for s in seqs], [1] * len(seqs), **layout)
            logits = model.compute_logits(model(chosen, positions, caches, meta))
    return Generation([s[len(p):] for s, p in zip(seqs, prompts)], torch.stack(steps, dim=1))


@torch.no_grad()
def hf_logits_for(hf_model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """transformers' logits ``[len(continuation), V]`` predicting each continuation token."""
    ids = torch.tensor(prompt + continuation)[None]
    logits = hf_model(ids).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(continuation)]


@pytest.mark.parametrize("flavour, sizes", [("v2_greedy", {}), ("v2_group_limited", {}), ("v3", {}),
                                           ("v3", {"intermediate_size": 8200})],
                         ids=["v2_greedy", "v2_group_limited", "v3", "v3_chunk_major_down_proj"])
def test_greedy_decode_matches_transformers_step_by_step(flavour, sizes, tmp_path):
    hf = tiny_hf_model(flavour, **sizes)
    hf.save_pretrained(tmp_path)
    ours = load_deepseek(tmp_path, dtype=torch.float32)
    if sizes:  # the dense layer's down projection (K = 8200) is read chunk-major
        assert isinstance(ours.model.layers[0].mlp.down_proj, ChunkedLinear)
    prompts = random_prompts()
    gen = generate_greedy(ours, prompts, NEW_TOKENS)
    for i, prompt in enumerate(prompts):
        ref = hf_logits_for(hf, prompt, gen.tokens[i])
        assert ref.std(dim=-1).min() > 0.5, "logits nearly constant: the token comparison would mean little"
        diff = (ref - gen.logits[i]).abs().max().item()
        assert diff < FLOAT32_LOGIT_ATOL, f"prompt {i}: max |logit difference| {diff:.3g}"
        assert ref.argmax(dim=-1).tolist() == gen.tokens[i], f"prompt {i}: greedy tokens differ"


def test_bfloat16_load_rounds_weights_and_stays_near_float32(tmp_path):
    hf = tiny_hf_model("v3")
    hf.save_pretrained(tmp_path)
    ours = load_deepseek(tmp_path, dtype=torch.bfloat16)
    hf_state = hf.state_dict()
    assert torch.equal(ours.model.layers[0].self_attn.kv_b_proj.weight,
                       hf_state["model.layers.0.self_attn.kv_b_proj.weight"].to(torch.bfloat16))
    assert torch.equal(ours.model.layers[1].mlp.experts.down_proj[5],
                       hf_state["model.layers.1.mlp.experts.down_proj"][5].to(torch.bfloat16))
    assert ours.model.layers[1].mlp.gate.weight.dtype == torch.float32  # routing stays float32
    prompts = random_prompts(seed=2)
    gen = generate_greedy(ours, prompts, 4)
    for i, prompt in enumerate(prompts):
        ref = hf_logits_for(hf, prompt, gen.tokens[i])
        assert torch.isfinite(gen.logits[i]).all()
        # Loose: bfloat16 flips some expert choices; transformers' own bfloat16 cast of this
        # model is up to 0.2 off its float32 logits (relative norm), ours up to ~0.1.
        rel = (ref - gen.logits[i]).norm() / ref.norm()
        assert rel < 0.3, f"prompt {i}: relative logit error {rel:.3g} in bfloat16"


def test_save_pretrained_writes_per_expert_tensors(tmp_path):
    # The loader's per-expert path is the one real checkpoints need; make sure it is exercised.
    from safetensors import safe_open
    tiny_hf_model("v2_greedy").save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in names
    assert "model.layers.1.mlp.experts.gate_up_proj" not in names
