"""Every routed-expert form computes the oracle's sum, eager and compiled, whatever the batch."""

from __future__ import annotations

import pytest
import torch

from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
from ascend_graph.moe.layer import MoE

from test_deepseek_model import _moe_oracle


def _moe(seed: int = 3) -> MoE:
    return DeepseekForCausalLM(DeepseekConfig.small_v3(), seed=seed).model.layers[1].mlp


@pytest.mark.parametrize("form", ["gathered", "gathered_by_expert", "sorted_by_expert", "grouped", "decode"])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_each_expert_form_matches_per_token_loop(form, tokens):
    moe = _moe()
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        weights, experts = moe.gate(x)
        routed = getattr(moe.experts, form)(x, weights, experts)
        got = routed + moe.shared_experts(x)
    torch.testing.assert_close(got.double(), _moe_oracle(moe, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8, 16])  # T*K below and above 3x the expert count: both compiled forms
def test_compiled_decode_form_matches_eager(tokens, dtype):
    moe = _moe().to(dtype)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    with torch.no_grad():
        compiled = torch.compile(moe, backend="inductor", fullgraph=True, dynamic=False)
        torch.testing.assert_close(compiled(x), moe(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens", [1, 3])
def test_compiled_gathered_by_expert_matches_eager_and_decode_picks_it_for_large_experts(tokens, monkeypatch):
    import ascend_graph.moe.layer as moe_module

    moe = _moe().to(torch.bfloat16)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.no_grad():
        weights, experts = moe.gate(x)
        eager = moe.experts.gathered_by_expert(x, weights, experts)
        form = torch.compile(moe.experts.gathered_by_expert, backend="inductor", fullgraph=True, dynamic=False)
        torch.testing.assert_close(form(x, weights, experts), eager, atol=3e-2, rtol=3e-2)
    picked = []
    for name in ("gathered", "gathered_by_expert"):
        monkeypatch.setattr(moe.experts, name, (lambda n: lambda *a: picked.append(n))(name))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the compiled branch of decode
    monkeypatch.setattr(moe.experts, "uses_kernel", lambda x: False)  # as on a CPU without expert_rows_mm
    small = moe.experts.expert_bytes
    for threshold in (small + 1, small):
        monkeypatch.setattr(moe_module, "SORT_PAIRS_MIN_EXPERT_BYTES", threshold)
        moe.experts.decode(x, weights, experts)
    assert picked == ["gathered", "gathered" if tokens == 1 else "gathered_by_expert"]


@pytest.mark.parametrize("tokens", [1, 3])
def test_compiled_decode_on_a_gpu_with_grouped_mm_takes_the_sorted_form_at_every_batch(tokens, monkeypatch):
    """Where ``torch._grouped_mm`` runs on the GPU (``grouped_mm_on_gpu``), the compiled decode form
    is ``sorted_by_expert`` without the CPU kernel, from one token on; tests/test_cuda.py runs it
    on a GPU. Here: the choice, with the GPU check stood in for."""
    import ascend_graph.moe.layer as moe_module

    moe = _moe().to(torch.bfloat16)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    assert not moe_module.grouped_mm_on_gpu(x)  # a CPU tensor
    with torch.no_grad():
        weights, experts = moe.gate(x)
    picked = []
    monkeypatch.setattr(moe.experts, "sorted_by_expert", lambda *a, kernel=None: picked.append(kernel))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(moe.experts, "uses_kernel", lambda x: False)
    monkeypatch.setattr(moe_module, "grouped_mm_on_gpu", lambda x: True)
    moe.experts.decode(x, weights, experts)
    assert picked == [False]
