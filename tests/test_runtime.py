"""Weights moved onto huge pages keep their values and the model's outputs."""

from __future__ import annotations

import pytest
import torch

from runner_helpers import Schedule, make_runner

from ascend_graph.config import GraphConfig
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
from ascend_graph.runtime import (HUGE_PAGE, anon_huge_page_bytes, huge_pages_supported, on_huge_pages,
                                  weights_on_huge_pages)

needs_madvise = pytest.mark.skipif(not huge_pages_supported(), reason="no madvise(MADV_HUGEPAGE) here")


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@needs_madvise
def test_tensor_on_huge_pages_is_an_aligned_equal_copy_backed_by_huge_pages_where_the_kernel_allows():
    t = torch.randn(3 * HUGE_PAGE // 4).to(torch.bfloat16).view(-1, 256)  # 1.5 MiB of bf16 -> 3 MiB region
    before = anon_huge_page_bytes()
    h = on_huge_pages(t)
    assert torch.equal(h, t) and h.shape == t.shape and h.dtype == t.dtype and h.is_contiguous()
    assert h.data_ptr() % HUGE_PAGE == 0 and h.data_ptr() != t.data_ptr()
    if _thp_mode() in ("always", "madvise"):  # the kernel grants the advice
        assert anon_huge_page_bytes() - before >= HUGE_PAGE
    del t
    h.add_(1)  # the mapping outlives the source and stays writable
    assert torch.isfinite(h.float()).all()


@needs_madvise
def test_model_weights_moved_keep_outputs_and_only_large_cpu_parameters_move():
    model = DeepseekForCausalLM(DeepseekConfig.small(), seed=0).eval()
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    ids = torch.tensor([3, 5, 7])
    min_bytes = 64 * 1024
    large = {n for n, p in params.items() if p.numel() * p.element_size() >= min_bytes}
    assert large and len(large) < len(params)  # the test moves some parameters, not all
    derived = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                  if n.endswith((".w_uk_t", ".w_uv")) and b.numel() * b.element_size() >= min_bytes)
    moved = weights_on_huge_pages(model, min_bytes=min_bytes)
    after = dict(model.named_parameters())
    assert moved == sum(values[n].numel() * values[n].element_size() for n in large) + derived
    for n, p in after.items():
        assert torch.equal(p, values[n]) and isinstance(p, torch.nn.Parameter)
        assert (p is not params[n]) == (n in large)
        if n in large:
            assert p.data_ptr() % HUGE_PAGE == 0
    emb = model.model.embed_tokens.weight
    assert emb is after["model.embed_tokens.weight"] and torch.equal(emb[ids], values["model.embed_tokens.weight"][ids])

    # the same prompt through a twin left as torch allocated it: identical logits
    twin = DeepseekForCausalLM(DeepseekConfig.small(), seed=0).eval()
    logits = []
    for m in (model, twin):
        runner = make_runner(m, GraphConfig())
        sched = Schedule()
        logits.append(runner.execute([sched.add(0, [3, 5, 7, 11], new_tokens=1)]))
    assert torch.equal(logits[0], logits[1])


@needs_madvise
def test_derived_weight_forms_move_with_the_weights():
    """MLA's W_UK / W_UV (non-persistent buffers built from kv_b_proj) are streamed like weights."""
    model = DeepseekForCausalLM(DeepseekConfig.small(), seed=0).eval()
    derived = {n: b.clone() for n, b in model.named_buffers() if n.endswith((".w_uk_t", ".w_uv"))}
    assert derived
    weights_on_huge_pages(model, min_bytes=0)
    for n, b in model.named_buffers():
        if n in derived:
            assert torch.equal(b, derived[n]) and b.data_ptr() % HUGE_PAGE == 0, n


@needs_madvise
def test_a_tied_parameter_moves_once_and_stays_tied():
    """Llama's tied embedding and LM head: one moved tensor, counted once, not two copies."""
    from ascend_graph.models.llama import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True))
    tied = model.lm_head.weight
    assert tied is model.embed_tokens.weight
    value, nbytes = tied.detach().clone(), tied.numel() * tied.element_size()
    others = sum(p.numel() * p.element_size() for p in model.parameters() if p is not tied)
    moved = weights_on_huge_pages(model, min_bytes=0)
    assert model.lm_head.weight is model.embed_tokens.weight and model.lm_head.weight is not tied
    assert torch.equal(model.lm_head.weight, value) and model.lm_head.weight.data_ptr() % HUGE_PAGE == 0
    assert moved == nbytes + others


def test_machine_names_the_cpu_generation_from_cpuinfo(monkeypatch):
    """A virtual machine may call every generation "AMD EPYC": family and model numbers tell them apart."""
    import io

    from ascend_graph import runtime

    text = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
            "model name\t: AMD EPYC\nflags\t\t: fpu fma avx2 avx512f avx512_bf16\n")
    monkeypatch.setattr(runtime, "open", lambda *a, **k: io.StringIO(text), raising=False)
    found = runtime.machine()
    assert (found["cpu"], found["cpu_id"]) == ("AMD EPYC", "AuthenticAMD family 26 model 2")
    assert found["cpu_flags"] == ["avx2", "fma", "avx512f", "avx512_bf16"]
    monkeypatch.setattr(runtime, "open", lambda *a, **k: io.StringIO("model name\t: a CPU\n"), raising=False)
    assert "cpu_id" not in runtime.machine() and runtime.machine()["cpu"] == "a CPU"
