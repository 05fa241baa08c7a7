"""Eager MLA attention over the tuple cache ``MLACache(kv_c, k_pe)`` against ``naive_mla``
(float64, contiguous per-sequence tensors; ``attention_cases``)."""

from typing import NamedTuple

import pytest
import torch

from attention_cases import (S, SMALL, V2_LITE, _assert_matches, _metadata, _new_tokens, _ragged_lens, _tables,
                             _write_prefix)
from ascend_graph.attention import mla, mla_decode, mla_prefill, paging
from ascend_graph.attention.oracle import naive_mla
from ascend_graph.kv_cache import MLACacheSpec, allocate_kv_caches, write_kv_cache


class MLAProblem(NamedTuple):
    cache: object
    seqs: list  # per sequence (kv_c [L, 1, C], k_pe [L, 1, R]) in the cache dtype
    q_nope: list  # per sequence [L, H, Dn]: a query for every position
    q_pe: list  # per sequence [L, H, R]
    w_uk: torch.Tensor  # [H, Dn, C]
    w_uv: torch.Tensor  # [H, Dv, C]
    scale: float


def _mla_problem(gen, d, lens, num_blocks, dtype=torch.float32):
    (cache,) = allocate_kv_caches([MLACacheSpec(d.C, d.R, dtype)], num_blocks=num_blocks, block_size=S)
    rnd = lambda *shape, std=1.0: (torch.randn(*shape, generator=gen) * std).to(dtype)  # noqa: E731
    seqs = [(rnd(n, 1, d.C), rnd(n, 1, d.R)) for n in lens]
    # Queries twice unit size and weights of 1/sqrt(C): logits of a few units, a peaked softmax.
    q_nope = [rnd(n, d.H, d.Dn, std=2.0) for n in lens]
    q_pe = [rnd(n, d.H, d.R, std=2.0) for n in lens]
    w_uk, w_uv = rnd(d.H, d.Dn, d.C, std=d.C ** -0.5), rnd(d.H, d.Dv, d.C, std=d.C ** -0.5)
    return MLAProblem(cache, seqs, q_nope, q_pe, w_uk, w_uv, (d.Dn + d.R) ** -0.5)


def _mla_oracle(p, i, length, q_rows):
    """naive_mla for sequence ``i``'s first ``length`` tokens, queries at positions ``q_rows``."""
    kv_c, k_pe = p.seqs[i]
    return naive_mla(p.q_nope[i][q_rows], p.q_pe[i][q_rows], kv_c[:length, 0], k_pe[:length, 0],
                     p.w_uk, p.w_uv, p.scale)


def _mla_decode_step(p, tables, lens, num_blocks, width=None, decode=mla_decode):
    """Earlier tokens written by hand-computed slots, then the decode write and attention (``decode``)."""
    _write_prefix(p.cache, tables, p.seqs, [n - 1 for n in lens])
    positions, meta = _metadata(tables, [n - 1 for n in lens], [1] * len(lens), num_blocks, width)
    assert positions.tolist() == [n - 1 for n in lens]
    write_kv_cache(p.cache, *_new_tokens(p.seqs, [n - 1 for n in lens], [1] * len(lens)), meta.slot_mapping)
    q_nope = torch.stack([q[n - 1] for q, n in zip(p.q_nope, lens)])  # [B, H, Dn]
    q_pe = torch.stack([q[n - 1] for q, n in zip(p.q_pe, lens)])  # [B, H, R]
    return decode(q_nope, q_pe, p.cache, meta.decode, p.w_uk, p.w_uv, p.scale)


def _mla_decode_oracle(p, lens):
    return torch.cat([_mla_oracle(p, i, n, slice(n - 1, n)) for i, n in enumerate(lens)])


# ---------------------------------------------------------------------------------------------
# MLA


@pytest.mark.parametrize("width", [None, 12], ids=["tight_table", "wide_table"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mla_decode_matches_naive_mla_float32(seed, width):
    gen = torch.Generator().manual_seed(seed)
    lens = _ragged_lens(gen, batch=6)
    p = _mla_problem(gen, SMALL, lens, num_blocks=64)
    out = _mla_decode_step(p, _tables(gen, lens, 64), lens, 64, width)
    assert out.shape == (6, SMALL.H, SMALL.Dv) and out.dtype == torch.float32
    _assert_matches(out, _mla_decode_oracle(p, lens), 1e-5)


def test_mla_decode_matches_naive_mla_at_v2_lite_dims():
    gen = torch.Generator().manual_seed(7)
    lens = [1, 4, 5, 23]
    p = _mla_problem(gen, V2_LITE, lens, num_blocks=24)
    out = _mla_decode_step(p, _tables(gen, lens, 24), lens, 24)
    _assert_matches(out, _mla_decode_oracle(p, lens), 1e-5)


@pytest.mark.parametrize("form", ["aten_bf16", "float32_products", "cpu_kernel"])
@pytest.mark.parametrize("seed", [0, 1])
def test_mla_decode_matches_naive_mla_bfloat16(seed, form, monkeypatch):
    """Every form of the bf16 products, whichever this CPU would pick: the reference backend's
    aten bf16 einsums over the gathered rows, the same in float32 (``mla.product_rows``), and the
    cpu_kernel backend reading the cache in place."""
    from ascend_graph.attention.cpu import CpuMLA

    monkeypatch.setattr(paging, "aten_bf16_emulated", lambda: form == "float32_products")
    decode = mla_decode
    if form == "cpu_kernel":
        if not CpuMLA.supports(torch.device("cpu"), torch.bfloat16):
            pytest.skip("the kernel does not run here (no C compiler, or neither AVX512-BF16 nor AVX2)")
        decode = CpuMLA().decode
    gen = torch.Generator().manual_seed(seed)
    lens = _ragged_lens(gen, batch=6)
    p = _mla_problem(gen, V2_LITE, lens, num_blocks=64, dtype=torch.bfloat16)
    out = _mla_decode_step(p, _tables(gen, lens, 64), lens, 64, decode=decode)
    assert out.dtype == torch.bfloat16
    # The oracle sees the same bf16-rounded inputs, so only rounding inside the op counts: the
    # latent query, the logits, the probabilities, the latent output and the output are each
    # rounded to bf16 (unit roundoff 2^-9 ~ 0.002). A logit of a few units rounded in its 8-bit
    # mantissa moves its probability by up to ~2%, and the roundings after it add a few more
    # tenths of a percent; 4% of the output's magnitude bounds that with a margin (measured: under 1%).
    _assert_matches(out, _mla_decode_oracle(p, lens), 4e-2)


@pytest.mark.parametrize("equation, x_shape, rows_shape", [
    ("bht,btc->bhc", (3, 4, 40), (3, 40, 24)),  # the values: probabilities by kv_c
    ("bhc,btc->bht", (3, 4, 24), (3, 40, 24)),  # the scores
])
def test_float32_cache_products_are_the_bf16_products_rounded_once(equation, x_shape, rows_shape, monkeypatch):
    """The eager float32 form (``product_rows``' copy) gives aten's bf16 product: float32 sums of
    the same values, each output rounded once to bf16 (so within one bf16 step of the float64
    product), in bf16."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(*x_shape, generator=gen).to(torch.bfloat16)
    rows = torch.randn(*rows_shape, generator=gen).to(torch.bfloat16)
    exact = torch.einsum(equation, x.double(), rows.double())
    one_step = exact.abs() * 2.0 ** -8 + 1e-30  # bf16 keeps 8 significant bits
    for emulated in (True, False):
        monkeypatch.setattr(paging, "aten_bf16_emulated", lambda: emulated)
        taken = mla.product_rows(rows)
        assert taken.dtype == (torch.float32 if emulated else torch.bfloat16)
        out = paging.by_rows(equation, x, taken, torch.bfloat16)
        assert out.dtype == torch.bfloat16 and out.shape == exact.shape
        assert ((out.double() - exact).abs() <= one_step).all()
    monkeypatch.setattr(paging, "aten_bf16_emulated", lambda: True)
    assert mla.product_rows(rows.float()).dtype == torch.float32  # float32 rows as they are
    assert mla.product_rows(rows.half()).dtype == torch.float16
    compiled = torch.compile(lambda r: mla.product_rows(r).float(), fullgraph=True, backend="eager")
    assert torch.equal(compiled(rows), rows.float())  # the same form inside a compiled step


def test_mla_prefill_matches_naive_mla():
    gen = torch.Generator().manual_seed(3)
    lens = [2, S, S + 1, 13, 3 * S]
    p = _mla_problem(gen, SMALL, lens, num_blocks=32)
    tables = _tables(gen, lens, 32)
    positions, meta = _metadata(tables, [0] * len(lens), lens, 32)
    assert meta.decode is None and positions.tolist() == [t for n in lens for t in range(n)]
    write_kv_cache(p.cache, *_new_tokens(p.seqs, [0] * len(lens), lens), meta.slot_mapping)
    out = mla_prefill(torch.cat(p.q_nope), torch.cat(p.q_pe), p.cache, meta.prefill, p.w_uk, p.w_uv, p.scale)
    ref = torch.cat([_mla_oracle(p, i, n, slice(0, n)) for i, n in enumerate(lens)])
    _assert_matches(out, ref, 1e-5)


def _mla_prefill_in_chunks(p, tables, chunks, num_blocks):
    """Run prefill step by step: step k brings chunks[i][k] tokens of every sequence i."""
    outs, cached = [[] for _ in chunks], [0] * len(chunks)
    for step in range(len(chunks[0])):
        new = [c[step] for c in chunks]
        _, meta = _metadata(tables, cached, new, num_blocks)
        write_kv_cache(p.cache, *_new_tokens(p.seqs, cached, new), meta.slot_mapping)
        q_nope = torch.cat([q[c:c + n] for q, c, n in zip(p.q_nope, cached, new)])
        q_pe = torch.cat([q[c:c + n] for q, c, n in zip(p.q_pe, cached, new)])
        out = mla_prefill(q_nope, q_pe, p.cache, meta.prefill, p.w_uk, p.w_uv, p.scale)
        for i, part in enumerate(out.split(new)):
            outs[i].append(part)
        cached = [c + n for c, n in zip(cached, new)]
    return [torch.cat(o) for o in outs]


def test_chunked_mla_prefill_equals_one_shot_prefill():
    gen = torch.Generator().manual_seed(4)
    chunks = [[3, 6, 4], [5, 2, 9], [2, 2, 2]]  # chunk edges inside and on block edges
    lens = [sum(c) for c in chunks]
    p = _mla_problem(gen, SMALL, lens, num_blocks=32)
    tables = _tables(gen, lens, 32)
    chunked = _mla_prefill_in_chunks(p, tables, chunks, 32)
    one_shot = _mla_prefill_in_chunks(p._replace(cache=_fresh_mla_cache(p, 32)), tables,
                                      [[n] for n in lens], 32)
    for i, n in enumerate(lens):
        torch.testing.assert_close(chunked[i], one_shot[i], rtol=1e-5, atol=1e-6)
        _assert_matches(chunked[i], _mla_oracle(p, i, n, slice(0, n)), 1e-5)


def _fresh_mla_cache(p, num_blocks):
    spec = MLACacheSpec(p.cache.kv_c.shape[-1], p.cache.k_pe.shape[-1], p.cache.kv_c.dtype)
    return allocate_kv_caches([spec], num_blocks=num_blocks, block_size=S)[0]


def test_mixed_batch_runs_decodes_then_prefills_against_naive_mla():
    gen = torch.Generator().manual_seed(5)
    lens, cached = [6, 9, 1, 11, 7], [5, 8, 0, 3, 0]  # 3 decodes (one a 1-token prompt), 2 prefills
    new = [n - c for n, c in zip(lens, cached)]
    p = _mla_problem(gen, SMALL, lens, num_blocks=32)
    tables = _tables(gen, lens, 32)
    _write_prefix(p.cache, tables, p.seqs, cached)
    _, meta = _metadata(tables, cached, new, 32)
    assert meta.num_decode_tokens == 3 and meta.prefill.query_lens == (8, 7)
    write_kv_cache(p.cache, *_new_tokens(p.seqs, cached, new), meta.slot_mapping)
    q_nope = torch.cat([q[c:] for q, c in zip(p.q_nope, cached)])
    q_pe = torch.cat([q[c:] for q, c in zip(p.q_pe, cached)])
    dec = mla_decode(q_nope[:3], q_pe[:3], p.cache, meta.decode, p.w_uk, p.w_uv, p.scale)
    pre = mla_prefill(q_nope[3:], q_pe[3:], p.cache, meta.prefill, p.w_uk, p.w_uv, p.scale)
    ref = torch.cat([_mla_oracle(p, i, n, slice(c, n)) for i, (n, c) in enumerate(zip(lens, cached))])
    _assert_matches(torch.cat([dec, pre]), ref, 1e-5)


# ---------------------------------------------------------------------------------------------
# Paged MHA / GQA
