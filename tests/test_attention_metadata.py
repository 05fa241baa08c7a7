"""Attention metadata: hand-computed slots, padding to a capture size, bad batches named."""

import array

import pytest
import torch

from attention_cases import MAX_LEN, S, SMALL, _assert_matches, _metadata, _new_tokens, _slots, _tables, _write_prefix
from ascend_graph.attention import build_attention_metadata, pad_decode
from ascend_graph.engine.block_manager import BlockManager
from ascend_graph.attention import mla_decode
from ascend_graph.kv_cache import NULL_BLOCK, write_kv_cache
from test_attention import _mla_decode_oracle, _mla_problem



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
