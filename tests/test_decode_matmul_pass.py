"""The CPU decode-matmul pass keeps the results: a one-row bfloat16 matmul as a reduction, a
bfloat16 matmul of 2 to ROWS_MM_MAX rows (float32: from FLOAT32_ROWS_MM_MIN) as the project's
kernel (``rows_mm``), a batch-1 bmm as an mm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ascend_graph.compile.inductor import InductorBackend
from ascend_graph.compile.passes.decode_matmul import (FLOAT32_ROWS_MM_MIN, ROWS_MM_MAX, DecodeMatmulPass,
                                                       batched_limits)
from ascend_graph import kernels


def _compiled(fn, with_pass: bool, pass_: DecodeMatmulPass | None = None):
    patches = {"post_grad_custom_post_pass": pass_ or DecodeMatmulPass()} if with_pass else {}
    return torch.compile(fn, backend=InductorBackend(patches), fullgraph=True, dynamic=False)


# one row as a reduction, or in rows_mm; 3 rows in rows_mm (aten's mm where the kernel does not run)
@pytest.mark.parametrize("rows, one_row", [(1, False), (1, True), (3, None)])
def test_single_row_bfloat16_linear_matches_float32_reference(rows, one_row):
    gen = torch.Generator().manual_seed(0)
    w1, w2 = (torch.randn(n, 64, generator=gen).to(torch.bfloat16) * 0.1 for n in (64, 96))
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    fn = lambda x: F.linear(F.silu(F.linear(x, w1)), w2)  # noqa: E731
    reference = F.linear(F.silu(F.linear(x.float(), w1.float())), w2.float())
    got = _compiled(fn, with_pass=True, pass_=DecodeMatmulPass(one_row_kernel=one_row))(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), reference, atol=2e-2, rtol=2e-2)


def test_pass_reduces_only_single_row_low_precision_matmuls():
    seen = []

    def capture(gm, inputs):
        def inspect(g: torch.fx.Graph) -> None:
            DecodeMatmulPass(one_row_kernel=False)(g)
            seen.append(sorted(str(n.target) for n in g.nodes if n.op == "call_function"))
        # no cache hits: the pass must run on both graphs
        return InductorBackend({"post_grad_custom_post_pass": _Recording(inspect), "fx_graph_cache": False})(gm, inputs)

    w = torch.randn(8, 16)
    with torch._functorch.config.patch(enable_autograd_cache=False):
        torch.compile(lambda x: F.linear(x, w.bfloat16()), backend=capture, fullgraph=True)(torch.randn(1, 16).bfloat16())
        torch.compile(lambda x: F.linear(x, w), backend=capture, fullgraph=True)(torch.randn(1, 16))
    assert "aten.mm.default" not in seen[0] and "aten.sum.dim_IntList" in seen[0]
    assert "aten.sum.dim_IntList" not in seen[1]  # float32: the kernel's rows_mm, else aten's GEMV
    assert ("ascend_graph.rows_mm.default" in seen[1]) == kernels.available() != ("aten.mm.default" in seen[1])


class _Recording(DecodeMatmulPass):
    def __init__(self, fn):
        super().__init__(one_row_kernel=False)
        self.fn = fn

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.fn(graph)


@pytest.mark.parametrize("rows", [1, 2])
def test_single_row_addmm_and_gathered_bmm_match_reference(rows):
    gen = torch.Generator().manual_seed(1)
    stacked = (torch.randn(5, 64, 48, generator=gen) * 0.1).to(torch.bfloat16)  # [X, K, N]
    w = (torch.randn(48, 64, generator=gen) * 0.1).to(torch.bfloat16)
    idx = torch.tensor([3, 0, 3])
    x = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    residual = torch.randn(rows, 48, generator=gen).to(torch.bfloat16)

    def fn(x, residual):
        gathered = torch.bmm(x[None].expand(3, -1, -1), stacked[idx])  # [3, rows, N]
        return residual + F.linear(x, w) + gathered.sum(0)

    f32 = lambda t: t.float()  # noqa: E731
    reference = (f32(residual) + f32(x) @ f32(w).T
                 + torch.bmm(f32(x)[None].expand(3, -1, -1), f32(stacked)[idx]).sum(0))
    torch.testing.assert_close(_compiled(fn, with_pass=True)(x, residual).float(), reference, atol=3e-2, rtol=3e-2)


def test_normed_row_before_the_reduction_is_stored_once_and_matches_eager():
    """The row x is stored before the reduction (not recomputed per output column) and results hold."""
    gen = torch.Generator().manual_seed(2)
    norm_w = (1 + 0.1 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    head = (torch.randn(200, 64, generator=gen) * 0.1).to(torch.bfloat16)
    h, residual = (torch.randn(1, 64, generator=gen).to(torch.bfloat16) for _ in range(2))

    def fn(h, residual):
        s = (h.float() + residual.float())
        x = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * norm_w
        return F.linear(x, head).float()

    graphs = []

    def inspect(g: torch.fx.Graph) -> None:
        DecodeMatmulPass(one_row_kernel=False)(g)
        graphs.append([str(n.target) for n in g.nodes if n.op == "call_function"])

    backend = InductorBackend({"post_grad_custom_post_pass": _Recording(inspect), "fx_graph_cache": False})
    with torch._functorch.config.patch(enable_autograd_cache=False):
        got = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(h, residual)
    ops = graphs[0]
    assert "aten.mm.default" not in ops
    assert ops.index("prims.inductor_force_stride_order.default") < ops.index("aten.sum.dim_IntList")
    torch.testing.assert_close(got, fn(h, residual), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("k, chunks", [(8192, 2), (10944, 3), (4099, 1)])  # 4099 is prime: one reduction
def test_long_reduction_is_split_into_chunks_and_matches_reference(k, chunks):
    """A reduction longer than LONG_REDUCTION is summed in equal chunks, without Inductor's
    cascade-summation helper, and keeps the result of the float64 product."""
    from torch._inductor.utils import run_and_get_code

    from ascend_graph.runtime import LONG_REDUCTION, reduction_chunks

    assert reduction_chunks(k) == chunks
    assert chunks == 1 or k // chunks <= LONG_REDUCTION < k
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(40, k, generator=gen) * 0.05).to(torch.bfloat16)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16)
    x = torch.randn(1, k, generator=gen).to(torch.bfloat16)
    fn = lambda x: F.linear(F.silu(x), w, bias)  # noqa: E731  (the row is computed in the graph)
    got, code = run_and_get_code(_compiled(fn, with_pass=True, pass_=DecodeMatmulPass(one_row_kernel=False)), x)
    reference = F.silu(x).double() @ w.double().T + bias.double()
    # bf16 output: 2**-8 relative, plus the rounding of silu(x) to bf16 before the product
    torch.testing.assert_close(got.double(), reference, atol=2e-2, rtol=1e-2)
    assert ("CascadeSumHelper" in "".join(code)) == (chunks == 1)


@pytest.mark.parametrize("batch", [1, 2])
def test_batch_of_one_bmm_runs_as_mm_and_matches_eager(batch):
    """MLA decode's scores at batch 1: ``bmm(q [1, H, C], kv [1, T, C]^T)`` over a kv that the
    graph computed. Inductor gives that buffer's size-1 batch a zero stride, and aten's CPU
    ``bmm`` then copies the operand first; the pass makes it an ``mm``. Batch 2 stays a ``bmm``."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(4)
    q = torch.randn(batch, 16, 64, generator=gen).to(torch.bfloat16)
    kv = torch.randn(batch, 48, 64, generator=gen).to(torch.bfloat16)
    fn = lambda q, kv: torch.einsum("bhc,btc->bht", q, kv * 2).softmax(-1)  # noqa: E731
    got, code = run_and_get_code(_compiled(fn, with_pass=True), q, kv)
    torch.testing.assert_close(got, fn(q, kv), atol=1e-2, rtol=1e-2)
    calls = "".join(code)
    assert ("bmm" in calls) == (batch > 1) and ("_mm" in calls or "mm(" in calls)  # batch 2: below batched_limits()


@pytest.mark.parametrize("rows, one_row", [(1, True), (1, False), (2, None), (24, None), (ROWS_MM_MAX, None),
                                           (ROWS_MM_MAX + 1, None)])  # 24: the wide form
def test_few_row_bfloat16_matmuls_run_the_kernel_and_keep_the_exact_product(rows, one_row):
    """Up to ROWS_MM_MAX rows, the linear and the residual add Inductor fuses into an ``addmm``
    both run ``rows_mm`` (where it runs here; one row only with ``one_row_kernel``, else as
    reductions); past it, aten. Each product is the exact one, rounded to bfloat16, as in eager."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(5)
    w1 = (torch.randn(96, 2080, generator=gen) * 0.05).to(torch.bfloat16)  # K with a 32-wide tail
    w2 = (torch.randn(64, 96, generator=gen) * 0.1).to(torch.bfloat16)
    x = torch.randn(rows, 2080, generator=gen).to(torch.bfloat16)
    residual = torch.randn(rows, 64, generator=gen).to(torch.bfloat16)
    fn = lambda x, r: r + F.linear(F.silu(F.linear(x, w1)), w2)  # noqa: E731
    got, code = run_and_get_code(_compiled(fn, with_pass=True, pass_=DecodeMatmulPass(one_row_kernel=one_row)),
                                 x, residual)
    kernel = kernels.available() and rows <= ROWS_MM_MAX and (rows > 1 or one_row)
    assert "".join(code).count("ascend_graph.rows_mm.default(") == (2 if kernel else 0)
    h = F.silu((x.double() @ w1.double().T).to(torch.bfloat16).float()).to(torch.bfloat16)
    reference = residual.double() + h.double() @ w2.double().T
    torch.testing.assert_close(got.double(), reference, atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(got, fn(x, residual), atol=3e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 9, 24, ROWS_MM_MAX, ROWS_MM_MAX + 1])
def test_few_row_float32_matmuls_run_the_kernel_and_keep_the_product(rows):
    """From FLOAT32_ROWS_MM_MIN (one) to ROWS_MM_MAX rows a float32 linear and the residual add
    Inductor fuses into an ``addmm`` run ``rows_mm`` (where it runs here), whatever
    ``one_row_kernel`` says of bfloat16; past it, aten. Float32 sums, as eager's."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(rows)
    w1, w2 = torch.randn(96, 2081, generator=gen) * 0.05, torch.randn(64, 96, generator=gen) * 0.1  # K: a tail
    x, residual = torch.randn(rows, 2081, generator=gen), torch.randn(rows, 64, generator=gen)
    fn = lambda x, r: r + F.linear(F.silu(F.linear(x, w1)), w2)  # noqa: E731
    got, code = run_and_get_code(_compiled(fn, with_pass=True, pass_=DecodeMatmulPass(one_row_kernel=False)),
                                 x, residual)
    kernel = kernels.available() and FLOAT32_ROWS_MM_MIN <= rows <= ROWS_MM_MAX
    assert "".join(code).count("ascend_graph.rows_mm.default(") == (2 if kernel else 0)
    reference = residual.double() + F.silu(x.double() @ w1.double().T) @ w2.double().T
    torch.testing.assert_close(got.double(), reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, fn(x, residual), atol=1e-4, rtol=1e-4)


def test_few_row_kernel_only_for_bfloat16_and_float32_row_major_weights_and_not_when_switched_off():
    def targets(fn, x, pass_):
        seen = []

        def capture(gm, inputs):
            def inspect(g: torch.fx.Graph) -> None:
                pass_(g)
                seen.extend(str(n.target) for n in g.nodes if n.op == "call_function")
            return InductorBackend({"post_grad_custom_post_pass": _Recording(inspect), "fx_graph_cache": False})(gm, inputs)

        with torch._functorch.config.patch(enable_autograd_cache=False):
            torch.compile(fn, backend=capture, fullgraph=True, dynamic=False)(x)
        return seen

    w = torch.randn(24, 32)
    x = torch.randn(4, 32)
    wb, xb = w.bfloat16(), x.bfloat16()
    kernel = "ascend_graph.rows_mm.default"
    assert (kernel in targets(lambda x: F.linear(x, wb), xb, DecodeMatmulPass())) == kernels.available()
    assert (kernel in targets(lambda x: F.linear(x, w), x, DecodeMatmulPass())) == kernels.available()  # float32
    assert kernel not in targets(lambda x: F.linear(x, w.half()), x.half(), DecodeMatmulPass())
    assert kernel not in targets(lambda x: x @ w.T.contiguous(), x, DecodeMatmulPass())  # a [K, N] weight
    assert kernel not in targets(lambda x: x @ wb.T.contiguous(), xb, DecodeMatmulPass())  # a [K, N] weight
    assert kernel not in targets(lambda x: F.linear(x, wb), xb, DecodeMatmulPass(few_rows_kernel=False))
    assert DecodeMatmulPass().uuid() != DecodeMatmulPass(few_rows_kernel=False).uuid() or not kernels.available()
    one = xb[:1]
    in_kernel = targets(lambda x: F.linear(x, wb), one, DecodeMatmulPass(one_row_kernel=True))
    reduced = targets(lambda x: F.linear(x, wb), one, DecodeMatmulPass(one_row_kernel=False))
    assert (kernel in in_kernel) == kernels.available() and kernel not in reduced
    assert "aten.sum.dim_IntList" in reduced and ("aten.sum.dim_IntList" in in_kernel) != kernels.available()
    both_off = DecodeMatmulPass(one_row_kernel=True, few_rows_kernel=False)
    assert kernel not in targets(lambda x: F.linear(x, wb), one, both_off)
    assert ((DecodeMatmulPass(one_row_kernel=True).uuid() != DecodeMatmulPass(one_row_kernel=False).uuid())
            == kernels.available())


def test_aot_inductor_packages_take_the_same_pass_and_key_whether_the_kernel_runs(monkeypatch):
    """A package calls the kernel as the Inductor backend's graphs do, and its key changes with
    whether the kernel runs here: a package is never loaded where it cannot run."""
    from ascend_graph.compile.aot_inductor import inductor_options
    from ascend_graph.config import GraphConfig, InductorOptions

    config = GraphConfig(enabled=True, backend="inductor", inductor=InductorOptions(aot=True))
    aot_pass = inductor_options(config, "cpu")["post_grad_custom_post_pass"]
    key = aot_pass.uuid()
    assert aot_pass.few_rows_kernel is True and key == DecodeMatmulPass().uuid()
    if kernels.available():
        monkeypatch.setenv("ASCEND_GRAPH_EXPERT_KERNEL", "0")
        assert inductor_options(config, "cpu")["post_grad_custom_post_pass"].uuid() != key


@pytest.mark.parametrize("heads", [3, 16])  # the tiles; the wide form
def test_batched_products_over_transposed_rows_run_the_kernel_and_keep_each_product(heads):
    """MLA decode's scores, ``bmm(q [B, H, C], kv [B, T, C]^T)`` and the same over the rope parts
    (a query sliced from a wider row, so copied first), run ``expert_rows_mm`` with one
    "expert" per batch entry; each product is the exact one rounded to bfloat16, as aten's."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(6)
    b, t, c, r = 5, 37, 96, 16
    q = torch.randn(b, heads, c + r, generator=gen).to(torch.bfloat16)
    kv = torch.randn(b, t, c, generator=gen).to(torch.bfloat16)
    pe = torch.randn(b, t, r, generator=gen).to(torch.bfloat16)

    def scores(q, kv, pe):
        return torch.einsum("bhc,btc->bht", q[..., :c], kv * 2) + torch.einsum("bhr,btr->bht", q[..., c:], pe)

    small = DecodeMatmulPass(batched_min_elements=r * t)  # these test-sized products take the kernel
    got, code = run_and_get_code(_compiled(scores, with_pass=True, pass_=small), q, kv, pe)
    assert "".join(code).count("ascend_graph.expert_rows_mm.default(") == (2 if kernels.available() else 0)
    assert ("bmm" in "".join(code)) != kernels.available()
    nope = torch.einsum("bhc,btc->bht", q[..., :c].double(), (kv * 2).double()).to(torch.bfloat16)
    rope = torch.einsum("bhr,btr->bht", q[..., c:].double(), pe.double()).to(torch.bfloat16)
    torch.testing.assert_close(got, nope + rope, atol=0, rtol=0)
    torch.testing.assert_close(got, scores(q, kv, pe), atol=0, rtol=0)


def test_batched_products_over_k_by_n_matrices_run_the_kernel_and_keep_each_product():
    """MLA decode's probabilities by each sequence's gathered ``kv_c`` (``[T, C]``), and products
    like the heads' queries by per-head ``[Dn, C]`` slices of a checkpoint's ``kv_b_proj`` (heads
    apart), run ``rows_bmm`` where the pass takes them; each product is the exact one rounded to
    bfloat16, as aten's."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(8)
    b, h, t, c, dn = 5, 16, 37, 96, 24
    probs = torch.randn(b, h, t, generator=gen).softmax(-1).to(torch.bfloat16)
    kv = torch.randn(b, t, c, generator=gen).to(torch.bfloat16)
    q = torch.randn(b, h, dn, generator=gen).to(torch.bfloat16)
    kv_b = torch.randn(h, 2 * dn, c, generator=gen).to(torch.bfloat16)

    def products(probs, kv, q, kv_b):
        return torch.einsum("bht,btc->bhc", probs, kv * 2), torch.einsum("bhd,hdc->bhc", q, kv_b[:, :dn])

    small = DecodeMatmulPass(batched_min_elements=dn * c)  # these test-sized products take the kernel
    (values, q_lat), code = run_and_get_code(_compiled(products, with_pass=True, pass_=small), probs, kv, q, kv_b)
    assert "".join(code).count("ascend_graph.rows_bmm.default(") == (2 if kernels.available() else 0)
    torch.testing.assert_close(values, torch.einsum("bht,btc->bhc", probs.double(), (kv * 2).double()).to(torch.bfloat16),
                               atol=0, rtol=2 ** -7)
    torch.testing.assert_close(q_lat, torch.einsum("bhd,hdc->bhc", q.double(), kv_b[:, :dn].double()).to(torch.bfloat16),
                               atol=0, rtol=2 ** -7)
    eager_values, eager_q_lat = products(probs, kv, q, kv_b)
    torch.testing.assert_close(values, eager_values, atol=0, rtol=2 ** -7)
    torch.testing.assert_close(q_lat, eager_q_lat, atol=0, rtol=2 ** -7)


def test_batched_kernel_only_for_its_layouts_sizes_and_not_when_switched_off():
    """The kernel takes a batched product of 2 to ``rows_max`` rows per entry whose matrix has at
    least ``min_elements`` elements (``batched_limits()``, for the kernel's build here); aten's
    ``bmm`` keeps the rest, on AVX512-BF16 among them the heads' products by V2-Lite's ``W_UK``
    (``[128, 512]`` each, stored transposed), where it was faster; on AVX2 the kernel takes those
    too."""
    from torch._inductor.utils import run_and_get_code

    rows_max, min_elements = batched_limits()
    gen = torch.Generator().manual_seed(7)
    t, c = 512, min_elements // 512  # a matrix of exactly min_elements
    p = torch.randn(2, 8, t, generator=gen).to(torch.bfloat16)
    v = torch.randn(2, t, c, generator=gen).to(torch.bfloat16)

    def count(fn, pass_, *args, op="expert_rows_mm"):
        backend = InductorBackend({"post_grad_custom_post_pass": pass_, "fx_graph_cache": False})
        with torch._functorch.config.patch(enable_autograd_cache=False):
            _, code = run_and_get_code(torch.compile(fn, backend=backend, fullgraph=True, dynamic=False), *args)
        return "".join(code).count(f"ascend_graph.{op}.default(")

    kernel = int(kernels.available())
    values = lambda p, v: torch.einsum("bht,btc->bhc", p, v)  # noqa: E731  ([K, N] matrices: rows_bmm)
    assert count(values, DecodeMatmulPass(), p, v) == 0
    assert count(values, DecodeMatmulPass(), p, v, op="rows_bmm") == kernel
    assert count(values, DecodeMatmulPass(batched_rows_kernel=False), p, v, op="rows_bmm") == 0
    assert count(values, DecodeMatmulPass(), p[:, :1], v, op="rows_bmm") == 0  # one row: a reduction
    assert count(values, DecodeMatmulPass(), p, v[..., :c - 1], op="rows_bmm") == 0  # a matrix too small
    many = torch.randn(2, rows_max + 1, t, generator=gen).to(torch.bfloat16)
    assert count(values, DecodeMatmulPass(), many, v, op="rows_bmm") == 0  # more rows than rows_max
    scores = lambda p, v: torch.einsum("bhc,btc->bht", p, v)  # noqa: E731
    w = v.transpose(1, 2).contiguous()  # [2, c, t]: the product's rows as [N, K]
    assert count(scores, DecodeMatmulPass(), p, w) == kernel
    assert count(scores, DecodeMatmulPass(batched_rows_kernel=False), p, w) == 0
    assert count(scores, DecodeMatmulPass(few_rows_kernel=False), p, w) == 0
    assert count(scores, DecodeMatmulPass(), p.float(), w.float()) == 0
    q = torch.randn(16, 32, 128).to(torch.bfloat16)
    w_uk = torch.randn(16, 512, 128).to(torch.bfloat16).transpose(1, 2)  # as kv_b_parts gives it
    on_avx2 = kernels.isa() == "AVX2"
    assert count(lambda q, w: torch.bmm(q, w), DecodeMatmulPass(), q, w_uk) == on_avx2
    keys = {DecodeMatmulPass().uuid(), DecodeMatmulPass(batched_rows_kernel=False).uuid(),
            DecodeMatmulPass(batched_min_elements=1).uuid(),
            DecodeMatmulPass(one_row_kernel=not kernels.one_row_kernel()).uuid()}  # the build's other choice
    assert len(keys) == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hi", [8])
def test_a_dynamic_row_count_takes_the_kernel_where_its_whole_range_would(dtype, hi):
    """A compile group's graph (``runner.groups``: the batch dimension symbolic over 2..hi) runs
    ``rows_mm`` where every row count of the range would alone, aten's mm where one would not;
    one compile serves every size, each product as a static compile's."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(hi)
    w1 = (torch.randn(96, 2081, generator=gen) * 0.05).to(dtype)
    w2 = (torch.randn(64, 96, generator=gen) * 0.1).to(dtype)

    def fn(x, r):
        return r + F.linear(F.silu(F.linear(x, w1)), w2)

    inductor, compiles = InductorBackend({"post_grad_custom_post_pass": DecodeMatmulPass()}), []

    def counted(gm, inputs):
        compiles.append(1)
        return inductor(gm, inputs)

    compiled = torch.compile(fn, backend=counted, fullgraph=True, dynamic=False)
    for i, rows in enumerate((2, 5, hi)):
        x, residual = torch.randn(rows, 2081, generator=gen).to(dtype), torch.randn(rows, 64, generator=gen).to(dtype)
        for t in (x, residual):
            torch._dynamo.mark_dynamic(t, 0, min=2, max=hi)
        if i == 0:
            got, code = run_and_get_code(compiled, x, residual)
            expected = 2 if kernels.available() and hi <= ROWS_MM_MAX else 0
            assert "".join(code).count("ascend_graph.rows_mm.default(") == expected
        else:
            got = compiled(x, residual)
        torch.testing.assert_close(got.float(), fn(x, residual).float(), atol=3e-2, rtol=1e-2)
    assert len(compiles) == 1, "one compile for every row count of the range"


def test_row_bounds_of_a_symbolic_row_count_are_its_range():
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from ascend_graph.compile.passes.decode_matmul import row_bounds

    env = ShapeEnv()
    rows = env.create_unbacked_symint()
    torch._check(rows >= 2)
    torch._check(rows <= 8)
    assert row_bounds(rows) == (2, 8) and row_bounds(5) == (5, 5)
    wide = env.create_unbacked_symint()
    torch._check(wide >= 2)
    torch._check(wide <= ROWS_MM_MAX + 1)
    lo, hi = row_bounds(wide)
    assert lo == 2 and hi == ROWS_MM_MAX + 1  # past the kernel's limit: runs_rows_mm refuses it
