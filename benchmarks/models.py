"""The models the suite measures: the built-in small DeepSeek and a DeepSeek-V2-Lite-shaped slice.

The slice has V2-Lite's real dimensions (hidden 2048, 16 heads, kv_lora_rank 512, qk 128 + 64,
v 128, 64 routed + 2 shared experts, top-6, moe_intermediate 1408, intermediate 10944, vocabulary
102400) but only 2 layers: the first dense, the second MoE. bfloat16, seeded random weights.
Also here: the same configuration as transformers builds it (what a user runs without this
project, ``HFDecoder``), and the decode batches both are timed on (prefilled, or over caches
filled with random entries).
"""

from __future__ import annotations

import inspect
from typing import Callable
from dataclasses import dataclass

import torch

from ascend_graph.engine.block_manager import BlockManager
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
from ascend_graph.models.deepseek_config import RopeScaling
from ascend_graph.kv_cache import write_kv_cache
from ascend_graph.runner import GraphRunner, SequenceStep
from ascend_graph.runtime import weights_on_huge_pages

V2_LITE_YARN = RopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                           mscale=0.707, mscale_all_dim=0.707)


@dataclass(frozen=True)
class ModelCase:
    """One model the suite decodes with: its config, dtype, and the context it decodes at."""

    name: str
    config: DeepseekConfig
    dtype: torch.dtype
    context: int

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def v2_lite_slice(layers: int = 2, vocab_size: int = 102400) -> DeepseekConfig:
    """DeepSeek-V2-Lite's dimensions, ``layers`` deep (the first dense, the rest MoE)."""
    return DeepseekConfig(
        vocab_size=vocab_size, hidden_size=2048, intermediate_size=10944, num_hidden_layers=layers,
        num_attention_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        moe_intermediate_size=1408, n_group=1, topk_group=1, topk_method="greedy", scoring_func="softmax",
        norm_topk_prob=False, routed_scaling_factor=1.0, first_k_dense_replace=1, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=V2_LITE_YARN, max_position_embeddings=163840)


def cases(quick: bool) -> dict[str, ModelCase]:
    """The small model (float32, context 64), the V2-Lite slice (bfloat16), and the slice as
    ``benchmarks.vllm_peer``'s v2lite checkpoint in float32 (vocabulary 4096, context 32: its
    16-token prompts and their new tokens)."""
    return {"small": ModelCase("small", DeepseekConfig.small(), torch.float32, 64),
            "v2_lite_slice": ModelCase("v2_lite_slice", v2_lite_slice(), torch.bfloat16, 128 if quick else 256),
            "v2_lite_fp32": ModelCase("v2_lite_fp32", v2_lite_slice(vocab_size=4096), torch.float32, 32)}


def build(case: ModelCase, huge_pages: bool = True, device: str = "cpu") -> DeepseekForCausalLM:
    """Our model of ``case`` with seeded random weights, on huge pages as ``load_deepseek`` puts
    a checkpoint's (``huge_pages=False``: as torch allocated them); on ``device`` (no huge pages
    off the CPU)."""
    model = DeepseekForCausalLM(case.config, dtype=case.dtype, device=device, seed=0).eval()
    if huge_pages and torch.device(device).type == "cpu":
        weights_on_huge_pages(model)
    return model


def make_runner(model: DeepseekForCausalLM, config, sizes: tuple[int, ...], context: int,
                num_blocks: int | None = None, block_size: int = 16, max_model_len: int | None = None,
                **kwargs) -> GraphRunner:
    """A runner with room for every batch of ``sizes`` at ``context`` tokens, its graphs' block
    tables ``max_model_len`` wide (default ``context``; ``kwargs``: GraphRunner's)."""
    if num_blocks is None:
        num_blocks = 2 + sum(sizes) * -(-context // block_size)
    return GraphRunner(model, config, num_blocks=num_blocks, block_size=block_size,
                       max_model_len=max_model_len or context, **kwargs)


def decode_batch(runner: GraphRunner, blocks: BlockManager, n: int, context: int) -> list[SequenceStep]:
    """``n`` sequences with ``context - 1`` tokens prefilled (eagerly); their next decode step."""
    vocab = runner.model.config.vocab_size
    entries = []
    for i in range(n):
        seq_id = (n, i)
        prompt = [(7 * i + j) % vocab for j in range(context - 1)]
        runner.execute([SequenceStep(prompt, 0, blocks.ensure(seq_id, context - 1))], mode="eager")
        entries.append(SequenceStep([1], context - 1, blocks.ensure(seq_id, context)))
    return entries


def filled_tables(runner: GraphRunner, blocks: BlockManager, n: int, context: int, seed: int = 0) -> list:
    """Block tables of ``n`` sequences of ``context`` tokens whose every slot holds a seeded random
    entry, written through ``kv_cache.write_kv_cache``, in a fraction of a prefill's time (a decode
    step costs the same whatever the caches hold). Each row's tokens hold one entry per layer: its
    attention output, and so the experts its MoE layers choose, is the same at every context
    shorter than ``context``, and a sweep over contexts times what the context costs alone."""
    gen = torch.Generator().manual_seed(seed)
    tables = [blocks.ensure(("filled", n, i), context) for i in range(n)]
    bs = runner.block_size
    slots = torch.tensor([block * bs + j for t in tables for k, block in enumerate(t)
                          for j in range(bs) if k * bs + j < context])  # [n * context], row by row
    for cache in runner.kv_caches:
        a, b = (torch.randn(n, *t.shape[2:], generator=gen).to(t.dtype).repeat_interleave(context, dim=0)
                for t in cache)  # [n * context, ...]: each row's entry on each of its tokens
        write_kv_cache(cache, a, b, slots)
    return tables


def decode_rows(tables: list, context: int, block_size: int, vocab: int) -> list[SequenceStep]:
    """One decode step of each table's sequence at ``context`` tokens (its first ``context - 1``
    cached, the table cut to the blocks they need)."""
    per = -(-context // block_size)
    return [SequenceStep([(7 * i + 1) % vocab], context - 1, t[:per]) for i, t in enumerate(tables)]


def hf_model(config: DeepseekConfig, dtype: torch.dtype):
    """transformers' DeepseekV2ForCausalLM with the same configuration (random weights, sdpa),
    its weights on huge pages like ours."""
    import transformers

    rope = {"rope_type": "yarn", "rope_theta": config.rope_theta, "factor": config.rope_scaling.factor,
            "original_max_position_embeddings": config.rope_scaling.original_max_position_embeddings,
            "beta_fast": config.rope_scaling.beta_fast, "beta_slow": config.rope_scaling.beta_slow,
            "mscale": config.rope_scaling.mscale, "mscale_all_dim": config.rope_scaling.mscale_all_dim}
    keys = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
            "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "first_k_dense_replace",
            "topk_method", "routed_scaling_factor", "norm_topk_prob", "max_position_embeddings", "rms_norm_eps",
            "initializer_range")
    hf_config = transformers.DeepseekV2Config(**{k: getattr(config, k) for k in keys},
                                              num_key_value_heads=config.num_attention_heads,
                                              n_group=config.n_group or 1, topk_group=config.topk_group or 1,
                                              rope_parameters=rope)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build straight in dtype: no float32 copy of a 2 GB model
    try:
        model = transformers.DeepseekV2ForCausalLM(hf_config).eval()
    finally:
        torch.set_default_dtype(old)
    model = model.to(dtype)
    weights_on_huge_pages(model)  # the same pages as ours: the comparison is about the code, not the allocator
    return model


class HFDecoder:
    """transformers' ``DeepseekV2ForCausalLM`` (``hf_model``) with one prefilled ``DynamicCache``
    per batch size: one call decodes one token of ``batch`` rows after ``context - 1`` prefilled
    tokens, logits of the last token only, and crops the cache back so every call decodes at the
    same length."""

    def __init__(self, config: DeepseekConfig, dtype: torch.dtype, context: int) -> None:
        self.model, self.context = hf_model(config, dtype), context
        self.vocab = config.vocab_size
        # transformers 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns, then goes)
        params = inspect.signature(self.model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def step_fn(self, batch: int) -> Callable[[], object]:
        """Prefill ``batch`` rows of ``context - 1`` tokens; return a function that decodes one token."""
        from transformers import DynamicCache

        ids = (torch.arange(self.context - 1)[None, :] * 7 + torch.arange(batch)[:, None]) % self.vocab
        cache = DynamicCache(config=self.model.config)
        with torch.inference_mode():
            self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_arg: cache})
        nxt = torch.ones(batch, 1, dtype=torch.long)
        pos = torch.full((batch, 1), self.context - 1, dtype=torch.long)

        def step() -> torch.Tensor:
            with torch.inference_mode():
                out = self.model(input_ids=nxt, position_ids=pos, use_cache=True, logits_to_keep=1,
                                 **{self.cache_arg: cache})
            cache.crop(-1)  # drop the token just decoded
            return out.logits

        return step
