"""``ascend_graph::expert_rows_mm``, the CPU kernel for the routed experts' few rows per expert:
it computes each row times its expert's weight (oracle: a float64 matmul of the same bfloat16
values, rounded once), the MoE uses it in eager and compiled mode alike, bad input is refused
before anything is written. Its other entries: ``rows_mm`` (one weight) and ``rows_bmm`` (a batch
of ``[K, N]`` matrices). Decode attention: ``test_decode_attention``; the builds and their cache:
``test_kernel_build``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ascend_graph import kernels

from test_moe_backends import _moe

needs_kernel = pytest.mark.skipif(not kernels.available(),
                                  reason="expert_rows_mm needs a C compiler and a CPU with AVX512-BF16 or AVX2 and FMA")


def _oracle(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    starts = [0] + ends[:-1].tolist()
    return torch.cat([x[s:e].double() @ w[i].double().T for i, (s, e) in enumerate(zip(starts, ends.tolist()))])


def _on_threads(threads: int, call):
    """``call()`` with torch at ``threads`` threads (the kernel's OpenMP split), then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return call()
    finally:
        torch.set_num_threads(before)


def _assert_one_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """float32 sums rounded once to bfloat16: within one bfloat16 step (2^-8 relative) of the exact sum."""
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
# K with and without a 32-wide tail; N ending in a part tile of 1 to 5 of the 6 weight rows taken together
@pytest.mark.parametrize("n,k", [(300, 2048), (125, 64), (124, 80), (9, 33), (8, 96), (7, 33)])
def test_each_row_times_its_experts_weight(n, k, threads):
    counts = torch.tensor([0, 3, 1, 5, 0, 2, 9, 4, 0, 8])  # empty experts, and rows past the 4 taken together
    ends = counts.cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(len(counts), n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(int(ends[-1]), k, generator=gen).to(torch.bfloat16)
    got = _on_threads(threads, lambda: torch.ops.ascend_graph.expert_rows_mm(x, w, ends))
    exact = _oracle(x, w, ends)
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    _assert_one_rounding(got, exact)
    if k % 8 == 0:  # _grouped_mm needs 16-byte strides
        torch.testing.assert_close(got, torch._grouped_mm(x, w.transpose(1, 2), offs=ends), atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("tokens", [16, 1])
def test_eager_and_compiled_moe_both_call_the_kernel_and_agree_with_grouped_mm(monkeypatch, tokens):
    """The cpu_kernel MoE backend (bfloat16 where the kernel runs) multiplies in the kernel in eager
    and compiled steps alike, one token included: the same output, bit for bit, and within
    rounding of ``torch._grouped_mm``'s."""
    moe = _moe().to(torch.bfloat16)
    assert moe.backend.name == "cpu_kernel"
    decode = lambda x, w, e: moe.backend.decode(moe.experts, x, w, e)  # noqa: E731
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    op = torch.ops.ascend_graph.expert_rows_mm
    calls = []
    monkeypatch.setattr(torch.ops.ascend_graph, "expert_rows_mm", lambda *a: calls.append(a) or op(*a))
    with torch.no_grad():
        weights, experts = moe.gate(x)
        eager = decode(x, weights, experts)
        assert len(calls) == 2  # gate/up and down
        plain = moe.experts.sorted_by_expert(x, weights, experts, kernel=False)
        assert len(calls) == 2
    torch.testing.assert_close(eager, plain, atol=3e-2, rtol=3e-2)
    monkeypatch.undo()

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        compiled = torch.compile(decode, backend=recording, fullgraph=True, dynamic=False)
        torch.testing.assert_close(compiled(x, weights, experts), eager, atol=0, rtol=0)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("expert_rows_mm" in t for t in targets) == 2, targets


def test_the_kernel_moe_backend_runs_for_bfloat16_and_float32_on_cpu_and_not_when_switched_off(monkeypatch):
    from ascend_graph.moe.backend import KernelMoE

    cpu = torch.device("cpu")
    assert not KernelMoE.supports(cpu, torch.float16)
    assert KernelMoE.supports(cpu, torch.bfloat16) == KernelMoE.supports(cpu, torch.float32) == kernels.available()
    monkeypatch.setenv("ASCEND_GRAPH_EXPERT_KERNEL", "0")
    assert not kernels.available() and not KernelMoE.supports(cpu, torch.bfloat16)
    assert not KernelMoE.supports(cpu, torch.float32)


@needs_kernel
@pytest.mark.parametrize("case,message", [
    ("dtype", "must be bfloat16 or float32 CPU tensors of one dtype, got torch.float32/torch.bfloat16"), ("shape", "expected x [P, K], w [X, N, K], ends [X]"),
    ("ends", "ends[-1] must be in [0, the row count 5], got 6"),
])
def test_bad_input_is_refused_naming_what_was_expected(case, message):
    w = torch.randn(3, 8, 32).to(torch.bfloat16)
    x = torch.randn(5, 32).to(torch.bfloat16)
    ends = torch.tensor([2, 2, 5], dtype=torch.int32)
    if case == "dtype":
        x = x.float()
    elif case == "shape":
        w = w[:, :, :16]
    else:
        ends = torch.tensor([2, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        torch.ops.ascend_graph.expert_rows_mm(x, w, ends)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13])
def test_rows_mm_is_a_linear_within_one_rounding(rows):
    """``rows_mm(x, w)``: ``F.linear(x, w)`` of a row-major weight, the exact sum rounded once."""
    _check_rows_mm(rows, 2080, seed=rows)  # N = 131: 21 tiles and 5 rows; K: a 32-wide tail


def _check_rows_mm(rows: int, k: int, seed: int, threads: int = 1) -> None:
    """``rows_mm`` of random ``[rows, k]`` rows by a ``[131, k]`` weight against the float64
    product (within one bf16 rounding) and aten's."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(131, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    got = _on_threads(threads, lambda: torch.ops.ascend_graph.rows_mm(x, w))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 131)
    _assert_one_rounding(got, x.double() @ w.double().T)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=5e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
# from 5 rows the wide forms (csrc/matmul_wide.c): 8 rows by 2 pairs per vector up to 8 rows (K ending
# in 1-3 elements past whole steps of 4), 16 rows by 1 pair from 9, 64 rows per pass over the
# weight (65 and 130 take more than one, the last of 1 and 2 rows); K odd, 1, even; N = 120 + 11,
# a second work item ending in part tiles
@pytest.mark.parametrize("rows,k", [(4, 2081), (5, 2081), (6, 2082), (8, 2083), (8, 1), (9, 64), (16, 95),
                                    (21, 2081), (32, 64), (33, 1), (48, 2048), (64, 95), (65, 33), (130, 64)])
def test_rows_mm_wide_forms_are_a_linear_within_one_rounding(rows, k, threads):
    _check_rows_mm(rows, k, seed=rows * k, threads=threads)


@needs_kernel
@pytest.mark.parametrize("rows", [8, 24])
def test_rows_mm_wide_forms_keep_nan_and_inf_to_their_rows(rows):
    """A NaN or an infinity in a row reaches that row's outputs only, as in aten."""
    x, w = torch.ones(rows, 64, dtype=torch.bfloat16), torch.ones(40, 64, dtype=torch.bfloat16)
    x[3, 5], x[7, 0] = float("nan"), float("inf")
    got = torch.ops.ascend_graph.rows_mm(x, w)
    assert got[3].isnan().all() and (got[7] == float("inf")).all()
    keep = torch.ones(rows, dtype=torch.bool)
    keep[[3, 7]] = False
    assert (got[keep] == 64).all()


@needs_kernel
def test_rows_mm_refuses_bad_input_by_name():
    x, w = torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows_mm: x and w must be bfloat16 or float32 CPU tensors of one dtype"):
        torch.ops.ascend_graph.rows_mm(x.float(), w)
    with pytest.raises(ValueError, match="rows_mm: x and w must be bfloat16 or float32 .* got torch.float16"):
        torch.ops.ascend_graph.rows_mm(x.half(), w.half())
    with pytest.raises(ValueError, match=r"rows_mm: expected x \[M, K\] and w \[N, K\]; got \(2, 32\), \(8, 16\)"):
        torch.ops.ascend_graph.rows_mm(x, w[:, :16])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
# M: tiles of 8 rows and part tiles; K: odd (a last pair with 0), 1, and past one panel of pairs
# (N = 512: 64 pairs per panel); N: whole and part column blocks of 32
@pytest.mark.parametrize("m,k,n", [(16, 256, 512), (3, 37, 45), (9, 2049, 70), (1, 1, 1), (32, 128, 512),
                                   (13, 200, 33)])
def test_rows_bmm_is_a_bmm_within_one_rounding(m, k, n, threads):
    """``rows_bmm(x, w)``: ``torch.bmm`` over ``[K, N]`` matrices, the exact sum rounded once."""
    gen = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(5, m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(5, k, n, generator=gen).to(torch.bfloat16)
    got = _on_threads(threads, lambda: torch.ops.ascend_graph.rows_bmm(x, w))
    assert got.dtype == torch.bfloat16 and got.shape == (5, m, n)
    _assert_one_rounding(got, x.double() @ w.double())
    torch.testing.assert_close(got, torch.bmm(x, w), atol=5e-2, rtol=2e-2)


@needs_kernel
def test_rows_bmm_reads_strided_entries_and_keeps_nan_and_inf_to_their_rows():
    """Per-head ``[Dn, C]`` slices of a checkpoint's ``[H, Dn + Dv, C]`` ``kv_b_proj`` (entries
    apart, rows contiguous) as they lie;
    a NaN or an infinity in a row reaches that row's outputs only."""
    gen = torch.Generator().manual_seed(11)
    kv_b = torch.randn(4, 24, 64, generator=gen).to(torch.bfloat16)  # [H, Dn + Dv, C]
    w_uk = kv_b[:, :16]  # [H, Dn, C]: stride 24 * 64 between heads
    q = torch.randn(4, 6, 16, generator=gen).to(torch.bfloat16)
    _assert_one_rounding(torch.ops.ascend_graph.rows_bmm(q, w_uk), q.double() @ w_uk.double())
    x, w = torch.ones(2, 10, 64, dtype=torch.bfloat16), torch.ones(2, 64, 40, dtype=torch.bfloat16)
    x[0, 3, 5], x[1, 7, 0] = float("nan"), float("inf")
    got = torch.ops.ascend_graph.rows_bmm(x, w)
    assert got[0, 3].isnan().all() and (got[1, 7] == float("inf")).all()
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, 3] = keep[1, 7] = False
    assert (got[keep] == 64).all()


@needs_kernel
def test_rows_bmm_refuses_bad_input_by_name():
    x, w = torch.zeros(2, 3, 32, dtype=torch.bfloat16), torch.zeros(2, 32, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows_bmm: x and w must be bfloat16"):
        torch.ops.ascend_graph.rows_bmm(x, w.float())
    with pytest.raises(ValueError, match=r"rows_bmm: expected x \[X, M, K\] and w \[X, K, N\]; got \(2, 3, 32\), \(2, 16, 8\)"):
        torch.ops.ascend_graph.rows_bmm(x, w[:, :16])


# ---- float32: the same forms over float32 weights (csrc/matmul_f32.c) ----

def _assert_float32_sums(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, exact: torch.Tensor) -> None:
    """float32 sums of K products: within K * 2^-23 of the sum of |products| (the float32 error
    bound of any summation order) of the float64 product ``exact``."""
    bound = (x.double().abs() @ w.double().abs().transpose(-1, -2)) * x.shape[-1] * 2 ** -23
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= bound + 1e-30).all()


@needs_kernel
@settings(max_examples=40, deadline=None)
# rows per expert: the tiles (AVX-512 up to 8, AVX2 up to 15 and the rest past whole chunks of 16),
# the wide form from 9 rows (AVX2: 16), past one chunk of 64; K with and without a tail of a
# load's 16, odd (a last pair with 0); N ending in part tiles
@given(counts=st.lists(st.sampled_from([0, 1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 33, 64, 70]), min_size=1, max_size=4),
       n=st.sampled_from([1, 5, 7, 13, 121, 250]), k=st.sampled_from([1, 15, 16, 17, 33, 130]),
       threads=st.sampled_from([1, 2]), seed=st.integers(0, 2 ** 16))
def test_float32_rows_times_their_experts_weight_within_float32_sums(counts, n, k, threads, seed):
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(len(counts), n, k, generator=gen)
    x = torch.randn(int(ends[-1]), k, generator=gen)
    got = _on_threads(threads, lambda: torch.ops.ascend_graph.expert_rows_mm(x, w, ends))
    starts = [0] + ends[:-1].tolist()
    for e, (s, t) in enumerate(zip(starts, ends.tolist())):
        _assert_float32_sums(got[s:t], x[s:t], w[e], x[s:t].double() @ w[e].double().T)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 8, 9, 16, 32, 64, 65])
def test_float32_rows_mm_is_a_linear_within_float32_sums(rows):
    """At a checkpoint's width (K = 2048, N past one work item of 120 weight rows)."""
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(250, 2048, generator=gen), torch.randn(rows, 2048, generator=gen)
    got = torch.ops.ascend_graph.rows_mm(x, w)
    _assert_float32_sums(got, x, w, x.double() @ w.double().T)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=1e-3, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("rows", [3, 8, 24])  # AVX-512: one weight row at a time, the tiles, the wide form
def test_float32_forms_keep_nan_and_inf_to_their_rows(rows):
    """A NaN or an infinity in a row reaches that row's outputs only, as in aten."""
    x, w = torch.ones(rows, 64), torch.ones(40, 64)
    x[1, 5], x[rows - 1, 0] = float("nan"), float("inf")
    got = torch.ops.ascend_graph.rows_mm(x, w)
    assert got[1].isnan().all() and (got[rows - 1] == float("inf")).all()
    keep = torch.ones(rows, dtype=torch.bool)
    keep[[1, rows - 1]] = False
    assert (got[keep] == 64).all()
