"""Eager paged attention over tuple caches against float64 oracles on contiguous tensors.

Every test keeps each sequence's keys/latents as its own contiguous tensor, writes them into a
paged cache through shuffled, non-contiguous block tables, and compares the paged ops with
``naive_mla`` / ``dense_attention`` computed from the contiguous copies (never from the cache).
"""

import array
from typing import NamedTuple

import pytest
import torch

from ascend_graph.attention import build_attention_metadata, mla_decode, mla_prefill, pad_decode
from ascend_graph.attention import mla, paged_decode, paged_prefill, paging
from ascend_graph.attention.oracle import dense_attention, naive_mla
from ascend_graph.engine.block_manager import BlockManager
from ascend_graph.kv_cache import (
    NULL_BLOCK, KVCacheSpec, MLACacheSpec, allocate_kv_caches, write_kv_cache,
)

S = 4  # block size: small, so that ragged lengths cross many block boundaries
MAX_LEN = 64


class MLADims(NamedTuple):
    H: int
    Dn: int
    R: int
    Dv: int
    C: int


SMALL = MLADims(H=4, Dn=16, R=8, Dv=16, C=32)
V2_LITE = MLADims(H=16, Dn=128, R=64, Dv=128, C=512)


# ---------------------------------------------------------------------------------------------
# Helpers: sequences kept contiguous by the test, written through shuffled block tables


def _tables(gen, lens, num_blocks, block_size=S):
    """Each sequence gets distinct block ids, drawn in random order from all live blocks."""
    ids = (torch.randperm(num_blocks - 1, generator=gen) + NULL_BLOCK + 1).tolist()
    tables, used = [], 0
    for n in lens:
        k = -(-n // block_size)
        tables.append(ids[used:used + k])
        used += k
    assert used < num_blocks - 1, "leave spare blocks so that tables are not contiguous"
    return tables


def _slots(table, start, stop, block_size=S):
    """Slots of positions [start, stop) by hand: block id * block_size + offset in the block."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def _write_prefix(cache, tables, seqs, counts):
    """Write the first ``counts[i]`` tokens of sequence ``i`` (seqs[i] = (a [L, ..], b [L, ..]))."""
    slots = [s for t, n in zip(tables, counts) for s in _slots(t, 0, n)]
    if slots:
        a = torch.cat([sa[:n] for (sa, _), n in zip(seqs, counts)])
        b = torch.cat([sb[:n] for (_, sb), n in zip(seqs, counts)])
        write_kv_cache(cache, a, b, torch.tensor(slots))


def _new_tokens(seqs, cached, new):
    a = torch.cat([sa[c:c + n] for (sa, _), c, n in zip(seqs, cached, new)])
    b = torch.cat([sb[c:c + n] for (_, sb), c, n in zip(seqs, cached, new)])
    return a, b


def _metadata(tables, cached, new, num_blocks, width=None):
    return build_attention_metadata(tables, cached, new, block_size=S, num_blocks=num_blocks,
                                    max_model_len=MAX_LEN, block_table_width=width)


def _ragged_lens(gen, batch):
    """Random lengths, plus the block-boundary cases: 1, exactly one block, one past it."""
    lens = torch.randint(2, 3 * S * 2, (batch,), generator=gen).tolist()
    lens[:3] = [1, S, S + 1]
    return lens


def _assert_matches(out, ref, rel_atol):
    """``out`` within ``rel_atol * max|ref|`` of the float64 oracle, element-wise."""
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=rel_atol * ref.abs().max().item())


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


HEADS = pytest.mark.parametrize("hq, hk", [(4, 4), (8, 2)], ids=["mha", "gqa"])
D = 16


def _kv_problem(gen, hk, lens, num_blocks, dtype=torch.float32):
    (cache,) = allocate_kv_caches([KVCacheSpec(hk, D, dtype)], num_blocks=num_blocks, block_size=S)
    seqs = [(torch.randn(n, hk, D, generator=gen).to(dtype), torch.randn(n, hk, D, generator=gen).to(dtype))
            for n in lens]
    return cache, seqs


def _dense_oracle(q, seqs, i, length):
    k, v = seqs[i]
    return dense_attention(q, k[:length], v[:length], D ** -0.5)


@HEADS
@pytest.mark.parametrize("seed", [0, 1])
def test_paged_decode_matches_dense_attention(seed, hq, hk):
    gen = torch.Generator().manual_seed(seed)
    lens = _ragged_lens(gen, batch=6)
    cache, seqs = _kv_problem(gen, hk, lens, 64)
    tables = _tables(gen, lens, 64)
    _write_prefix(cache, tables, seqs, [n - 1 for n in lens])
    _, meta = _metadata(tables, [n - 1 for n in lens], [1] * 6, 64, width=10)
    write_kv_cache(cache, *_new_tokens(seqs, [n - 1 for n in lens], [1] * 6), meta.slot_mapping)
    q = torch.randn(6, hq, D, generator=gen) * 2
    out = paged_decode(q, cache, meta.decode, D ** -0.5)
    ref = torch.cat([_dense_oracle(q[i:i + 1], seqs, i, n) for i, n in enumerate(lens)])
    _assert_matches(out, ref, 1e-5)


@HEADS
@pytest.mark.parametrize("form", ["aten_bf16", "float32_products", "kernel"])
def test_paged_decode_matches_dense_attention_bfloat16(form, hq, hk, monkeypatch):
    """The three forms of the bf16 products, whichever this CPU would pick: the reference
    backend's aten bf16 einsums over the gathered rows, the same in float32
    (``paging.float32_products``), and the cpu_kernel backend over the cache in place
    (``paged_rows_mm``, ``paged_rows_bmm``); against the float64 oracle on the same bf16 values."""
    from ascend_graph import kernels
    from ascend_graph.attention.cpu import CpuPaged

    monkeypatch.setattr(paging, "aten_bf16_emulated", lambda: form != "aten_bf16")
    decode = CpuPaged().decode if form == "kernel" else paged_decode
    if form == "kernel" and not kernels.available():
        pytest.skip("the kernel does not run here (no C compiler, or neither AVX512-BF16 nor AVX2)")
    gen = torch.Generator().manual_seed(3)
    lens = _ragged_lens(gen, batch=6)
    cache, seqs = _kv_problem(gen, hk, lens, 64, torch.bfloat16)
    tables = _tables(gen, lens, 64)
    _write_prefix(cache, tables, seqs, [n - 1 for n in lens])
    _, meta = _metadata(tables, [n - 1 for n in lens], [1] * 6, 64, width=10)
    write_kv_cache(cache, *_new_tokens(seqs, [n - 1 for n in lens], [1] * 6), meta.slot_mapping)
    q = (torch.randn(6, hq, D, generator=gen) * 2).to(torch.bfloat16)
    out = decode(q, cache, meta.decode, D ** -0.5)
    assert out.dtype == torch.bfloat16
    ref = torch.cat([_dense_oracle(q[i:i + 1], seqs, i, n) for i, n in enumerate(lens)])  # float64
    # scores, probabilities and output each rounded to bf16 (see the MLA bf16 test): 4% of the
    # output's magnitude
    _assert_matches(out, ref, 4e-2)


@HEADS
def test_paged_prefill_in_chunks_matches_dense_attention(hq, hk):
    gen = torch.Generator().manual_seed(2)
    chunks = [[3, 6, 4], [5, 2, 9], [2, 2, 2]]
    lens = [sum(c) for c in chunks]
    cache, seqs = _kv_problem(gen, hk, lens, 32)
    tables = _tables(gen, lens, 32)
    qs = [torch.randn(n, hq, D, generator=gen) * 2 for n in lens]
    outs, cached = [[] for _ in lens], [0] * len(lens)
    for step in range(3):
        new = [c[step] for c in chunks]
        _, meta = _metadata(tables, cached, new, 32)
        write_kv_cache(cache, *_new_tokens(seqs, cached, new), meta.slot_mapping)
        q = torch.cat([q[c:c + n] for q, c, n in zip(qs, cached, new)])
        for i, part in enumerate(paged_prefill(q, cache, meta.prefill, D ** -0.5).split(new)):
            outs[i].append(part)
        cached = [c + n for c, n in zip(cached, new)]
    for i, n in enumerate(lens):
        _assert_matches(torch.cat(outs[i]), _dense_oracle(qs[i], seqs, i, n), 1e-5)


# ---------------------------------------------------------------------------------------------
# Metadata


def test_mixed_batch_metadata_orders_decodes_first_with_hand_computed_slots():
    tables = [[7, 3], [12], [5, 9, 2], [4, 11, 8, 6]]
    cached, new = [5, 0, 2, 3], [1, 1, 7, 10]
    positions, meta = build_attention_metadata(tables, cached, new, block_size=S, num_blocks=16,
                                               max_model_len=MAX_LEN, block_table_width=5)
    exp_pos, exp_slots = [], []
    for table, c, n in zip(tables, cached, new):
        for pos in range(c, c + n):
            exp_pos.append(pos)
            exp_slots.append(table[pos // S] * S + pos % S)
    assert positions.tolist() == exp_pos and positions.dtype == torch.int64
    assert meta.slot_mapping.tolist() == exp_slots and meta.slot_mapping.dtype == torch.int64
    assert exp_slots[:2] == [3 * S + 1, 12 * S + 0]  # spot check of the loop itself
    assert meta.decode.block_tables.tolist() == [[7, 3, 0, 0, 0], [12, 0, 0, 0, 0]]
    assert meta.decode.context_lens.tolist() == [6, 1]
    assert meta.prefill.block_tables.tolist() == [[5, 9, 2, 0, 0], [4, 11, 8, 6, 0]]
    assert meta.prefill.query_lens == (7, 10) and meta.prefill.context_lens == (9, 13)
    assert meta.num_decode_tokens == 2 and not meta.is_decode_only


@pytest.mark.parametrize("tables, cached, new, kw, pattern", [
    ([[3, 16]], [0], [5], {}, r"block id 16 in block_tables\[0\] is out of range"),
    ([[3], [0, 2]], [0, 0], [1, 2], {}, r"block id 0 in block_tables\[1\] is out of range"),
    ([[3], [-1]], [0, 0], [1, 2], {}, r"block id -1 in block_tables\[1\]"),
    ([list(range(1, 16))], [MAX_LEN - 1], [2], {}, "context length 65 exceeds max_model_len=64"),
    ([[3, 4]], [7], [2], {}, r"block_tables\[0\] has 2 blocks of 4, too few for 9 tokens"),
    ([[3], [4]], [0, 3], [3, 1], {}, r"sequence 1: decode sequences \(num_new == 1\) must come before"),
    ([[3], [4]], [0], [1, 1], {}, "block_tables, num_cached and num_new must be .* equal length"),
    ([[3], [4]], [0, 0], [1], {}, "block_tables, num_cached and num_new must be .* equal length"),
    ([], [], [], {}, "must be non-empty"),
    ([[3]], [0], [0], {}, "num_new must be >= 1"),
    ([[3]], [-1], [1], {}, "num_cached >= 0"),
    ([[3, 4, 5]], [0], [9], {"block_table_width": 2}, r"block_table_width=2 must be >= 1 and at least .* \(3 blocks\)"),
    ([[3]], [0], [2], {"block_table_width": 0}, "block_table_width=0 must be >= 1"),
], ids=["block_past_end", "null_block", "negative_block", "too_long", "too_few_blocks", "decode_after_prefill",
        "num_new_length", "num_cached_length", "empty", "no_new_tokens", "negative_cached", "narrow_width",
        "zero_width"])
def test_bad_batch_is_rejected_naming_the_argument(tables, cached, new, kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_attention_metadata(tables, cached, new, block_size=S, num_blocks=16, max_model_len=MAX_LEN, **kw)


def test_block_manager_tables_give_the_same_metadata_as_lists_and_stay_the_callers():
    blocks = BlockManager(num_blocks=16, block_size=S)
    arrays = [blocks.ensure("a", 6), blocks.ensure("b", 1), blocks.ensure("c", 9)]
    lists = [list(t) for t in arrays]
    kw = dict(block_size=S, num_blocks=16, max_model_len=MAX_LEN, block_table_width=4)
    cached, new = [5, 0, 2], [1, 1, 7]
    pos_a, meta_a = build_attention_metadata(arrays, cached, new, **kw)
    pos_l, meta_l = build_attention_metadata(lists, cached, new, **kw)
    assert pos_a.tolist() == pos_l.tolist() and meta_a.slot_mapping.tolist() == meta_l.slot_mapping.tolist()
    assert meta_a.decode.block_tables.dtype == torch.int32
    assert meta_a.decode.block_tables.tolist() == [lists[0] + [0, 0], lists[1] + [0, 0, 0]]
    assert meta_a.prefill.block_tables.tolist() == [lists[2] + [0]]
    # The metadata owns its tables: the block manager grows and frees its arrays afterwards.
    blocks.ensure("b", 2 * S + 1)
    blocks.free("a")
    assert meta_a.decode.block_tables.tolist() == [lists[0] + [0, 0], lists[1] + [0, 0, 0]]


@pytest.mark.parametrize("bad, pattern", [
    (0, r"sequence 63: block id 0 in block_tables\[63\] is out of range \[1, 4098\)"),
    (4098, r"sequence 63: block id 4098 in block_tables\[63\]"),
    (2.0, "block_tables must hold integer block ids"),
], ids=["null_block", "past_end", "float"])
def test_bad_id_among_many_tables_is_named(bad, pattern):
    """64 tables of 64 blocks (array and list rows mixed); the last id of the last table is bad."""
    tables = [list(range(1 + 64 * i, 65 + 64 * i)) for i in range(64)]
    tables = [array.array("i", t) if i % 2 else t for i, t in enumerate(tables)]
    tables[-1] = list(tables[-1])[:-1] + [bad]
    with pytest.raises(ValueError, match=pattern):
        build_attention_metadata(tables, [0] * 64, [1] * 64, block_size=S, num_blocks=4098, max_model_len=64 * S)


def test_pad_decode_rejects_prefill_batches_and_smaller_sizes():
    _, mixed = build_attention_metadata([[3], [4, 5]], [0, 0], [1, 5], block_size=S, num_blocks=16,
                                        max_model_len=MAX_LEN)
    with pytest.raises(ValueError, match="meta must describe a decode-only batch"):
        pad_decode(torch.zeros(6, dtype=torch.int64), mixed, 8)
    pos, dec = build_attention_metadata([[3], [4], [6]], [0, 2, 1], [1, 1, 1], block_size=S, num_blocks=16,
                                        max_model_len=MAX_LEN)
    with pytest.raises(ValueError, match=r"size=2 is smaller than the batch \(3 decode rows\)"):
        pad_decode(pos, dec, 2)


# ---------------------------------------------------------------------------------------------
# Padding


def test_padded_rows_leave_live_blocks_untouched_and_stay_finite():
    gen = torch.Generator().manual_seed(6)
    lens = [3, S + 1, 2 * S]
    p = _mla_problem(gen, SMALL, lens + [1] * 5, num_blocks=16)  # 5 spare queries for padded rows
    for t in p.cache:  # live blocks full of values, so that any stray write shows
        t.copy_(torch.randn(t.shape, generator=gen))
    tables = _tables(gen, lens, 16)
    _write_prefix(p.cache, tables, p.seqs, [n - 1 for n in lens])
    expected = [t.clone() for t in p.cache]
    for (kv_c, k_pe), table, n in zip(p.seqs, tables, lens):
        (slot,) = _slots(table, n - 1, n)
        expected[0][slot // S, slot % S], expected[1][slot // S, slot % S] = kv_c[n - 1], k_pe[n - 1]

    positions, meta = _metadata(tables, [n - 1 for n in lens], [1] * 3, 16, width=3)
    positions, meta = pad_decode(positions, meta, 8)
    assert meta.slot_mapping.shape == (8,) and (meta.slot_mapping[3:] < 0).all()
    a, b = _new_tokens(p.seqs, [n - 1 for n in lens] + [0] * 5, [1] * 8)
    write_kv_cache(p.cache, a, b, meta.slot_mapping)
    q_nope = torch.cat([q[-1:] for q in p.q_nope])  # [8, H, Dn]
    q_pe = torch.cat([q[-1:] for q in p.q_pe])
    out = mla_decode(q_nope, q_pe, p.cache, meta.decode, p.w_uk, p.w_uv, p.scale)

    for got, want in zip(p.cache, expected):
        assert torch.equal(got[NULL_BLOCK + 1:], want[NULL_BLOCK + 1:])
    assert out.shape[0] == 8 and out.isfinite().all()
    _assert_matches(out[:3], _mla_decode_oracle(p, lens), 1e-5)


def test_two_tokens_writing_one_slot_are_rejected():
    # Two sequences that share their last block would both write slot 3*S + 1.
    with pytest.raises(ValueError, match=r"slot_mapping\[1\]=.* is also slot_mapping\[0\]"):
        build_attention_metadata([[3], [3]], [1, 1], [1, 1], block_size=S, num_blocks=16, max_model_len=MAX_LEN)
