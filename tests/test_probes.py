"""The suite's bandwidth probes read what they claim to read (their figures bound the targets)."""

import pytest
import torch

from benchmarks.roofline import CopyProbe, ReadProbe


def test_the_read_probe_reads_every_element_once():
    """The read loop's sum over its buffer equals a float64 sum of the same buffer (so no load was
    dropped or repeated), and it counts exactly the buffer's bytes; without the loop it is torch's
    ``sum`` and says so."""
    probe = ReadProbe(mib=4)
    assert probe.bytes == 4 << 20 == probe.src.numel() * 4
    if probe.lib is None:
        assert "sum" in probe.how
        return
    assert "read loop" in probe.how
    probe.src.copy_(torch.arange(probe.src.numel(), dtype=torch.float32) % 97 - 48)
    probe()
    exact = probe.src.double().sum().item()
    assert abs(probe.sink[0].item() - exact) <= 1e-6 * probe.src.double().abs().sum().item()
    probe.src[12345] += 1000.0  # one element more: the sum moves by it
    probe()
    assert abs(probe.sink[0].item() - exact - 1000.0) <= 1e-6 * probe.src.double().abs().sum().item()


def test_the_read_probe_on_two_threads_reads_each_half_once():
    """Two threads, each its half: the two sums are the halves' float64 sums; the bytes, both halves."""
    probe = ReadProbe(mib=4, threads=2)
    if probe.lib is None:
        pytest.skip("no C compiler or vector read loop here: the probe is torch's sum")
    half = probe.src.numel() // 2
    assert probe.bytes == 4 << 20 and [p.numel() for p in probe.parts] == [half, half]
    probe.src.copy_(torch.arange(probe.src.numel(), dtype=torch.float32) % 89 - 44)
    probe.src[:half] += 0.5  # the halves differ, so a thread reading the wrong one shows
    probe()
    for i, part in enumerate((probe.src[:half], probe.src[half:])):
        exact = part.double().sum().item()
        assert abs(probe.sink[16 * i].item() - exact) <= 1e-6 * part.double().abs().sum().item()


def test_a_batch_one_step_reads_every_weight_but_the_unchosen_experts_and_one_embedding_row():
    """``batch_one_bytes`` against the model's whole size less what a one-token step skips."""
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
    from benchmarks.roofline import batch_one_bytes

    c = DeepseekConfig.small()
    model = DeepseekForCausalLM(c, dtype=torch.bfloat16, device="meta", init_weights=False)
    everything = sum(p.numel() * p.element_size() for p in model.parameters())  # the router is float32
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    expert = 3 * c.hidden_size * c.moe_intermediate_size * 2  # gate, up, down
    skipped = moe_layers * (c.n_routed_experts - c.num_experts_per_tok) * expert
    skipped += (c.vocab_size - 1) * c.hidden_size * 2  # the embedding: one row
    kv = c.num_hidden_layers * 40 * (c.kv_lora_rank + c.qk_rope_head_dim) * 2
    assert batch_one_bytes(model, context=40)["total"] == everything - skipped + kv


def test_the_copy_probe_copies_its_buffer():
    probe = CopyProbe(mib=4)
    probe.src.normal_()
    probe()
    assert torch.equal(probe.dst, probe.src) and probe.bytes == 2 * (4 << 20)


def test_gqa_decode_times_every_form_against_one_oracle():
    """The attention part's standard-attention probe: ``paged_decode`` and its two earlier forms,
    eager and compiled, each within bf16 rounding of the float64 oracle."""
    from benchmarks.attention import gqa_decode

    r = gqa_decode(batch=2, context=64, heads=4, kv_heads=2, head_dim=16, reps=1)
    for name in ("eager", "compiled", "gathered_eager", "gathered_compiled", "former_eager", "former_compiled"):
        assert r[f"{name}_ms"] > 0
        assert r["max_abs_error"][name] < 0.05, r["max_abs_error"]
    assert r["graph_over_eager"] == pytest.approx(r["eager_ms"] / r["compiled_ms"])


def test_every_ascend_graph_op_the_code_names_is_defined():
    """An op removed while a benchmark still calls it (``paged_rows_mm`` after ``d413631``, in the
    full suite's attention part) fails here rather than when the suite reaches it."""
    import importlib
    import pathlib
    import re

    for module in ("ascend_graph.kernels.ops", "ascend_graph.attention.live", "ascend_graph.moe.experts",
                   "ascend_graph.kv_cache", "ascend_graph.kernels.triton_attention"):  # the modules defining ops
        importlib.import_module(module)
    root = pathlib.Path(__file__).resolve().parents[1]
    named = {name for folder in ("ascend_graph", "benchmarks", "examples") for path in (root / folder).rglob("*.py")
             for name in re.findall(r"torch\.ops\.ascend_graph\.(\w+)", path.read_text(encoding="utf-8"))}
    assert {"rows_mm", "decode_attention", "write_slots"} <= named
    assert sorted(n for n in named if not hasattr(torch.ops.ascend_graph, n)) == []
