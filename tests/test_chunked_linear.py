"""``ChunkedLinear``: CPU linears with long rows, read in chunks from a chunk-major layout.

Oracle: ``F.linear`` of the checkpoint-shaped ``[N, K]`` weight, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
from ascend_graph.layers import ChunkedLinear, linear
from ascend_graph.runtime import LONG_REDUCTION, weights_on_huge_pages


def assert_chunk_major(w: torch.Tensor, chunks: int) -> None:
    assert w.dim() == 3 and w.shape[1] == chunks
    assert w.permute(1, 0, 2).is_contiguous()  # storage [C, N, K/C]
    assert all(w[:, c].is_contiguous() for c in range(chunks))


def filled(layer: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return layer


def test_linear_is_a_chunked_linear_on_cpu_for_long_rows_only():
    long = linear(8200, 40, torch.float32)  # 8200 = 4 x 2050: the fewest equal chunks <= 4096
    assert isinstance(long, ChunkedLinear) and long.chunks == 4
    assert tuple(long.weight.shape) == (40, 8200) and not long.chunk_major  # the checkpoint's, until processed
    long.process_weights_after_loading()
    assert tuple(long.weight.shape) == (40, 4, 2050)
    assert_chunk_major(long.weight, 4)
    assert type(linear(LONG_REDUCTION, 40, torch.float32)) is torch.nn.Linear
    assert type(linear(8200, 40, torch.float32, chunked=False)) is torch.nn.Linear
    assert type(linear(8200, 40, torch.float32, device="meta")) is torch.nn.Linear  # CPU only


def test_chunked_linear_rejects_unequal_chunks():
    with pytest.raises(ValueError, match="in_features 8200 does not split into 3 equal chunks"):
        ChunkedLinear(8200, 40, 3, torch.float32)


@pytest.mark.parametrize("processed", [False, True], ids=["row_major", "chunk_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [(1,), (5,), (2, 3)])
def test_chunked_linear_equals_linear_of_its_checkpoint_weight(dtype, bias, rows, processed):
    """Each chunk's product is rounded to ``dtype`` (as ``F.linear`` rounds it), the sum is
    float32: the error is within one rounding of each partial and of the total, plus float32
    accumulation (``1e-5`` of the sum of the products' magnitudes)."""
    layer = filled(linear(10944, 48, dtype, bias=bias))
    w = layer.weight.detach().double()  # [N, K], the checkpoint's
    if processed:
        layer.process_weights_after_loading()
    x = torch.randn(*rows, 10944, generator=torch.Generator().manual_seed(1)).to(dtype)
    partials = [F.linear(xc, wc) for xc, wc in zip(x.double().chunk(3, -1), w.chunk(3, -1))]
    want = sum(partials) + (0 if layer.bias is None else layer.bias.detach().double())
    with torch.no_grad():
        got = layer(x)
    assert got.dtype == dtype and got.shape == (*rows, 48)
    unit = torch.finfo(dtype).eps  # two half-units of rounding
    bound = unit * (sum(p.abs() for p in partials) + want.abs()) + 1e-5 * F.linear(x.double().abs(), w.abs())
    assert ((got.double() - want).abs() <= bound).all(), ((got.double() - want).abs() / bound).max()


def test_both_layouts_compute_the_same_bits():
    row_major = filled(linear(8200, 24, torch.bfloat16))
    chunk_major = filled(linear(8200, 24, torch.bfloat16))
    chunk_major.process_weights_after_loading()
    x = torch.randn(3, 8200, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(row_major(x), chunk_major(x))


def test_state_dict_is_the_checkpoint_weight_in_either_layout():
    layer = filled(linear(8200, 24, torch.float32, bias=True))
    checkpoint = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.process_weights_after_loading()
    state = layer.state_dict()
    assert state["weight"].shape == (24, 8200) and torch.equal(state["weight"], checkpoint["weight"])
    fresh = linear(8200, 24, torch.float32, bias=True)
    fresh.process_weights_after_loading()
    fresh.load_state_dict(checkpoint)  # [N, K] into the chunk-major layout
    assert_chunk_major(fresh.weight, 4)
    assert torch.equal(fresh.weight.flatten(1), checkpoint["weight"])


def test_model_casts_and_huge_pages_keep_the_chunk_major_storage():
    model = DeepseekForCausalLM(DeepseekConfig.small(intermediate_size=8200), seed=1)
    down = model.model.layers[0].mlp.down_proj
    assert isinstance(down, ChunkedLinear)
    values = down.weight.detach().to(torch.bfloat16).clone()
    model.to(torch.bfloat16)
    weights_on_huge_pages(model, min_bytes=0)
    assert_chunk_major(down.weight, 4)
    assert torch.equal(down.weight, values)
