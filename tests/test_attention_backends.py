"""Attention backends: chosen once for the cache dtype and device, and each runs the same algorithm
in eager and compiled steps (the cpu_kernel backend reads each row's live blocks in place in both:
the compiled code calls ``decode_attention`` once on the cache and tables); against the float64 oracle
(``attention.oracle``) on the same bf16 values."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from ascend_graph import kernels
from ascend_graph.attention import ATTENTION_BACKENDS, select_attention_backend
from ascend_graph.attention.cpu import CpuMLA, CpuPaged
from ascend_graph.attention.metadata import DecodeMetadata
from ascend_graph.attention.oracle import dense_attention, naive_mla
from ascend_graph.attention.paging import gather_sequence
from ascend_graph.attention.reference import ReferenceMLA, ReferencePaged
from ascend_graph.compile.inductor import InductorBackend
from ascend_graph.kv_cache import KVCache, MLACache

needs_kernel = pytest.mark.skipif(not kernels.available(), reason="the CPU kernel does not build here")


def test_selection_takes_the_first_backend_that_runs_and_names_bad_requests():
    cpu = torch.device("cpu")
    kernel = kernels.available()
    first = "cpu_kernel" if kernel else "gathered_live"
    for kind in ("mla", "paged"):
        for dtype in (torch.float32, torch.bfloat16):
            assert select_attention_backend(kind, cpu, dtype).name == first
        assert select_attention_backend(kind, cpu, torch.float16).name == "gathered_live"
    assert isinstance(select_attention_backend("mla", cpu, torch.bfloat16, "reference"), ReferenceMLA)
    with pytest.raises(ValueError, match="kind must be one of"):
        select_attention_backend("flash", cpu, torch.float32)
    with pytest.raises(ValueError, match=r"attention backend must be one of \['cpu_kernel', 'gathered_live', 'npu', 'reference', 'triton'\]"):
        select_attention_backend("mla", cpu, torch.float32, "flash")
    with pytest.raises(ValueError, match="does not run for torch.bfloat16 caches on cpu"):
        select_attention_backend("mla", cpu, torch.bfloat16, "npu")  # an npu device only
    with pytest.raises(ValueError, match="does not run for torch.float16 caches on cpu"):
        select_attention_backend("mla", cpu, torch.float16, "cpu_kernel")
    with pytest.raises(ValueError, match="does not run for torch.bfloat16 caches on cpu"):
        select_attention_backend("paged", cpu, torch.bfloat16, "triton")  # CUDA only, triton or not
    assert [name for name, _ in ATTENTION_BACKENDS["paged"]][-1] == "reference"  # runs everywhere, last


def test_models_report_and_reselect_their_backends_when_cast():
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM

    kernel = "cpu_kernel" if kernels.available() else None
    model = DeepseekForCausalLM(DeepseekConfig.small(), dtype=torch.float16)
    assert model.backends() == {"attention": "gathered_live", "moe": "grouped_mm"}
    model.to(torch.bfloat16)
    assert model.backends() == {"attention": kernel or "gathered_live", "moe": kernel or "grouped_mm"}
    model.to(torch.float32)
    assert model.backends() == {"attention": kernel or "gathered_live", "moe": kernel or "grouped_mm"}
    assert model.select_backends(attention="reference", moe="gathered") == {"attention": "reference", "moe": "gathered"}
    model.to(torch.bfloat16)  # a named request is kept across casts where it still runs
    assert model.backends() == {"attention": "reference", "moe": "gathered"}


def _mla_case(b: int, gen: torch.Generator):
    h, dn, c, r, blocks, s, w = 16, 24, 96, 32, 12, 4, 5
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16)  # noqa: E731
    cache = MLACache(rnd(blocks, s, 1, c), rnd(blocks, s, 1, r))
    tables = torch.randint(1, blocks, (3, w), generator=gen, dtype=torch.int32)[:b]
    lens = torch.tensor([20, 7, 13][:b], dtype=torch.int32)
    w_uk = (rnd(h, c, dn) / c ** 0.5).transpose(1, 2)  # [H, Dn, C]
    return cache, tables, lens, rnd(b, h, dn), rnd(b, h, r), w_uk, rnd(h, dn, c) / c ** 0.5


def _compiled(fn):
    return torch.compile(fn, backend=InductorBackend({}), fullgraph=True, dynamic=False)


@needs_kernel
@pytest.mark.parametrize("b", [3, 1])
def test_cpu_mla_reads_the_cache_in_place_and_compiled_equals_eager(b):
    cache, tables, lens, q_nope, q_pe, w_uk, w_uv = _mla_case(b, torch.Generator().manual_seed(9))
    backend = CpuMLA()

    def step(q_nope, q_pe, kv_c, k_pe, tables, lens):
        return backend.decode(q_nope, q_pe, MLACache(kv_c, k_pe), DecodeMetadata(tables, lens), w_uk, w_uv, 0.2)

    args = (q_nope, q_pe, *cache, tables, lens)
    eager = step(*args)
    graph, code = run_and_get_code(_compiled(step), *args)
    code = "".join(code)
    assert code.count("ascend_graph.decode_attention.default(") == 1  # scores, softmax and values in one call
    assert torch.equal(graph, eager)  # the same op on the same bf16 query: nothing left for Inductor to fuse
    exact = torch.cat([naive_mla(q_nope[i:i + 1], q_pe[i:i + 1], gather_sequence(cache.kv_c, tables[i], n).squeeze(1),
                                 gather_sequence(cache.k_pe, tables[i], n).squeeze(1), w_uk, w_uv, 0.2)
                       for i, n in enumerate(lens.tolist())])
    torch.testing.assert_close(eager.double(), exact, atol=3e-2, rtol=3e-2)
    reference = ReferenceMLA().decode(q_nope, q_pe, cache, DecodeMetadata(tables, lens), w_uk, w_uv, 0.2)
    torch.testing.assert_close(eager, reference, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("hq, hk", [(8, 2), (4, 4)])
def test_cpu_paged_compiled_equals_eager_and_the_oracle(hq, hk):
    gen = torch.Generator().manual_seed(4)
    blocks, s, w, d = 10, 4, 4, 32
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(torch.bfloat16)  # noqa: E731
    cache = KVCache(rnd(blocks, s, hk, d), rnd(blocks, s, hk, d))
    tables = torch.randint(1, blocks, (3, w), generator=gen, dtype=torch.int32)
    lens = torch.tensor([16, 3, 9], dtype=torch.int32)
    q = rnd(3, hq, d)
    backend = CpuPaged()

    def step(q, k, v, tables, lens):
        return backend.decode(q, KVCache(k, v), DecodeMetadata(tables, lens), d ** -0.5)

    eager = step(q, *cache, tables, lens)
    graph, code = run_and_get_code(_compiled(step), q, *cache, tables, lens)
    assert "".join(code).count("ascend_graph.decode_attention.default(") == 1
    assert torch.equal(graph, eager)
    exact = torch.cat([dense_attention(q[i:i + 1], gather_sequence(cache.k, tables[i], n),
                                       gather_sequence(cache.v, tables[i], n), d ** -0.5)
                       for i, n in enumerate(lens.tolist())])
    torch.testing.assert_close(eager.double(), exact, atol=3e-2, rtol=3e-2)
    reference = ReferencePaged().decode(q, cache, DecodeMetadata(tables, lens), d ** -0.5)
    torch.testing.assert_close(eager, reference, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kind", ["mla", "paged"])
def test_prefill_with_cached_context_reads_live_blocks_only(kind):
    """Chunked prefill / a prefix hit: new tokens after cached ones. Every block past each
    sequence's context, and the null block, holds NaN; the output is finite and equals the
    float64 oracle over the live tokens (each backend's prefill)."""
    from ascend_graph.attention.metadata import PrefillMetadata

    gen = torch.Generator().manual_seed(11)
    s, w, blocks = 4, 6, 16
    query_lens, context_lens = (3, 5), (9, 13)  # 6 and 8 cached tokens before the new ones
    tables = torch.tensor([[3, 5, 7, 1, 2, 0], [4, 6, 8, 9, 0, 10]], dtype=torch.int32)
    live = torch.zeros(blocks, dtype=torch.bool)
    for table, n in zip(tables, context_lens):
        live[table[: -(-n // s)].long()] = True
    rnd = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    poison = lambda t: t.masked_fill(~live.view(-1, 1, 1, 1), float("nan"))  # noqa: E731
    meta = PrefillMetadata(tables, query_lens, context_lens)
    total = sum(query_lens)
    if kind == "mla":
        h, dn, c, r = 4, 8, 32, 8
        cache = MLACache(poison(rnd(blocks, s, 1, c)), poison(rnd(blocks, s, 1, r)))
        q_nope, q_pe, w_uk, w_uv = rnd(total, h, dn), rnd(total, h, r), rnd(h, dn, c) / c ** 0.5, rnd(h, dn, c)
        backends = [ReferenceMLA()] + ([CpuMLA()] if kernels.available() else [])
        outs = [b.prefill(q_nope, q_pe, cache, meta, w_uk, w_uv, 0.3) for b in backends]
        exact, start = [], 0
        for i, (q_len, n) in enumerate(zip(query_lens, context_lens)):
            rows = lambda t: gather_sequence(t, tables[i], n).squeeze(1)  # noqa: E731
            exact.append(naive_mla(q_nope[start:start + q_len], q_pe[start:start + q_len], rows(cache.kv_c),
                                   rows(cache.k_pe), w_uk, w_uv, 0.3))
            start += q_len
    else:
        hq, hk, d = 4, 2, 16
        cache = KVCache(poison(rnd(blocks, s, hk, d)), poison(rnd(blocks, s, hk, d)))
        q = rnd(total, hq, d)
        backends = [ReferencePaged()] + ([CpuPaged()] if kernels.available() else [])
        outs = [b.prefill(q, cache, meta, d ** -0.5) for b in backends]
        exact, start = [], 0
        for i, (q_len, n) in enumerate(zip(query_lens, context_lens)):
            exact.append(dense_attention(q[start:start + q_len], gather_sequence(cache.k, tables[i], n),
                                         gather_sequence(cache.v, tables[i], n), d ** -0.5))
            start += q_len
    for out in outs:
        assert not out.isnan().any(), "a block past the context (NaN) was read"
        torch.testing.assert_close(out.double(), torch.cat(exact), atol=1e-5, rtol=1e-5)
