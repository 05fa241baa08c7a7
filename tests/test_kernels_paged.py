"""``ascend_graph::paged_rows_mm`` and ``paged_rows_bmm``, attention's decode products over a paged
cache read through the block table: equal to the products over the gathered rows (oracle: float64
over the same bfloat16 values, rounded once), head by head too, reading only the blocks named, and
refusing bad input by name before reading."""

from __future__ import annotations

import pytest
import torch

from test_expert_rows import _assert_one_rounding, _on_threads, needs_kernel


def _paged_case(seed: int, seqs: int, m: int, blocks: int, rows: int, width: int, table_width: int, heads_dim=True):
    """A paged cache ``[NB, S, 1, width]`` (or ``[NB, S, width]``), block tables that repeat some
    blocks and use the null block, and the same rows gathered (the oracle's input)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks, rows, 1, width) if heads_dim else (blocks, rows, width)
    cache = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    tables = torch.randint(0, blocks, (seqs, table_width), generator=gen, dtype=torch.int32)
    tables[0, 0] = 0
    tables[-1, -1] = tables[-1, 0]
    gathered = cache[tables.long()].reshape(seqs, table_width * rows, width)  # [B, T, width]
    return gen, cache, tables, gathered


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
# M: the tiles (3), the pairs form (5, 8), the wide form (16, 33: two chunks... of 16); S: 16, odd,
# 1; width: V2-Lite's latent and rope widths, odd
@pytest.mark.parametrize("m,rows,width,table_width", [(16, 16, 512, 9), (3, 3, 64, 5), (5, 1, 33, 7),
                                                      (8, 16, 64, 3), (33, 4, 96, 6), (70, 16, 40, 2)])
def test_paged_products_read_the_blocks_in_table_order_within_one_rounding(m, rows, width, table_width, threads):
    """``paged_rows_mm`` (scores) and ``paged_rows_bmm`` (values) equal the products over the
    gathered rows, each exact sum rounded once; int32 and int64 tables alike."""
    gen, cache, tables, gathered = _paged_case(m * width + rows, 3, m, 11, rows, width, table_width, rows != 1)
    q = torch.randn(3, m, width, generator=gen).to(torch.bfloat16)
    probs = torch.randn(3, m, table_width * rows, generator=gen).to(torch.bfloat16)
    scores = _on_threads(threads, lambda: torch.ops.ascend_graph.paged_rows_mm(q, cache, tables))
    assert scores.shape == (3, m, table_width * rows) and scores.dtype == torch.bfloat16
    _assert_one_rounding(scores, q.double() @ gathered.double().transpose(1, 2))
    values = _on_threads(threads, lambda: torch.ops.ascend_graph.paged_rows_bmm(probs, cache, tables.long()))
    assert values.shape == (3, m, width)
    _assert_one_rounding(values, probs.double() @ gathered.double())
    # the same kernel forms as over the gathered copy: the same bits
    ends = torch.arange(m, 3 * m + 1, m, dtype=torch.int32)
    assert torch.equal(scores.flatten(0, 1), torch.ops.ascend_graph.expert_rows_mm(q.flatten(0, 1), gathered, ends))
    assert torch.equal(values, torch.ops.ascend_graph.rows_bmm(probs, gathered))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
# Hk kv heads of D, G query heads each: Llama-3-8B's group (8 of 128, 4), MHA (one each), an odd
# head size; M: the tiles (4), AVX2's wide form (16), both (17); S: 16 and odd
@pytest.mark.parametrize("kv_heads,d,m,rows", [(8, 128, 4, 16), (4, 64, 1, 16), (3, 40, 17, 5), (2, 33, 16, 3)])
def test_paged_products_head_by_head_read_each_heads_rows_within_one_rounding(kv_heads, d, m, rows, threads):
    """Over a standard attention cache ``[NB, S, Hk, D]``: ``x [B, Hk, M, D]`` against head h's
    rows of each token (``paged_rows_mm``) and ``[B, Hk, M, T]`` times them (``paged_rows_bmm``)
    equal the products over the gathered rows, head by head, each exact sum rounded once; the
    other heads' rows (NaN in one of them) reach nothing."""
    gen = torch.Generator().manual_seed(kv_heads * d + m)
    cache = torch.randn(9, rows, kv_heads, d, generator=gen).to(torch.bfloat16)
    tables = torch.randint(1, 9, (3, 5), generator=gen, dtype=torch.int32)
    tables[2, 4] = tables[2, 0]  # a block read twice
    cache[0] = float("nan")  # a block no table names
    gathered = cache[tables.long()].flatten(1, 2).transpose(1, 2).double()  # [B, Hk, T, D]
    q = torch.randn(3, kv_heads, m, d, generator=gen).to(torch.bfloat16)
    probs = torch.randn(3, kv_heads, m, 5 * rows, generator=gen).to(torch.bfloat16)
    scores = _on_threads(threads, lambda: torch.ops.ascend_graph.paged_rows_mm(q, cache, tables))
    assert scores.shape == (3, kv_heads, m, 5 * rows) and scores.dtype == torch.bfloat16
    _assert_one_rounding(scores, q.double() @ gathered.transpose(2, 3))
    values = _on_threads(threads, lambda: torch.ops.ascend_graph.paged_rows_bmm(probs, cache, tables.long()))
    assert values.shape == (3, kv_heads, m, d)
    _assert_one_rounding(values, probs.double() @ gathered)
    if kv_heads > 1:  # a NaN in one head's row of a named token reaches that head's products only
        cache[tables[1, 2], 0, 1, 3] = float("nan")
        expected = torch.zeros(3, kv_heads, m, 5, rows, dtype=torch.bool)
        expected[:, 1, :, :, 0] = (tables == tables[1, 2])[:, None, :]  # token row 0 of each use of that block
        assert torch.equal(torch.ops.ascend_graph.paged_rows_mm(q, cache, tables).isnan(), expected.flatten(3, 4))


@needs_kernel
def test_paged_products_read_only_the_blocks_named_and_keep_nan_to_their_rows():
    """A NaN in a block no table names reaches nothing; one in a named token row reaches that
    token's scores only."""
    _, cache, tables, _ = _paged_case(5, 2, 16, 6, 4, 64, 3)
    named = set(tables.flatten().tolist())
    unnamed = next(b for b in range(6) if b not in named)
    cache[unnamed] = float("nan")
    q = torch.ones(2, 16, 64, dtype=torch.bfloat16)
    assert not torch.ops.ascend_graph.paged_rows_mm(q, cache, tables).isnan().any()
    probs = torch.ones(2, 16, 12, dtype=torch.bfloat16)
    assert not torch.ops.ascend_graph.paged_rows_bmm(probs, cache, tables).isnan().any()
    cache[tables[1, 2], 3, 0, 7] = float("nan")  # sequence 1's token 2 * 4 + 3 = 11
    scores = torch.ops.ascend_graph.paged_rows_mm(q, cache, tables)
    bad = scores.isnan()
    assert bad[1, :, 11].all() and bad.sum() == 16 * int((tables == tables[1, 2]).sum())  # each use of that block


@needs_kernel
def test_paged_products_refuse_bad_input_by_name_before_reading():
    _, cache, tables, _ = _paged_case(3, 2, 4, 6, 4, 64, 3)
    q, probs = torch.zeros(2, 4, 64, dtype=torch.bfloat16), torch.zeros(2, 4, 12, dtype=torch.bfloat16)
    out_of_range = tables.clone()
    out_of_range[1, 1] = 6
    with pytest.raises(ValueError, match=r"paged_rows_mm: block_tables ids must lie in \[0, 6\), got 0\.\.6"):
        torch.ops.ascend_graph.paged_rows_mm(q, cache, out_of_range)
    with pytest.raises(ValueError, match=r"paged_rows_bmm: block_tables ids must lie in \[0, 6\), got -1\.\."):
        torch.ops.ascend_graph.paged_rows_bmm(probs, cache, tables - 1)
    with pytest.raises(ValueError, match=r"paged_rows_bmm: x \[B, \(H,\) M, T\] needs T = 3 blocks x 4 rows = 12"):
        torch.ops.ascend_graph.paged_rows_bmm(probs[..., :11], cache, tables)
    with pytest.raises(ValueError, match="paged_rows_mm: x .* must end in the cache's row width 64"):
        torch.ops.ascend_graph.paged_rows_mm(q[..., :32], cache, tables)
    with pytest.raises(ValueError, match="paged_rows_mm: each cache block must hold its rows one after another"):
        torch.ops.ascend_graph.paged_rows_mm(q, cache.transpose(1, 3).contiguous().transpose(1, 3), tables)
    with pytest.raises(ValueError, match="paged_rows_mm: block_tables must be int32 or int64"):
        torch.ops.ascend_graph.paged_rows_mm(q, cache, tables.float())
    with pytest.raises(ValueError, match=r"paged_rows_mm: expected x \[B, M, \*\] with cache .* got \(1, 4, 64\)"):
        torch.ops.ascend_graph.paged_rows_mm(q[:1], cache, tables)
    with pytest.raises(ValueError, match="paged_rows_mm: x and w must be bfloat16"):
        torch.ops.ascend_graph.paged_rows_mm(q, cache.float(), tables)
    # head by head: x's heads must be the cache's
    heads = torch.zeros(6, 4, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"paged_rows_mm: expected x \[B, M, \*\] .* or x \[B, H, M, \*\] with cache "
                                         r"\[NB, S, H, width\].* got \(2, 3, 4, 64\), \(6, 4, 2, 64\)"):
        torch.ops.ascend_graph.paged_rows_mm(torch.zeros(2, 3, 4, 64, dtype=torch.bfloat16), heads, tables)
