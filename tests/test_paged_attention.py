"""Eager paged attention (MHA / GQA) over ``KVCache(k, v)`` against ``dense_attention`` (float64,
contiguous per-sequence tensors; ``attention_cases``)."""

import pytest
import torch

from attention_cases import S, _assert_matches, _metadata, _new_tokens, _ragged_lens, _tables, _write_prefix
from ascend_graph.attention import paged_decode, paged_prefill, paging
from ascend_graph.attention.oracle import dense_attention
from ascend_graph.kv_cache import KVCacheSpec, allocate_kv_caches, write_kv_cache


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
    (``decode_attention``); against the float64 oracle on the same bf16 values."""
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
