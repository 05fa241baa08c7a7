"""The cache write and decode steps compile whole (Inductor, CPU) and equal eager.

Each test runs the compiled function on one cache and the eager function on a clone of it, and
compares outputs and entire caches. The generated code is also read: the write must mutate the
cache tensors passed in, with no cache-sized buffer and no copy back into the cache. Each runs
under torch's own Inductor backend (the write stays a call of the custom op) and under this
project's CPU Inductor backend (the write is generated code, ``inline_cache_writes``).
"""

import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from ascend_graph.attention import build_attention_metadata, mla_decode, pad_decode, paged_decode
from ascend_graph.compile.inductor import make_backend
from ascend_graph.config import GraphConfig, InductorOptions
from ascend_graph.kv_cache import KVCacheSpec, MLACacheSpec, allocate_kv_caches, write_slots

N, S = 256, 4  # the cache (1024 slots) is much larger than anything a step of 3-4 rows touches
H, DN, R, DV, C = 4, 16, 8, 16, 32
SCALE = (DN + R) ** -0.5


@pytest.fixture(params=[False, True], ids=["torch_inductor", "ascend_graph_cpu"])
def inlined(request):
    """False: torch's own Inductor backend (the op is called); True: this project's CPU backend
    (the op's aten body is traced and generated)."""
    return request.param


def _compile(fn, inlined: bool):
    if not inlined:
        return torch.compile(fn, fullgraph=True)
    # the Python wrapper, so that the code can be read like torch's
    config = GraphConfig(enabled=True, inductor=InductorOptions(cpp_wrapper=False))
    backend = make_backend("inductor", config, "cpu", None)
    assert backend.inline_writes
    return torch.compile(fn, fullgraph=True, backend=backend)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _filled(spec, seed):
    (cache,) = allocate_kv_caches([spec], num_blocks=N, block_size=S)
    gen = torch.Generator().manual_seed(seed)
    for t in cache:
        t.copy_(torch.randn(t.shape, generator=gen))
    return cache, gen


def _clone(cache):
    return type(cache)(*(t.clone() for t in cache))


def _assert_no_cache_copy(code: str, cache, inlined: bool) -> None:
    """No buffer of a cache's size is allocated and nothing is copied back into an input; the
    write is the op's call, or (``inlined``) generated code."""
    sizes = [int(torch.Size(eval(shape)).numel())
             for shape in re.findall(r"empty_strided_\w+\((\([^)]*\))", code)]
    biggest = max(sizes, default=0)
    assert biggest < min(t.numel() for t in cache), f"a cache-sized buffer ({biggest}) is allocated"
    assert ".copy_(" not in code, "the compiled code copies into an input"
    assert ("torch.ops.ascend_graph.write_slots" in code) == (not inlined)
    assert ("index_copy" in code) == inlined  # a generated kernel, named after the ops it fuses


def _assert_no_graph_breaks():
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])


def _decode_batch(lens, gen):
    """Decode metadata for sequences of ``lens`` (after this step), padded to 4 rows."""
    ids = (torch.randperm(N - 1, generator=gen) + 1).tolist()
    tables, used = [], 0
    for n in lens:
        k = -(-n // S)
        tables.append(ids[used:used + k])
        used += k
    positions, meta = build_attention_metadata(tables, [n - 1 for n in lens], [1] * len(lens), block_size=S,
                                               num_blocks=N, max_model_len=8 * S, block_table_width=8)
    return pad_decode(positions, meta, 4)


def write_step(cache, a, b, slot_mapping):
    write_slots(cache[0], cache[1], a, b, slot_mapping)


def mla_step(q_nope, q_pe, kv_c, k_pe, cache, meta, w_uk, w_uv):
    write_slots(cache.kv_c, cache.k_pe, kv_c, k_pe, meta.slot_mapping)
    return mla_decode(q_nope, q_pe, cache, meta.decode, w_uk, w_uv, SCALE)


def paged_step(q, k, v, cache, meta):
    write_slots(cache.k, cache.v, k, v, meta.slot_mapping)
    return paged_decode(q, cache, meta.decode, SCALE)


def test_compiled_write_mutates_the_cache_in_place_like_eager(inlined):
    cache, gen = _filled(MLACacheSpec(C, R), seed=0)
    reference = _clone(cache)
    ptrs = [t.data_ptr() for t in cache]
    a, b = torch.randn(3, 1, C, generator=gen), torch.randn(3, 1, R, generator=gen)
    slots = torch.tensor([9 * S + 1, -1, 30 * S + 3])
    write_step(reference, a, b, slots)
    _, (code,) = run_and_get_code(_compile(write_step, inlined), cache, a, b, slots)
    _assert_no_graph_breaks()
    assert [t.data_ptr() for t in cache] == ptrs
    assert torch.equal(cache.kv_c, reference.kv_c) and torch.equal(cache.k_pe, reference.k_pe)
    assert torch.equal(cache.kv_c[9, 1], a[0]) and torch.equal(cache.k_pe[30, 3], b[2])
    _assert_no_cache_copy(code, cache, inlined)


def test_compiled_mla_decode_step_equals_eager_without_recompiling(inlined):
    cache, gen = _filled(MLACacheSpec(C, R), seed=1)
    reference = _clone(cache)
    w_uk, w_uv = torch.randn(H, DN, C, generator=gen) / C ** 0.5, torch.randn(H, DV, C, generator=gen) / C ** 0.5
    step = _compile(mla_step, inlined)
    for call, lens in enumerate([[5, 1, 12], [6, 2, 13]]):  # the second step crosses a block edge
        _, meta = _decode_batch(lens, torch.Generator().manual_seed(9))  # same tables each step
        args = (torch.randn(4, H, DN, generator=gen), torch.randn(4, H, R, generator=gen),
                torch.randn(4, 1, C, generator=gen), torch.randn(4, 1, R, generator=gen))
        with torch._dynamo.config.patch(error_on_recompile=call > 0):
            out, (code,) = run_and_get_code(step, *args, cache, meta, w_uk, w_uv)
        expected = mla_step(*args, reference, meta, w_uk, w_uv)
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(cache.kv_c, reference.kv_c) and torch.equal(cache.k_pe, reference.k_pe)
    _assert_no_graph_breaks()
    _assert_no_cache_copy(code, cache, inlined)


def test_compiled_paged_decode_step_equals_eager(inlined):
    cache, gen = _filled(KVCacheSpec(2, DN), seed=2)
    reference = _clone(cache)
    _, meta = _decode_batch([7, 3, 4], gen)
    args = (torch.randn(4, 8, DN, generator=gen), torch.randn(4, 2, DN, generator=gen),
            torch.randn(4, 2, DN, generator=gen))
    out, (code,) = run_and_get_code(_compile(paged_step, inlined), *args, cache, meta)
    _assert_no_graph_breaks()
    torch.testing.assert_close(out, paged_step(*args, reference, meta), rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.k, reference.k) and torch.equal(cache.v, reference.v)
    _assert_no_cache_copy(code, cache, inlined)


def test_inlined_write_is_served_from_aot_autograd_cache_on_a_later_compile(tmp_path):
    """The inlined write is aten op nodes: AOTAutograd's cache takes the graph (a Python function
    as a node's target would bypass it on every compile, and a warm start would retrace)."""
    cache, gen = _filled(MLACacheSpec(C, R), seed=3)
    a, b = torch.randn(2, 1, C, generator=gen), torch.randn(2, 1, R, generator=gen)
    slots = torch.tensor([5 * S, 7 * S + 2])
    backend = make_backend("inductor", GraphConfig(enabled=True, compile_cache_dir=str(tmp_path)), "cpu", None)
    for _ in range(2):
        torch._dynamo.reset()
        torch.compile(write_step, fullgraph=True, backend=backend)(cache, a, b, slots)
    stats = counters["aot_autograd"]
    assert stats["autograd_cache_bypass"] == 0, dict(stats)
    assert stats["autograd_cache_miss"] == 1 and stats["autograd_cache_hit"] == 1, dict(stats)
    assert torch.equal(cache.kv_c[7, 2], a[1]) and torch.equal(cache.k_pe[5, 0], b[0])
