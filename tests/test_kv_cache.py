"""Tuple KV caches: allocation, byte accounting, the checked in-place write, validation.

Oracles: shapes and byte counts computed here from the spec by hand, and expected caches built
by plain indexing into clones (``expected[block, offset] = token``), never by the write op.
"""

import pytest
import torch

from ascend_graph.kv_cache import (
    NULL_BLOCK, KVCache, KVCacheSpec, MLACache, MLACacheSpec, allocate_kv_caches, blocks_for_budget,
    bytes_per_block, check_kv_caches, write_kv_cache,
)

MIB = 1 << 20
ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}  # by hand, not element_size()
MLA = MLACacheSpec(kv_lora_rank=32, qk_rope_head_dim=8)
GQA = KVCacheSpec(num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
N, S = 16, 4  # num_blocks, block_size of the small test caches


def _clone(caches):
    return tuple(type(c)(*(t.clone() for t in c)) for c in caches)


def _assert_caches_equal(actual, expected):
    for layer, (got, want) in enumerate(zip(actual, expected)):
        for field, g, w in zip(got._fields, got, want):
            assert torch.equal(g, w), f"layer {layer}.{field} differs"


def _random_fill(caches, seed=0):
    """Make every cache entry distinct so that a stray write cannot go unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    for cache in caches:
        for t in cache:
            t.copy_(torch.randn(t.shape, generator=gen))
    return caches


def _tokens(cache, n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, *t.shape[2:], generator=gen) for t in cache)


# ---------------------------------------------------------------------------------------------
# Allocation and byte accounting


def test_every_cache_tensor_is_its_own_zeroed_allocation_of_the_spec_shape():
    caches = allocate_kv_caches([MLA, GQA, MLA], num_blocks=N, block_size=S)
    assert [type(c) for c in caches] == [MLACache, KVCache, MLACache]
    expected_shapes = [[(N, S, 1, 32), (N, S, 1, 8)], [(N, S, 2, 16)] * 2, [(N, S, 1, 32), (N, S, 1, 8)]]
    expected_dtypes = [torch.float32, torch.bfloat16, torch.float32]
    spans = []
    for cache, shapes, dtype in zip(caches, expected_shapes, expected_dtypes):
        for t, shape in zip(cache, shapes):
            assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous()
            assert not t.any(), "caches must start zero-filled"
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    spans.sort()
    assert len({start for start, _ in spans}) == 6, "two cache tensors share a storage"
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "two cache tensors' storages overlap"


@pytest.mark.parametrize("spec", [MLA, GQA, MLACacheSpec(512, 64, torch.bfloat16)], ids=str)
def test_align_bytes_aligns_every_tensor_start(spec):
    caches = allocate_kv_caches([spec, spec], num_blocks=3, block_size=16, align_bytes=2 * MIB)
    for cache in caches:
        for t in cache:
            assert t.data_ptr() % (2 * MIB) == 0
            assert t.is_contiguous() and not t.any()
    ptrs = [t.untyped_storage().data_ptr() for c in caches for t in c]
    assert len(set(ptrs)) == len(ptrs)


def test_bytes_per_block_matches_shapes_times_element_sizes():
    specs = [MLA, GQA, MLACacheSpec(512, 64, torch.float16)]
    by_hand = S * ((32 + 8) * 4 + 2 * (2 * 16) * 2 + (512 + 64) * 2)
    assert bytes_per_block(specs, S) == by_hand
    caches = allocate_kv_caches(specs, num_blocks=N, block_size=S)
    allocated = sum(t.numel() * ITEMSIZE[t.dtype] for c in caches for t in c)
    assert allocated == N * by_hand


def test_blocks_for_budget_is_the_most_blocks_that_fit():
    per_block = S * 2 * (2 * 16) * 2  # GQA: k and v, bf16
    for budget in (2 * per_block, 2 * per_block + 1, 7 * per_block - 1, 1000 * per_block + 5):
        n = blocks_for_budget([GQA], S, budget)
        assert n * per_block <= budget < (n + 1) * per_block


# ---------------------------------------------------------------------------------------------
# The write


@pytest.mark.parametrize("spec", [MLA, GQA], ids=["mla", "gqa_bf16"])
def test_write_lands_each_token_at_its_slot_and_nowhere_else(spec):
    (cache,) = _random_fill(allocate_kv_caches([spec], num_blocks=N, block_size=S))
    expected = _clone((cache,))[0]
    slots = [S * 5 + 3, S * 1, S * 9 + 1, S * (N - 1) + S - 1, S * 2 + 2]  # any order, block edges
    a, b = _tokens(cache, len(slots))
    write_kv_cache(cache, a, b, torch.tensor(slots))
    for i, slot in enumerate(slots):
        expected[0][slot // S, slot % S] = a[i].to(spec.dtype)
        expected[1][slot // S, slot % S] = b[i].to(spec.dtype)
    _assert_caches_equal((cache,), (expected,))


def test_negative_slots_never_change_a_live_block():
    (cache,) = _random_fill(allocate_kv_caches([MLA], num_blocks=N, block_size=S))
    expected = _clone((cache,))[0]
    slots = [-1, S * 3 + 1, -1, -7, S * 4]
    a, b = _tokens(cache, len(slots))
    write_kv_cache(cache, a, b, torch.tensor(slots))
    for i, slot in enumerate(slots):
        if slot >= 0:
            expected.kv_c[slot // S, slot % S] = a[i]
            expected.k_pe[slot // S, slot % S] = b[i]
    for got, want in zip(cache, expected):
        assert torch.equal(got[NULL_BLOCK + 1:], want[NULL_BLOCK + 1:])
        assert got[NULL_BLOCK].isfinite().all()


def test_all_padding_write_touches_only_the_null_block():
    (cache,) = _random_fill(allocate_kv_caches([GQA], num_blocks=N, block_size=S))
    expected = _clone((cache,))[0]
    a, b = _tokens(cache, 4)
    write_kv_cache(cache, a, b, torch.full((4,), -1))
    for got, want in zip(cache, expected):
        assert torch.equal(got[1:], want[1:])


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and the caches unchanged


def _bad_write_cases():
    (cache,) = allocate_kv_caches([MLA], num_blocks=N, block_size=S)
    a, b = _tokens(cache, 3)
    good = torch.tensor([S * 2, S * 3, S * 4 + 1])
    return cache, a, b, good, [
        # (label, args to write_kv_cache, exception, message pattern)
        ("a_shape", (torch.randn(3, 1, 31), b, good), ValueError, "kv_c must have shape"),
        ("a_rank", (torch.randn(3, 32), b, good), ValueError, "kv_c must have shape"),
        ("b_shape", (a, torch.randn(3, 2, 8), good), ValueError, "k_pe must have shape"),
        ("a_device", (a.to("meta"), b, good), ValueError, "kv_c is on meta"),
        ("token_count", (a, b[:2], good[:2]), ValueError, "slot_mapping must have shape"),
        ("slots_length", (a, b, good[:2]), ValueError, r"slot_mapping must have shape \[3\]"),
        ("slot_out_of_range", (a, b, torch.tensor([S * 2, N * S, S * 4])), ValueError,
         r"slot_mapping\[1\]=64 is out of range"),
        ("slot_in_null_block", (a, b, torch.tensor([S * 2, S * 3, S - 1])), ValueError,
         r"slot_mapping\[2\]=3 lies in the reserved null block"),
        ("slot_float", (a, b, good.double() + 0.5), ValueError, "slot_mapping must hold integers"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_write_cases()[-1])),
                         ids=[c[0] for c in _bad_write_cases()[-1]])
def test_bad_write_raises_naming_the_argument_and_writes_nothing(case):
    cache, _, _, _, cases = _bad_write_cases()
    _random_fill((cache,))
    before = _clone((cache,))
    _, args, exc, pattern = cases[case]
    with pytest.raises(exc, match=pattern):
        write_kv_cache(cache, *args)
    _assert_caches_equal((cache,), before)


def test_write_into_something_that_is_not_a_layer_cache_raises_and_writes_nothing():
    (cache,) = _random_fill(allocate_kv_caches([MLA], num_blocks=N, block_size=S))
    before = _clone((cache,))
    a, b = _tokens(cache, 1)
    with pytest.raises(TypeError, match="cache must be an MLACache or KVCache, got tuple"):
        write_kv_cache(tuple(cache), a, b, torch.tensor([S]))
    with pytest.raises(ValueError, match="cache.k_pe must be a 4-d tensor"):
        write_kv_cache(MLACache(cache.kv_c, cache.k_pe[0]), a, b, torch.tensor([S]))
    _assert_caches_equal((cache,), before)


def _check(kv_caches, **kw):
    args = dict(specs=[MLA, GQA], num_blocks=N, block_size=S, device="cpu") | kw
    check_kv_caches(kv_caches, **args)


@pytest.mark.parametrize("device", ["cpu", "cpu:0", torch.device("cpu"), None])
def test_check_kv_caches_accepts_what_allocate_made(device):
    _check(allocate_kv_caches([MLA, GQA], num_blocks=N, block_size=S), device=device)


@pytest.mark.parametrize("mutate, exc, pattern", [
    (lambda c: list(c), TypeError, "kv_caches must be a tuple of per-layer caches, got list"),
    (lambda c: c[:1], ValueError, "kv_caches has 1 layers, expected 2"),
    (lambda c: c + c[:1], ValueError, "kv_caches has 3 layers, expected 2"),
    (lambda c: (tuple(c[0]), c[1]), TypeError, r"kv_caches\[0\] must be an MLACache or KVCache, got tuple"),
    (lambda c: ((*c[0], c[0].kv_c), c[1]), TypeError, r"kv_caches\[0\] must be an MLACache or KVCache"),
    (lambda c: (KVCache(*c[0]), c[1]), TypeError, r"kv_caches\[0\] must be a MLACache, got KVCache"),
    (lambda c: (c[0], KVCache(c[1].k, c[1].v.float())), ValueError,
     r"kv_caches\[1\].v has dtype torch.float32, expected torch.bfloat16"),
    (lambda c: (MLACache(c[0].kv_c, c[0].k_pe[:, :, :, :4]), c[1]), ValueError,
     r"kv_caches\[0\].k_pe has shape \[16, 4, 1, 4\], expected \[16, 4, 1, 8\]"),
    (lambda c: (MLACache(c[0].kv_c[:8], c[0].k_pe[:8]), c[1]), ValueError,
     r"kv_caches\[0\].kv_c has shape \[8, 4, 1, 32\], expected \[16, 4, 1, 32\]"),
    (lambda c: (MLACache(c[0].kv_c, c[0].k_pe[:8]), c[1]), ValueError,
     r"kv_caches\[0\]: both tensors must share \[num_blocks, block_size\]"),
    (lambda c: (c[0], KVCache(c[1].k[0], c[1].v)), ValueError, r"kv_caches\[1\].k must be a 4-d tensor"),
    (lambda c: (c[0], KVCache(c[1].k.to("meta"), c[1].v.to("meta"))), ValueError,
     r"kv_caches\[1\].k is on meta, expected cpu"),
], ids=["list", "too_few_layers", "too_many_layers", "plain_tuple", "tuple_of_three", "wrong_cache_type",
        "dtype", "shape_dim", "shape_blocks", "mismatched_blocks", "rank", "device"])
def test_check_kv_caches_rejects_a_bad_cache_naming_it(mutate, exc, pattern):
    caches = _random_fill(allocate_kv_caches([MLA, GQA], num_blocks=N, block_size=S))
    before = _clone(caches)
    with pytest.raises(exc, match=pattern):
        _check(mutate(caches))
    _assert_caches_equal(caches, before)


def test_allocation_rejects_bad_sizes_naming_the_argument():
    with pytest.raises(ValueError, match="align_bytes must be 0 or a power of two, got 3000"):
        allocate_kv_caches([MLA], num_blocks=N, block_size=S, align_bytes=3000)
    with pytest.raises(ValueError, match="align_bytes must be 0 or a power of two, got -4096"):
        allocate_kv_caches([MLA], num_blocks=N, block_size=S, align_bytes=-4096)
    with pytest.raises(ValueError, match="num_blocks must be >= 2"):
        allocate_kv_caches([MLA], num_blocks=1, block_size=S)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        allocate_kv_caches([MLA], num_blocks=N, block_size=0)


def test_budget_below_two_blocks_is_rejected():
    per_block = bytes_per_block([MLA], S)
    with pytest.raises(ValueError, match="budget_bytes=.* is too small"):
        blocks_for_budget([MLA], S, 2 * per_block - 1)
    assert blocks_for_budget([MLA], S, 2 * per_block) == 2


def test_write_of_one_slot_twice_is_rejected_before_writing():
    (cache,) = allocate_kv_caches([KVCacheSpec(2, 4)], num_blocks=4, block_size=2)
    before = [t.clone() for t in cache]
    with pytest.raises(ValueError, match=r"slot_mapping\[1\]=5 is also slot_mapping\[0\]"):
        write_kv_cache(cache, torch.ones(2, 2, 4), torch.ones(2, 2, 4), torch.tensor([5, 5]))
    assert all(torch.equal(t, b) for t, b in zip(cache, before))


def test_caches_on_huge_pages_are_zeroed_aligned_separate_allocations():
    from ascend_graph.runtime import HUGE_PAGE, huge_pages_supported

    if not huge_pages_supported():
        pytest.skip("no madvise(MADV_HUGEPAGE) here")
    specs = [MLACacheSpec(16, 4, torch.bfloat16), KVCacheSpec(2, 8, torch.float32)]
    caches = allocate_kv_caches(specs, num_blocks=5, block_size=4, huge_pages=True)
    plain = allocate_kv_caches(specs, num_blocks=5, block_size=4)
    tensors = [t for cache in caches for t in cache]
    for t, ref in zip(tensors, (t for cache in plain for t in cache)):
        assert t.shape == ref.shape and t.dtype == ref.dtype and t.is_contiguous()
        assert t.data_ptr() % HUGE_PAGE == 0 and not t.any()
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors)
