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
