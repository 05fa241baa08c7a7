"""``ascend_graph::decode_attention`` (the CPU kernel's one-pass decode over live blocks) against a
float64 oracle over random batches (``hypothesis``): context lengths 0, 1, at and across block
boundaries, full table width, mixed; MLA (latent + rope, ``kv_c`` as the values) and GQA;
float32 and bfloat16; one thread and two (long rows split over work items).

Every block no row's live range names is filled with NaN, the null block included: an output
that read one would be NaN. So each test also shows that only live blocks are read, and that a
row of context 0 (a padding row) reads nothing and gives zeros.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_graph import kernels
from test_kernel_build import BUILDS, build_for

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="the CPU kernel does not build here")
op = torch.ops.ascend_graph.decode_attention
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2.5e-2, rtol=2.5e-2)}


@st.composite
def batches(draw):
    """A decode batch: shapes, per-row context lengths drawn around block boundaries, dtype."""
    mla = draw(st.booleans())
    bs = draw(st.sampled_from([1, 4, 16]))
    width = draw(st.integers(1, 6))
    rows = draw(st.integers(1, 5))
    full = width * bs
    near = st.sampled_from(sorted({0, 1, bs - 1, bs, bs + 1, full - 1, full} & set(range(full + 1))))
    lens = draw(st.lists(st.one_of(near, st.integers(0, full)), min_size=rows, max_size=rows))
    if mla:
        hk, g = 1, draw(st.sampled_from([1, 3, 8, 16]))
        kw, rw = draw(st.sampled_from([(64, 16), (40, 8), (512, 64)]))
    else:
        hk, g = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 5]))
        kw, rw = draw(st.sampled_from([8, 32, 64, 128])), 0
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return dict(mla=mla, bs=bs, width=width, lens=lens, hk=hk, g=g, kw=kw, rw=rw, dtype=dtype,
                seed=draw(st.integers(0, 2 ** 16)), threads=draw(st.sampled_from([1, 2])))


def make(case):
    """Inputs with every block outside the live ranges NaN; tables name distinct live blocks."""
    gen = torch.Generator().manual_seed(case["seed"])
    bs, width, lens, hk, g, kw, rw, dtype = (case[k] for k in ("bs", "width", "lens", "hk", "g", "kw", "rw", "dtype"))
    rows = len(lens)
    num_blocks = 1 + rows * width + 2
    perm = torch.randperm(num_blocks - 1, generator=gen)[: rows * width] + 1
    tables = perm.view(rows, width).to(torch.int32)
    live = torch.zeros(num_blocks, dtype=torch.bool)
    for b, n in enumerate(lens):
        live[tables[b, : -(-n // bs)].long()] = True
    for b, n in enumerate(lens):  # slots past a row's live blocks: a dead (NaN) block or the null block
        dead = tables[b, -(-n // bs):]
        dead.copy_(torch.where(torch.rand(dead.shape, generator=gen) < 0.5, 0, dead))
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    poison = lambda t: t.masked_fill(~live.view(-1, *([1] * (t.dim() - 1))), float("nan"))  # noqa: E731
    q = rnd(rows, hk * g, kw)
    k = poison(rnd(num_blocks, bs, hk, kw))
    if case["mla"]:
        q_rope, r = rnd(rows, g, rw), poison(rnd(num_blocks, bs, 1, rw))
        v = k
    else:
        q_rope = r = None
        v = poison(rnd(num_blocks, bs, hk, kw))
    ctx = torch.tensor(lens, dtype=torch.int32)
    return q, q_rope, k, r, v, tables, ctx, kw ** -0.5


def oracle(q, q_rope, k, r, v, tables, ctx, scale):
    """float64 softmax attention over each row's first ctx tokens, gathered; zeros for ctx 0."""
    rows, hq, _ = q.shape
    hk, bs = k.shape[2], k.shape[1]
    out = torch.zeros(rows, hq, v.shape[-1], dtype=torch.float64)
    for b in range(rows):
        n = int(ctx[b])
        if n == 0:
            continue
        ids = tables[b, : -(-n // bs)].long()
        take = lambda t: t[ids].flatten(0, 1)[:n].double()  # noqa: E731  [n, Hk, D]
        kk, vv = take(k), take(v)
        for h in range(hq):
            s = kk[:, h * hk // hq] @ q[b, h].double()
            if q_rope is not None:
                s = s + take(r)[:, h * hk // hq] @ q_rope[b, h].double()
            out[b, h] = torch.softmax(s * scale, 0) @ vv[:, h * hk // hq]
    return out


@needs_kernel
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_decode_attention_equals_the_float64_oracle_reading_live_blocks_only(case):
    args = make(case)
    before = torch.get_num_threads()
    torch.set_num_threads(case["threads"])
    try:
        out = op(*args)
    finally:
        torch.set_num_threads(before)
    assert out.dtype == case["dtype"] and out.shape == (len(case["lens"]), args[0].shape[1], args[4].shape[-1])
    assert not out.isnan().any(), "a dead block (NaN) was read"
    for b, n in enumerate(case["lens"]):
        if n == 0:
            assert torch.equal(out[b], torch.zeros_like(out[b])), "a row of context 0 must give zeros"
    torch.testing.assert_close(out.double(), oracle(*args), **TOL[case["dtype"]])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_graph_keeps_one_call_and_equals_eager(dtype):
    """Compiled with the table's full width as a static shape, the op is one call whose loop
    bounds still follow ``context_lens``: the same values as eager, at other lengths too."""
    from torch._inductor.utils import run_and_get_code

    from ascend_graph.compile.inductor import InductorBackend

    case = dict(mla=True, bs=16, width=8, lens=[1, 37, 128, 0], hk=1, g=16, kw=512, rw=64, dtype=dtype, seed=3,
                threads=1)
    args = make(case)
    fn = torch.compile(lambda *a: op(*a) * 2, backend=InductorBackend({}), fullgraph=True, dynamic=False)
    graph, code = run_and_get_code(fn, *args)
    assert "".join(code).count("ascend_graph.decode_attention.default(") == 1
    assert torch.equal(graph, op(*args) * 2)
    shorter = list(args)
    shorter[6] = torch.tensor([16, 17, 5, 0], dtype=torch.int32)  # same shapes, other lengths: no recompile
    torch.testing.assert_close(fn(*shorter).double(), oracle(*shorter) * 2, **TOL[dtype])


@needs_kernel
def test_bad_arguments_are_named_before_anything_runs():
    case = dict(mla=False, bs=4, width=3, lens=[5, 12], hk=2, g=2, kw=32, rw=0, dtype=torch.float32, seed=1,
                threads=1)
    q, q_rope, k, r, v, tables, ctx, scale = make(case)
    with pytest.raises(ValueError, match=r"context_lens must lie in \[0, 12\] .* got 5\.\.13"):
        op(q, q_rope, k, r, v, tables, ctx + torch.tensor([0, 1], dtype=torch.int32), scale)
    with pytest.raises(ValueError, match=r"block_tables ids must lie in \[0, 9\)"):
        op(q, q_rope, k, r, v, tables + 20, ctx, scale)
    with pytest.raises(ValueError, match="must be CPU tensors of one dtype"):
        op(q.double(), q_rope, k, r, v, tables, ctx, scale)
    with pytest.raises(ValueError, match=r"Hq a multiple of Hk"):
        op(q[:, :3], q_rope, k, r, v, tables, ctx, scale)
    with pytest.raises(ValueError, match="q_rope and rope_cache go together"):
        op(q, q, k, r, v, tables, ctx, scale)
    with pytest.raises(ValueError, match="context_lens must be int32 or int64"):
        op(q, q_rope, k, r, v, tables, ctx.float(), scale)
    with pytest.raises(ValueError, match="k_cache's last dimension must be contiguous"):
        op(q, q_rope, torch.cat([k, k], -1)[..., ::2], r, v, tables, ctx, scale)


def _run_entry(dll: ctypes.CDLL, q, q_rope, k_cache, rope_cache, v_cache, block_tables, context_lens, scale,
               hk: int, g: int, threads: int) -> torch.Tensor:
    """The build's ``decode_attention`` C entry on the op's arguments: ``hk`` kv heads of ``g`` query
    heads each."""
    q, q_rope = q.contiguous(), q_rope.contiguous() if q_rope is not None else None
    tables, ctx = block_tables.to(torch.int32).contiguous(), context_lens.to(torch.int32).contiguous()
    out = torch.empty(q.shape[0], q.shape[1], v_cache.shape[-1], dtype=q.dtype)
    rope = rope_cache if rope_cache is not None else k_cache
    strides = (ctypes.c_long * 9)(*(s for t in (k_cache, rope, v_cache) for s in t.stride()[:3]))
    status = dll.decode_attention(
        q.data_ptr(), q_rope.data_ptr() if q_rope is not None else None, k_cache.data_ptr(), rope.data_ptr(),
        v_cache.data_ptr(), tables.data_ptr(), ctx.data_ptr(), out.data_ptr(), q.shape[0], hk, g, q.shape[2],
        q_rope.shape[-1] if q_rope is not None else 0, out.shape[-1], strides, tables.shape[1], k_cache.shape[1],
        float(scale), int(q.dtype == torch.bfloat16), threads)
    assert status == 0
    return out


@pytest.mark.parametrize("build", sorted(BUILDS))
def test_each_instruction_set_build_computes_the_same_attention(build):
    """The AVX2 build (float32 FMAs) and the AVX512-BF16 build (vdpbf16ps pairs for bfloat16) as
    they run on a CPU with their instructions, whatever the native build here, against the oracle."""
    from ascend_graph.runtime import machine

    if not BUILDS[build][2] <= set(machine()["cpu_flags"]):
        pytest.skip(f"needs an x86 CPU with {', '.join(sorted(BUILDS[build][2]))}")
    dll = build_for(build)
    for dtype in (torch.float32, torch.bfloat16):
        for mla, hk, g, kw, rw, bs, lens in [(True, 1, 16, 512, 64, 16, [0, 1, 16, 17, 96]),
                                             (True, 1, 3, 40, 8, 4, [7, 24]), (False, 2, 5, 64, 0, 16, [33, 1, 0]),
                                             (False, 1, 2, 8, 0, 1, [6, 3])]:
            case = dict(mla=mla, bs=bs, width=6, lens=lens, hk=hk, g=g, kw=kw, rw=rw, dtype=dtype, seed=5, threads=2)
            args = make(case)
            out = _run_entry(dll, *args, hk, g, 2)
            assert not out.isnan().any()
            torch.testing.assert_close(out.double(), oracle(*args), **TOL[dtype])


@needs_kernel
@settings(max_examples=25, deadline=None)
@given(batches(), st.integers(0, 3))
def test_a_step_writes_its_slots_and_the_null_block_only(case, padding):
    """A decode step (the backend's cache write, then the op) with ``padding`` padded rows (slot
    -1, context 0, the null block's table): the caches change only at the live rows' slots and in
    the null block; the live rows equal the oracle after the write, the padded rows are zeros."""
    from ascend_graph.attention.cpu import CpuMLA, CpuPaged
    from ascend_graph.kv_cache import KVCache, MLACache

    q, q_rope, k, r, v, tables, ctx, scale = make(case)
    keep = ctx > 0  # rows that have a token to write: the last of their context
    q, tables, ctx = q[keep], tables[keep], ctx[keep]
    q_rope = q_rope[keep] if q_rope is not None else None
    bs = k.shape[1]
    slots = [int(tables[b, (n - 1) // bs]) * bs + (n - 1) % bs for b, n in enumerate(ctx.tolist())]
    k, v = k.nan_to_num(7.0), (v.nan_to_num(7.0) if not case["mla"] else None)
    r = r.nan_to_num(7.0) if r is not None else None
    pad = lambda t, value: torch.cat([t, t.new_full((padding, *t.shape[1:]), value)])  # noqa: E731
    q, tables, ctx = pad(q, 1.0), pad(tables, 0), pad(ctx, 0)
    q_rope = pad(q_rope, 1.0) if q_rope is not None else None
    slot_mapping = torch.tensor(slots + [-1] * padding, dtype=torch.int64)
    n = q.shape[0]
    gen = torch.Generator().manual_seed(case["seed"] + 1)
    new_a = torch.randn(n, k.shape[2], k.shape[3], generator=gen).to(k.dtype)
    new_b = torch.randn(n, *(r if case["mla"] else v).shape[2:], generator=gen).to(k.dtype)
    if case["mla"]:
        cache, backend = MLACache(k, r), CpuMLA()
    else:
        cache, backend = KVCache(k, v), CpuPaged()
    before = [t.clone() for t in cache]
    backend.write(cache, new_a, new_b, slot_mapping)
    flat = lambda t: t.view(-1, *t.shape[2:])  # noqa: E731
    for t, was, new in zip(cache, before, (new_a, new_b)):
        changed = (flat(t) != flat(was)).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= set(slots) | set(range(bs)), "a slot outside the step's writes changed"
        for i, slot in enumerate(slots):
            assert torch.equal(flat(t)[slot], new[i]), "a live row's write is missing"
    v_cache = cache[0] if case["mla"] else cache[1]
    out = op(q, q_rope, cache[0], cache[1] if case["mla"] else None, v_cache, tables, ctx, scale)
    assert torch.equal(out[n - padding:], torch.zeros_like(out[n - padding:]))
    torch.testing.assert_close(out.double(), oracle(q, q_rope, cache[0], cache[1] if case["mla"] else None, v_cache,
                                                    tables, ctx, scale), **TOL[case["dtype"]])
