"""Every routed-expert form and MoE backend computes the oracle's sum, eager and compiled, whatever
the batch; each backend runs the same form in both modes."""

from __future__ import annotations

import pytest
import torch

from ascend_graph import kernels
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
from ascend_graph.moe import MOE_BACKENDS, MoE, select_moe_backend
from ascend_graph.moe import backend as moe_backend

from test_deepseek_model import _moe_oracle

FORM_OF = {"cpu_kernel": "sorted_by_expert", "grouped_mm": "sorted_by_expert", "gathered": "gathered"}


def _moe(seed: int = 3) -> MoE:
    return DeepseekForCausalLM(DeepseekConfig.small_v3(), seed=seed).model.layers[1].mlp


def _runnable(dtype: torch.dtype) -> list[str]:
    return [cls.name for cls in MOE_BACKENDS if cls.supports(torch.device("cpu"), dtype)]


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_each_expert_form_matches_per_token_loop(tokens):
    moe = _moe()
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    forms = {"gathered": {}, "gathered_by_expert": {}, "sorted_by_expert": {"kernel": False}, "grouped": {}}
    with torch.no_grad():
        weights, experts = moe.gate(x)
        for form, kwargs in forms.items():
            got = getattr(moe.experts, form)(x, weights, experts, **kwargs) + moe.shared_experts(x)
            torch.testing.assert_close(got.double(), _moe_oracle(moe, x), atol=1e-5, rtol=1e-5, msg=form)


def test_selection_prefers_the_kernel_then_grouped_mm_and_names_bad_requests():
    cpu = torch.device("cpu")
    for dtype in (torch.float32, torch.bfloat16):
        assert select_moe_backend(cpu, dtype).name == ("cpu_kernel" if kernels.available() else "grouped_mm")
    assert select_moe_backend(cpu, torch.float16).name == "grouped_mm"
    assert select_moe_backend(cpu, torch.float32, "gathered").name == "gathered"
    with pytest.raises(ValueError, match="moe backend must be one of"):
        select_moe_backend(cpu, torch.float32, "fused")
    with pytest.raises(ValueError, match="does not run for torch.float16 weights on cpu"):
        select_moe_backend(cpu, torch.float16, "cpu_kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 8])
def test_every_backend_compiled_matches_eager_and_the_oracle(tokens, dtype):
    moe = _moe().to(dtype)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(7)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    for name in _runnable(dtype):
        moe.backend = select_moe_backend(torch.device("cpu"), dtype, name)
        with torch.no_grad():
            eager = moe(x)
            compiled = torch.compile(moe, backend="inductor", fullgraph=True, dynamic=False)
            torch.testing.assert_close(compiled(x), eager, atol=tol, rtol=tol, msg=name)
            torch.testing.assert_close(eager.double(), _moe_oracle(moe, x), atol=tol, rtol=tol, msg=name)
        torch._dynamo.reset()


def _routed(tokens: int) -> tuple:
    """A MoE layer, ``tokens`` rows and the gate's choice for them."""
    moe = _moe()
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        weights, experts = moe.gate(x)
    return moe, x, weights, experts


@pytest.mark.parametrize("tokens", [1, 3])
def test_each_backend_runs_the_same_form_eager_and_compiled(tokens, monkeypatch):
    moe, x, weights, experts = _routed(tokens)
    for name in _runnable(torch.float32):
        backend = select_moe_backend(torch.device("cpu"), torch.float32, name)
        picked = []
        for form in ("gathered", "gathered_by_expert", "sorted_by_expert"):
            monkeypatch.setattr(moe.experts, form, (lambda n: lambda *a, **k: picked.append(n))(form))
        backend.decode(moe.experts, x, weights, experts)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # nothing may branch on it
        backend.decode(moe.experts, x, weights, experts)
        monkeypatch.undo()
        assert picked == [FORM_OF[name]] * 2, name


@pytest.mark.parametrize("tokens", [1, 3])
def test_gathered_backend_sorts_pairs_only_for_large_experts(tokens, monkeypatch):
    moe, x, weights, experts = _routed(tokens)
    picked = []
    for name in ("gathered", "gathered_by_expert"):
        monkeypatch.setattr(moe.experts, name, (lambda n: lambda *a: picked.append(n))(name))
    small = moe.experts.expert_bytes
    for threshold in (small + 1, small):
        monkeypatch.setattr(moe_backend, "SORT_PAIRS_MIN_EXPERT_BYTES", threshold)
        select_moe_backend(torch.device("cpu"), torch.float32, "gathered").decode(moe.experts, x, weights, experts)
    assert picked == ["gathered", "gathered" if tokens == 1 else "gathered_by_expert"]


def test_grouped_mm_backend_runs_on_cuda_only_from_compute_capability_9(monkeypatch):
    """tests/test_cuda.py runs it on a GPU; here the rule, with the device's answer stood in for."""
    cls = moe_backend.GroupedMMMoE
    for capability, expected in (((8, 0), False), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: c)
        assert cls.supports(torch.device("cuda"), torch.bfloat16) is expected
    assert not cls.supports(torch.device("cuda"), torch.float32)
