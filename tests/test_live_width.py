"""The bounded fallback (``attention.live``): the reference forms cut to the batch's longest live
context, one opaque op per decode. Oracle: the full-width reference forms and float64 attention;
every block past the longest row's blocks holds NaN, so a read of one would show."""

from __future__ import annotations

import pytest
import torch

from ascend_graph.attention import select_attention_backend
from ascend_graph.attention.live import LiveMLA, LivePaged, live_width
from ascend_graph.attention.metadata import DecodeMetadata
from ascend_graph.attention.oracle import dense_attention, naive_mla
from ascend_graph.attention.paging import gather_sequence
from ascend_graph.attention.reference import ReferenceMLA, ReferencePaged
from ascend_graph.compile.inductor import InductorBackend
from ascend_graph.kv_cache import KVCache, MLACache

S, W, BLOCKS = 4, 8, 40


def _case(gen, lens, dtype):
    """Tables of distinct blocks; each row's blocks past the longest row's width are NaN."""
    tables = (torch.randperm(BLOCKS - 1, generator=gen)[: len(lens) * W] + 1).view(len(lens), W).to(torch.int32)
    width = -(-max(lens) // S)
    dead = torch.zeros(BLOCKS, dtype=torch.bool)
    dead[tables[:, width:].flatten().long()] = True
    return tables, torch.tensor(lens, dtype=torch.int32), dead


def _poisoned(t, dead):
    return t.masked_fill(dead.view(-1, *([1] * (t.dim() - 1))), float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_live_mla_equals_the_oracle_without_reading_past_the_longest_row(dtype):
    gen = torch.Generator().manual_seed(1)
    lens = [13, 1, 7, 0]
    tables, ctx, dead = _case(gen, lens, dtype)
    h, dn, c, r = 4, 8, 32, 8
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)  # noqa: E731
    cache = MLACache(_poisoned(rnd(BLOCKS, S, 1, c), dead), _poisoned(rnd(BLOCKS, S, 1, r), dead))
    q_nope, q_pe, w_uk, w_uv = rnd(4, h, dn), rnd(4, h, r), rnd(h, dn, c) / c ** 0.5, rnd(h, dn, c) / c ** 0.5
    decode = DecodeMetadata(tables, ctx)
    out = LiveMLA().decode(q_nope, q_pe, cache, decode, w_uk, w_uv, 0.3)
    assert not out.isnan().any()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    for i, n in enumerate(lens):
        if n:
            rows = lambda t: gather_sequence(t, tables[i], n).squeeze(1)  # noqa: E731
            exact = naive_mla(q_nope[i:i + 1], q_pe[i:i + 1], rows(cache.kv_c), rows(cache.k_pe), w_uk, w_uv, 0.3)
            torch.testing.assert_close(out[i:i + 1].double(), exact, **tol)
    clean = MLACache(*(t.nan_to_num(0.0) for t in cache))  # the full-width forms over the same values
    assert torch.equal(LiveMLA().decode(q_nope, q_pe, clean, decode, w_uk, w_uv, 0.3),
                       ReferenceMLA().decode(q_nope, q_pe, clean, live_width(decode, S), w_uk, w_uv, 0.3))


def test_live_paged_in_a_graph_is_one_call_and_follows_the_lengths():
    gen = torch.Generator().manual_seed(2)
    lens = [9, 3]
    tables, ctx, dead = _case(gen, lens, torch.float16)
    hq, hk, d = 4, 2, 16
    cache = KVCache(*(_poisoned(torch.randn(BLOCKS, S, hk, d, generator=gen).half(), dead) for _ in range(2)))
    q = torch.randn(2, hq, d, generator=gen).half()
    backend = LivePaged()

    def step(q, k, v, tables, ctx):
        return backend.decode(q, KVCache(k, v), DecodeMetadata(tables, ctx), d ** -0.5)

    from torch._inductor.utils import run_and_get_code

    fn = torch.compile(step, backend=InductorBackend({}), fullgraph=True, dynamic=False)
    graph, code = run_and_get_code(fn, q, *cache, tables, ctx)
    assert "".join(code).count("ascend_graph.paged_decode_live.default(") == 1
    assert torch.equal(graph, step(q, *cache, tables, ctx))
    for i, n in enumerate(lens):
        exact = dense_attention(q[i:i + 1], gather_sequence(cache.k, tables[i], n),
                                gather_sequence(cache.v, tables[i], n), d ** -0.5)
        torch.testing.assert_close(graph[i:i + 1].double(), exact, atol=3e-3, rtol=3e-3)
    longer = torch.tensor([17, 3], dtype=torch.int32)  # same shapes, a longer row: no recompile, still right
    clean = KVCache(*(t.nan_to_num(0.0) for t in cache))
    torch.testing.assert_close(fn(q, *clean, tables, longer),
                               ReferencePaged().decode(q, clean, DecodeMetadata(tables, longer), d ** -0.5))


def test_it_is_chosen_on_a_cpu_where_the_kernel_does_not_take_the_dtype():
    for kind in ("mla", "paged"):
        assert select_attention_backend(kind, "cpu", torch.float16).name == "gathered_live"
        assert select_attention_backend(kind, "cpu", torch.float16, "reference").name == "reference"
        assert not LiveMLA.supports(torch.device("cuda"), torch.float16)  # its host read would end a device graph
