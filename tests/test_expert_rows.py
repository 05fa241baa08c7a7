"""``ascend_graph::expert_rows_mm``, the CPU kernel for the routed experts' few rows per expert:
it computes each row times its expert's weight (oracle: a float64 matmul of the same bfloat16
values, rounded once), the MoE uses it in eager and compiled mode alike, bad input is refused
before anything is written, and a built kernel is kept for later processes. Its other entries:
``rows_mm`` (one weight) and ``rows_bmm`` (a batch of ``[K, N]`` matrices)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ascend_graph import kernels

from test_moe_forms import _moe

needs_kernel = pytest.mark.skipif(not kernels.available(),
                                  reason="expert_rows_mm needs a C compiler and a CPU with AVX512-BF16 or AVX2 and FMA")


def _oracle(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    starts = [0] + ends[:-1].tolist()
    return torch.cat([x[s:e].double() @ w[i].double().T for i, (s, e) in enumerate(zip(starts, ends.tolist()))])


def _on_threads(threads: int, call):
    """``call()`` with torch at ``threads`` threads (the kernel's OpenMP split), then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return call()
    finally:
        torch.set_num_threads(before)


def _assert_one_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """float32 sums rounded once to bfloat16: within one bfloat16 step (2^-8 relative) of the exact sum."""
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
# K with and without a 32-wide tail; N ending in a part tile of 1 to 5 of the 6 weight rows taken together
@pytest.mark.parametrize("n,k", [(300, 2048), (125, 64), (124, 80), (9, 33), (8, 96), (7, 33)])
def test_each_row_times_its_experts_weight(n, k, threads):
    counts = torch.tensor([0, 3, 1, 5, 0, 2, 9, 4, 0, 8])  # empty experts, and rows past the 4 taken together
    ends = counts.cumsum(0).to(torch.int32)
    gen = torch.Generator().manual_seed(n + k)
    w = torch.randn(len(counts), n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(int(ends[-1]), k, generator=gen).to(torch.bfloat16)
    got = _on_threads(threads, lambda: torch.ops.ascend_graph.expert_rows_mm(x, w, ends))
    exact = _oracle(x, w, ends)
    assert got.dtype == torch.bfloat16 and got.shape == exact.shape
    _assert_one_rounding(got, exact)
    if k % 8 == 0:  # _grouped_mm needs 16-byte strides
        torch.testing.assert_close(got, torch._grouped_mm(x, w.transpose(1, 2), offs=ends), atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("tokens", [16, 1])
def test_eager_and_compiled_moe_both_call_the_kernel_and_agree_with_grouped_mm(monkeypatch, tokens):
    """From 2 tokens, and at 1 token with ``one_token_kernel`` (as on AVX2 by default), the
    compiled MoE multiplies in the kernel as the eager one does: the same output, bit for bit."""
    moe = _moe().to(torch.bfloat16)
    moe.experts.one_token_kernel = True
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    op = torch.ops.ascend_graph.expert_rows_mm
    calls = []
    monkeypatch.setattr(torch.ops.ascend_graph, "expert_rows_mm", lambda *a: calls.append(a) or op(*a))
    with torch.no_grad():
        weights, experts = moe.gate(x)
        eager = moe.experts.decode(x, weights, experts)
        assert len(calls) == 2  # gate/up and down
        plain = moe.experts.sorted_by_expert(x, weights, experts, kernel=False)
        assert len(calls) == 2
    torch.testing.assert_close(eager, plain, atol=3e-2, rtol=3e-2)
    monkeypatch.undo()

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        compiled = torch.compile(moe.experts.decode, backend=recording, fullgraph=True, dynamic=False)
        torch.testing.assert_close(compiled(x, weights, experts), eager, atol=0, rtol=0)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("expert_rows_mm" in t for t in targets) == 2, targets


@needs_kernel
def test_compiled_one_token_moe_as_the_gathered_reduction_agrees_with_the_kernel():
    """``one_token_kernel`` False (the default on AVX512-BF16): one token's experts compiled as the
    gathered form, no kernel call, within bf16 rounding of the kernel's (eager) output."""
    moe = _moe().to(torch.bfloat16)
    moe.experts.one_token_kernel = False
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        weights, experts = moe.gate(x)
        eager = moe.experts.decode(x, weights, experts)
        compiled = torch.compile(moe.experts.decode, backend=recording, fullgraph=True, dynamic=False)
        got = compiled(x, weights, experts)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert not any("expert_rows_mm" in t for t in targets), targets
    torch.testing.assert_close(got, eager, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("one_token", [True, False])
def test_decode_picks_sorted_by_expert_when_compiled_from_two_tokens_where_the_kernel_runs(monkeypatch, one_token):
    """From 2 tokens where the kernel runs; at 1 token too where ``one_token_kernel``."""
    experts = _moe().to(torch.bfloat16).experts
    experts.one_token_kernel = one_token
    picked = []
    for name in ("gathered", "gathered_by_expert", "sorted_by_expert"):
        monkeypatch.setattr(experts, name, (lambda n: lambda *a: picked.append(n))(name))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for uses_kernel in (True, False):
        monkeypatch.setattr(experts, "uses_kernel", lambda x, u=uses_kernel: u)
        for tokens in (1, 2):
            x = torch.zeros(tokens, 64, dtype=torch.bfloat16)
            experts.decode(x, torch.ones(tokens, 2), torch.zeros(tokens, 2, dtype=torch.long))
    # small experts (below SORT_PAIRS_MIN_EXPERT_BYTES) and few pairs: gathered without the kernel
    assert picked == ["sorted_by_expert" if one_token else "gathered", "sorted_by_expert", "gathered", "gathered"]


def test_one_token_kernel_defaults_to_the_builds_choice():
    experts = _moe().to(torch.bfloat16).experts
    assert experts.one_token_kernel is None
    assert experts.one_token_in_kernel == kernels.ONE_ROW_KERNEL.get(kernels.isa(), False)
    experts.one_token_kernel = not experts.one_token_in_kernel
    assert experts.one_token_in_kernel == (not kernels.ONE_ROW_KERNEL.get(kernels.isa(), False))


def test_uses_kernel_only_for_bfloat16_on_cpu_and_not_when_switched_off(monkeypatch):
    experts = _moe().experts  # float32
    assert not experts.uses_kernel(torch.zeros(2, 64))
    experts = experts.to(torch.bfloat16)
    assert experts.uses_kernel(torch.zeros(2, 64, dtype=torch.bfloat16)) == kernels.available()
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)  # AOTInductor packages run it too
    assert experts.uses_kernel(torch.zeros(2, 64, dtype=torch.bfloat16)) == kernels.available()
    monkeypatch.undo()
    monkeypatch.setenv("ASCEND_GRAPH_EXPERT_KERNEL", "0")
    assert not kernels.available()


@needs_kernel
@pytest.mark.parametrize("case,message", [
    ("dtype", "must be bfloat16"), ("shape", "expected x [P, K], w [X, N, K], ends [X]"),
    ("ends", "ends[-1] must be the row count 5"),
])
def test_bad_input_is_refused_naming_what_was_expected(case, message):
    w = torch.randn(3, 8, 32).to(torch.bfloat16)
    x = torch.randn(5, 32).to(torch.bfloat16)
    ends = torch.tensor([2, 2, 5], dtype=torch.int32)
    if case == "dtype":
        x = x.float()
    elif case == "shape":
        w = w[:, :, :16]
    else:
        ends = torch.tensor([2, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        torch.ops.ascend_graph.expert_rows_mm(x, w, ends)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13])
def test_rows_mm_is_a_linear_within_one_rounding(rows):
    """``rows_mm(x, w)``: ``F.linear(x, w)`` of a row-major weight, the exact sum rounded once."""
    _check_rows_mm(rows, 2080, seed=rows)  # N = 131: 21 tiles and 5 rows; K: a 32-wide tail


def _check_rows_mm(rows: int, k: int, seed: int, threads: int = 1) -> None:
    """``rows_mm`` of random ``[rows, k]`` rows by a ``[131, k]`` weight against the float64
    product (within one bf16 rounding) and aten's."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(131, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    got = _on_threads(threads, lambda: torch.ops.ascend_graph.rows_mm(x, w))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 131)
    _assert_one_rounding(got, x.double() @ w.double().T)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, w), atol=5e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
# from 5 rows the wide forms (expert_rows.c): 8 rows by 2 pairs per vector up to 8 rows (K ending
# in 1-3 elements past whole steps of 4), 16 rows by 1 pair from 9, 64 rows per pass over the
# weight (65 and 130 take more than one, the last of 1 and 2 rows); K odd, 1, even; N = 120 + 11,
# a second work item ending in part tiles
@pytest.mark.parametrize("rows,k", [(4, 2081), (5, 2081), (6, 2082), (8, 2083), (8, 1), (9, 64), (16, 95),
                                    (21, 2081), (32, 64), (33, 1), (48, 2048), (64, 95), (65, 33), (130, 64)])
def test_rows_mm_wide_forms_are_a_linear_within_one_rounding(rows, k, threads):
    _check_rows_mm(rows, k, seed=rows * k, threads=threads)


@needs_kernel
@pytest.mark.parametrize("rows", [8, 24])
def test_rows_mm_wide_forms_keep_nan_and_inf_to_their_rows(rows):
    """A NaN or an infinity in a row reaches that row's outputs only, as in aten."""
    x, w = torch.ones(rows, 64, dtype=torch.bfloat16), torch.ones(40, 64, dtype=torch.bfloat16)
    x[3, 5], x[7, 0] = float("nan"), float("inf")
    got = torch.ops.ascend_graph.rows_mm(x, w)
    assert got[3].isnan().all() and (got[7] == float("inf")).all()
    keep = torch.ones(rows, dtype=torch.bool)
    keep[[3, 7]] = False
    assert (got[keep] == 64).all()


@needs_kernel
def test_rows_mm_refuses_bad_input_by_name():
    x, w = torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows_mm: x and w must be bfloat16"):
        torch.ops.ascend_graph.rows_mm(x.float(), w)
    with pytest.raises(ValueError, match=r"rows_mm: expected x \[M, K\] and w \[N, K\]; got \(2, 32\), \(8, 16\)"):
        torch.ops.ascend_graph.rows_mm(x, w[:, :16])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
# M: tiles of 8 rows and part tiles; K: odd (a last pair with 0), 1, and past one panel of pairs
# (N = 512: 64 pairs per panel); N: whole and part column blocks of 32
@pytest.mark.parametrize("m,k,n", [(16, 256, 512), (3, 37, 45), (9, 2049, 70), (1, 1, 1), (32, 128, 512),
                                   (13, 200, 33)])
def test_rows_bmm_is_a_bmm_within_one_rounding(m, k, n, threads):
    """``rows_bmm(x, w)``: ``torch.bmm`` over ``[K, N]`` matrices, the exact sum rounded once."""
    gen = torch.Generator().manual_seed(m * k + n)
    x = torch.randn(5, m, k, generator=gen).to(torch.bfloat16)
    w = torch.randn(5, k, n, generator=gen).to(torch.bfloat16)
    got = _on_threads(threads, lambda: torch.ops.ascend_graph.rows_bmm(x, w))
    assert got.dtype == torch.bfloat16 and got.shape == (5, m, n)
    _assert_one_rounding(got, x.double() @ w.double())
    torch.testing.assert_close(got, torch.bmm(x, w), atol=5e-2, rtol=2e-2)


@needs_kernel
def test_rows_bmm_reads_strided_entries_and_keeps_nan_and_inf_to_their_rows():
    """Per-head ``[Dn, C]`` slices of a checkpoint's ``[H, Dn + Dv, C]`` ``kv_b_proj`` (entries
    apart, rows contiguous) as they lie;
    a NaN or an infinity in a row reaches that row's outputs only."""
    gen = torch.Generator().manual_seed(11)
    kv_b = torch.randn(4, 24, 64, generator=gen).to(torch.bfloat16)  # [H, Dn + Dv, C]
    w_uk = kv_b[:, :16]  # [H, Dn, C]: stride 24 * 64 between heads
    q = torch.randn(4, 6, 16, generator=gen).to(torch.bfloat16)
    _assert_one_rounding(torch.ops.ascend_graph.rows_bmm(q, w_uk), q.double() @ w_uk.double())
    x, w = torch.ones(2, 10, 64, dtype=torch.bfloat16), torch.ones(2, 64, 40, dtype=torch.bfloat16)
    x[0, 3, 5], x[1, 7, 0] = float("nan"), float("inf")
    got = torch.ops.ascend_graph.rows_bmm(x, w)
    assert got[0, 3].isnan().all() and (got[1, 7] == float("inf")).all()
    keep = torch.ones(2, 10, dtype=torch.bool)
    keep[0, 3] = keep[1, 7] = False
    assert (got[keep] == 64).all()


@needs_kernel
def test_rows_bmm_refuses_bad_input_by_name():
    x, w = torch.zeros(2, 3, 32, dtype=torch.bfloat16), torch.zeros(2, 32, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows_bmm: x and w must be bfloat16"):
        torch.ops.ascend_graph.rows_bmm(x, w.float())
    with pytest.raises(ValueError, match=r"rows_bmm: expected x \[X, M, K\] and w \[X, K, N\]; got \(2, 3, 32\), \(2, 16, 8\)"):
        torch.ops.ascend_graph.rows_bmm(x, w[:, :16])


def _fresh_process(script: str, cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ASCEND_GRAPH_KERNEL_CACHE": cache}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


@needs_kernel
def test_a_later_process_loads_the_built_kernel_without_compiling(tmp_path):
    """The first process builds the kernel into the cache directory; the next one loads it and
    runs no compiler (a guard on subprocess.run refuses a build)."""
    cache = str(tmp_path / "kernels")
    first = _fresh_process("from ascend_graph import kernels; assert kernels.available()", cache)
    assert first.returncode == 0, first.stderr[-2000:]
    built = os.listdir(cache)
    assert len(built) == 1 and built[0].startswith("expert_rows-") and built[0].endswith(".so")
    second = _fresh_process("""
import subprocess
run = subprocess.run
def guarded(cmd, *a, **k):
    assert "-shared" not in cmd, "the kernel was built again"
    return run(cmd, *a, **k)
subprocess.run = guarded
import torch
from ascend_graph import kernels
assert kernels.available()
x, w = torch.ones(3, 40, dtype=torch.bfloat16), torch.ones(7, 40, dtype=torch.bfloat16)
assert (torch.ops.ascend_graph.rows_mm(x, w) == 40).all()
""", cache)
    assert second.returncode == 0, second.stderr[-2000:]
    assert os.listdir(cache) == built


@needs_kernel
def test_an_unwritable_cache_directory_still_builds_the_kernel(tmp_path):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    done = _fresh_process("from ascend_graph import kernels; assert kernels.available()",
                          str(blocker / "kernels"))  # cannot be created: its parent is a file
    assert done.returncode == 0, done.stderr[-2000:]


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


# The kernel's builds: compiler flags, what ``expert_rows_available`` reports, the CPU flags it runs on.
BUILDS = {
    "avx2": (["-mavx2", "-mfma"], 256, {"avx2", "fma"}),
    "avx512-bf16": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mavx2", "-mfma"], 512,
                    {"avx512f", "avx512_bf16"}),  # a CPU with avx512_bf16 has bw, vl and dq
}


def _build_for(name: str, tmp_path):
    """``expert_rows.c`` built with ``BUILDS[name]``'s flags and bound (skip without a C compiler
    that takes them)."""
    import ctypes

    cc = kernels.compiler()
    if cc is None:
        pytest.skip("needs a C compiler")
    path = kernels.build._compile(cc, ["-O3", *BUILDS[name][0], "-shared", "-fPIC"], str(tmp_path / f"{name}.so"))
    if path is None:
        pytest.skip(f"the C compiler does not build for {name} ({' '.join(BUILDS[name][0])})")
    return kernels.build._bind(ctypes.CDLL(path))


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_each_build_runs_the_form_its_instructions_allow(name, tmp_path):
    """A build for AVX512-BF16 has the AVX-512 kernel, one for AVX2 and FMA the AVX2 kernel. Runs on
    any CPU: ``expert_rows_available`` returns a constant, no vector instruction. (A build whose
    AVX-512 test read ``#ifdef KERNEL`` before anything defined it ran the AVX2 form on every CPU.)"""
    assert _build_for(name, tmp_path).expert_rows_available() == BUILDS[name][1]


def test_the_native_build_is_the_widest_form_this_cpu_runs():
    from ascend_graph.runtime import machine

    if kernels.compiler() is None:
        pytest.skip("needs a C compiler")
    flags = set(machine()["cpu_flags"])
    widest = next((bits for _, bits, needs in sorted(BUILDS.values(), key=lambda b: -b[1]) if needs <= flags), 0)
    lib = kernels.build._library()
    assert (lib.expert_rows_available() if lib is not None else 0) == widest


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_each_build_computes_what_the_kernel_computes(name, tmp_path):
    """Each build as it runs on a CPU that has its instructions, whatever the native build here:
    ``expert_rows`` through the forms that build has (AVX-512: 1-4 rows tiles, 5-8 pairs, 9 and
    more wide; AVX2: its tiles at every count, part tiles of rows and of weight rows), with K
    tails, and ``kn_rows`` (interleaved panels, a partial column block, an odd K) within one
    rounding of float64, as the tests above hold the native build. So a machine with AVX512-BF16
    keeps the AVX2 form tested too."""
    from ascend_graph.runtime import machine

    if not BUILDS[name][2] <= set(machine()["cpu_flags"]):
        pytest.skip(f"needs an x86 CPU with {', '.join(sorted(BUILDS[name][2]))}")
    dll = _build_for(name, tmp_path)
    gen = torch.Generator().manual_seed(3)
    for n, k in [(300, 2048), (125, 80), (9, 33), (7, 47)]:
        counts = torch.tensor([1, 3, 0, 5, 8, 12, 40])
        ends = counts.cumsum(0).to(torch.int32)
        w = torch.randn(len(counts), n, k, generator=gen).to(torch.bfloat16)
        x = torch.randn(int(ends[-1]), k, generator=gen).to(torch.bfloat16)
        out = torch.full((x.shape[0], n), float("nan"), dtype=torch.bfloat16)
        assert dll.expert_rows(x.data_ptr(), w.data_ptr(), ends.data_ptr(), out.data_ptr(), len(counts), n, k, 1) == 0
        _assert_one_rounding(out, _oracle(x, w, ends))
    for e, rows, k, n in [(3, 5, 65, 80), (2, 16, 512, 512)]:
        x = torch.randn(e, rows, k, generator=gen).to(torch.bfloat16)
        w = torch.randn(e, k, n, generator=gen).to(torch.bfloat16)
        out = torch.full((e, rows, n), float("nan"), dtype=torch.bfloat16)
        assert dll.kn_rows(x.data_ptr(), w.data_ptr(), k * n, out.data_ptr(), e, rows, k, n, 1) == 0
        _assert_one_rounding(out, x.double() @ w.double())
