"""The routed experts in vLLM's fused-MoE kernel (``ascend_graph.vllm.moe``), in this process.

Oracles: the experts' weighted sum in float64 over the weights as loaded (before packing), for
decode and prefill batches, with the intermediate size padded (40 -> 64) and not; the same
model's eager greedy tokens for its graph steps. Needs vLLM in this interpreter (the ``[vllm]``
extra); skipped without it, except where ``$ASCEND_GRAPH_REQUIRE_VLLM`` is set (CI), where that fails.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from ascend_graph.config import GraphConfig
from ascend_graph.engine import Engine
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
from ascend_graph.moe import MoE

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("ASCEND_GRAPH_REQUIRE_VLLM"):
        pytest.fail("no vLLM: pip install 'ascend-graph[vllm]'", pytrace=False)
    pytest.skip("no vLLM in this interpreter", allow_module_level=True)

from ascend_graph.vllm import moe as vmoe  # noqa: E402

pytestmark = pytest.mark.xdist_group("vllm")


def small_model(dtype: torch.dtype, intermediate: int) -> DeepseekForCausalLM:
    config = DeepseekConfig.small(num_hidden_layers=2, moe_intermediate_size=intermediate)
    return DeepseekForCausalLM(config, dtype=dtype, device="cpu", seed=0).eval()


def reference(experts_before: dict, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * down(silu(gate(x)) * up(x)) of expert ids[t, k], in float64."""
    gate_up, down = experts_before["gate_up_proj"].double(), experts_before["down_proj"].double()
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (gate_up[e] @ x[t].double()).chunk(2)
            out[t] += weights[t, k].double() * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("intermediate", [32, 40])
def test_vllms_kernel_over_packed_weights_gives_the_experts_weighted_sum(dtype, intermediate):
    model = small_model(dtype, intermediate)
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    before = [{k: v.detach().clone() for k, v in b.experts.named_parameters()} for b in blocks]
    assert vmoe.use_vllm_fused_moe(model) == len(blocks) > 0
    assert model.backends()["moe"] == "vllm_fused_moe"
    assert blocks[0].experts.down_proj.shape[-1] == (64 if intermediate == 40 else 32)  # padded as vLLM pads
    gen = torch.Generator().manual_seed(1)
    config = model.config
    for block, weights_before in zip(blocks, before):
        for tokens in (1, 5, 19):
            x = torch.randn(tokens, config.hidden_size, generator=gen).to(dtype)
            ids = torch.stack([torch.randperm(config.n_routed_experts, generator=gen)[:config.num_experts_per_tok]
                               for _ in range(tokens)])
            weights = torch.rand(tokens, config.num_experts_per_tok, generator=gen)
            want = reference(weights_before, x, weights, ids)
            tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: rounded inputs, intermediates and output
            for path in (block.backend.decode, block.backend.prefill):
                got = path(block.experts, x, weights, ids).double()
                assert (got - want).abs().max() <= tol * (want.abs().max() + 1)


def test_packed_experts_refuse_another_backend_by_name():
    model = small_model(torch.float32, 32)
    vmoe.use_vllm_fused_moe(model)
    with pytest.raises(ValueError, match="packed for 'vllm_fused_moe'"):
        model.select_backends(moe="cpu_kernel")
    assert model.select_backends()["moe"] == "vllm_fused_moe"  # the automatic choice keeps it


def test_graph_steps_over_vllms_kernel_give_eager_tokens():
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    tokens = {}
    for enabled in (True, False):
        model = small_model(torch.float32, 40)
        vmoe.use_vllm_fused_moe(model)
        engine = Engine(model, graph_config=GraphConfig(enabled=enabled, capture_sizes=(1, 4), max_batch_size=4,
                                                        fallback_on_compile_error=False), block_size=16,
                        max_model_len=64)
        tokens[enabled] = engine.generate(prompts, 6, ignore_eos=True)
        if enabled:
            assert engine.stats["graph_steps"] == 5 and engine.stats["recompiles"] == 0
    assert tokens[True] == tokens[False]


def test_amx_only_for_bfloat16_with_aligned_sizes(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert vmoe.kernel_isa(torch.bfloat16, 2048, 1408) == "amx"
    assert vmoe.kernel_isa(torch.float32, 2048, 1408) == "vec"
    assert vmoe.kernel_isa(torch.bfloat16, 2048, 1400) == "vec"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert vmoe.kernel_isa(torch.bfloat16, 2048, 1408) == "vec"
