"""The transfer planner, without any transport: layouts, fingerprints, mismatches, plans.

A plan is checked by applying its descriptors byte by byte to real cache tensors and comparing
with ``index_copy_`` of the same blocks (the oracle)."""

import ctypes

import pytest
import torch
from hypothesis import given, settings, strategies as st

from ascend_graph.kv_cache import MLACacheSpec, KVCacheSpec, allocate_kv_caches
from ascend_graph.pd.layout import CacheLayout, LayoutMismatch, block_runs, check_drafting, plan_transfer

SPECS = [MLACacheSpec(8, 4, torch.float32), MLACacheSpec(8, 4, torch.float32)]


def caches(num_blocks=12, block_size=4, specs=SPECS, seed=0):
    kv = allocate_kv_caches(specs, num_blocks, block_size)
    g = torch.Generator().manual_seed(seed)
    for cache in kv:
        for t in cache:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    return kv


def apply(plan):
    for batch in plan.batches:
        for d in batch:
            ctypes.memmove(d.dst, d.src, d.length)


def test_layout_lists_every_tensor_in_layer_order():
    kv = caches()
    layout = CacheLayout.of(kv)
    assert [(r.layer, r.field) for r in layout.regions] == [(0, "kv_c"), (0, "k_pe"), (1, "kv_c"), (1, "k_pe")]
    assert layout.regions[0].address == kv[0].kv_c.data_ptr()
    assert layout.regions[1].block_bytes == 4 * 1 * 4 * 4
    assert layout.bytes_per_block == 2 * (4 * 8 * 4 + 4 * 4 * 4)
    assert CacheLayout.from_dict(layout.to_dict()) == layout


def test_fingerprint_ignores_addresses_and_block_counts_but_not_shapes():
    kept = caches(12), caches(30)  # both alive: a freed one's address may be reused
    a, b = CacheLayout.of(kept[0]), CacheLayout.of(kept[1])
    assert a.fingerprint == b.fingerprint and a.regions[0].address != b.regions[0].address
    c = CacheLayout.of(caches(12, block_size=8))
    assert c.fingerprint != a.fingerprint


@pytest.mark.parametrize("other, words", [
    (dict(block_size=8), "block size differs: 4 here, 8"),
    (dict(specs=SPECS[:1]), "layer count differs: 2 here, 1"),
    (dict(specs=[SPECS[0], MLACacheSpec(8, 4, torch.bfloat16)]), "layer 1 kv_c: dtype differs: float32 here, bfloat16"),
    (dict(specs=[SPECS[0], MLACacheSpec(8, 2, torch.float32)]), "layer 1 k_pe: block shape differs"),
    (dict(specs=[SPECS[0], KVCacheSpec(1, 8, torch.float32)]), "layer 1 kv_c: field differs: kv_c here, k"),
])
def test_a_mismatch_names_the_difference(other, words):
    mine = CacheLayout.of(caches())
    with pytest.raises(LayoutMismatch, match=words):
        mine.check_matches(CacheLayout.of(caches(**other)))


def test_block_runs_merge_only_pairs_consecutive_on_both_sides():
    assert block_runs([3, 4, 5, 9, 10], [7, 8, 9, 11, 13]) == [(3, 7, 3), (9, 11, 1), (10, 13, 1)]
    assert block_runs([], []) == []


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_applied_plan_equals_index_copy_and_touches_nothing_else(data):
    n_src, n_dst = 10, 14
    count = data.draw(st.integers(1, 9))
    src_ids = data.draw(st.lists(st.integers(1, n_src - 1), min_size=count, max_size=count))
    dst_ids = data.draw(st.lists(st.integers(1, n_dst - 1), min_size=count, max_size=count, unique=True))
    max_desc = data.draw(st.integers(1, 6))
    max_bytes = data.draw(st.sampled_from([None, 4 * 8 * 4, 3 * 4 * 8 * 4, 10**6]))
    src, dst = caches(n_src, seed=1), caches(n_dst, seed=2)
    expected = [[t.clone().index_copy_(0, torch.tensor(dst_ids), s.index_select(0, torch.tensor(src_ids)))
                 for s, t in zip(a, b)] for a, b in zip(src, dst)]
    plan = plan_transfer(CacheLayout.of(src), CacheLayout.of(dst), src_ids, dst_ids,
                         max_descriptors=max_desc, max_batch_bytes=max_bytes)
    apply(plan)
    for exp, cache in zip(expected, dst):
        for e, t in zip(exp, cache):
            assert torch.equal(e, t)
    assert all(len(b) <= max_desc for b in plan.batches)
    if max_bytes is not None:
        assert all(sum(d.length for d in b) <= max_bytes for b in plan.batches)
    assert plan.num_bytes == count * CacheLayout.of(src).bytes_per_block


def test_contiguous_blocks_become_one_descriptor_per_tensor():
    src, dst = caches(20), caches(20)
    plan = plan_transfer(CacheLayout.of(src), CacheLayout.of(dst), list(range(1, 17)), list(range(3, 19)))
    assert plan.num_descriptors == 4 and len(plan.batches) == 1


@pytest.mark.parametrize("src_ids, dst_ids, words", [
    ([0, 1], [1, 2], r"src_blocks\[0\]=0 is not a usable block id"),
    ([1, 2], [2, 12], r"dst_blocks\[1\]=12 is not a usable block id.*\[1, 12\)"),
    ([1, 2], [3, 3], "dst_blocks repeats a block"),
    ([1, 2, 3], [3, 4], "src_blocks has 3 ids, dst_blocks 2"),
])
def test_bad_block_ids_are_rejected_before_any_plan(src_ids, dst_ids, words):
    a = CacheLayout.of(caches())
    with pytest.raises(ValueError, match=words):
        plan_transfer(a, a, src_ids, dst_ids)


def test_a_plan_between_mismatched_layouts_is_refused():
    with pytest.raises(LayoutMismatch, match="block size"):
        plan_transfer(CacheLayout.of(caches()), CacheLayout.of(caches(block_size=8)), [1], [1])


def test_non_contiguous_caches_are_refused():
    kv = caches()
    bad = (type(kv[0])(torch.zeros(12, 4, 1, 16)[..., :8], kv[0].k_pe),)
    with pytest.raises(ValueError, match="contiguous"):
        CacheLayout.of(bad)


@pytest.mark.parametrize("ours, theirs", [(0, 0), (1, 1), (2, 3), (3, 2)])
def test_drafting_agrees_where_the_prefill_rows_have_one_form(ours, theirs):
    check_drafting(ours, theirs, "decode side")  # 0: logits; 1: and a draft; > 1: and hidden states


@pytest.mark.parametrize("ours, theirs", [(0, 1), (1, 0), (1, 2), (3, 1), (0, 3)])
def test_drafting_that_changes_the_prefill_rows_is_refused_naming_both(ours, theirs):
    with pytest.raises(LayoutMismatch, match=f"num_speculative_tokens={ours} here, {theirs} on the decode side"):
        check_drafting(ours, theirs, "decode side")
