"""The Triton kernels behind ``ascend_graph::triton_decode_attention`` (``triton_attention.py``):
flash decoding over a paged cache, each row's live tokens only. This module imports triton, so it
is imported only when the op first runs; with ``TRITON_INTERPRET=1`` set before that, the kernels
run in Triton's interpreter (CPU tensors, numpy).

Shape legend: B rows, Hq query heads, Hk kv heads, G = Hq / Hk query heads per kv head, N blocks,
S block size, W block-table width, Dk / Dv key / value width, R MLA's rope width, P splits of a row.

``decode_partial`` runs one program per (row, BLOCK_H query heads of one kv head, split): the
split's share of the row's ``context_lens[b]`` tokens (a bound read in the kernel, so a captured
graph's shapes stay those of the full-width table), BLOCK_N tokens a step, each token's block
looked up in the table. Scores (``q . k`` plus ``q_rope . r``) and an online softmax in float32,
base 2; the values by the same tile when k and v are one tensor (MLA's ``kv_c``: read once).
With one split it writes the output; with more, each split's normalised output and log-sum-exp,
which ``decode_merge`` (one program per row and query head) weighs into the output. A row of
context 0 has no tokens in any split: its output is zeros and it reads no block.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_rows(cache, offsets, live, width, BLOCK_D: tl.constexpr):
    """``[BLOCK_N, BLOCK_D]`` rows of one cache element at token ``offsets``; zeros past ``width``
    and for tokens not ``live`` (never read)."""
    d = tl.arange(0, BLOCK_D)
    return tl.load(cache + offsets[:, None] + d[None, :], mask=live[:, None] & (d[None, :] < width), other=0.0)


@triton.jit
def _load_query(q, row, heads, head_ok, width, BLOCK_D: tl.constexpr):
    """``[BLOCK_H, BLOCK_D]`` of ``q`` (row offset ``row``, head offsets ``heads``); zeros outside."""
    d = tl.arange(0, BLOCK_D)
    return tl.load(q + row + heads[:, None] + d[None, :], mask=head_ok[:, None] & (d[None, :] < width), other=0.0)


@triton.jit
def _dot(a, b, F32: tl.constexpr):
    """``a @ b``, float32 sums; ``F32`` casts the operands first (for the interpreter of triton 3.7,
    whose ``tl.dot`` multiplies bfloat16 operands' bit patterns as integers)."""
    if F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def decode_partial(q, q_rope, k_cache, rope_cache, v_cache, tables, ctx_lens, out, part_out, part_lse,
                   scale_log2, stride_qb, stride_qh, stride_rb, stride_rh, stride_kn, stride_ks, stride_kh,
                   stride_pn, stride_ps, stride_ph, stride_vn, stride_vs, stride_vh, stride_tb, stride_ob, stride_oh,
                   slots, block_size, HQ, G, DK, R, DV,
                   HEAD_PROGRAMS: tl.constexpr, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
                   HAS_ROPE: tl.constexpr, SHARED_KV: tl.constexpr, DOT_F32: tl.constexpr):
    """One split of one row for BLOCK_H query heads of one kv head: its output, or its partial."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_PROGRAMS
    g = (tl.program_id(1) % HEAD_PROGRAMS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = g < G
    heads = kv_head * G + g  # [BLOCK_H] query heads
    split = tl.program_id(2)
    # the row's tokens, clamped to the table (a bad length cannot read past it), cut into SPLITS
    # chunks of whole BLOCK_N tiles: chunk `split` is [start, end), empty for short rows
    ctx = tl.minimum(tl.maximum(tl.load(ctx_lens + b).to(tl.int32), 0), slots)
    chunk = tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, ctx)

    qv = _load_query(q, b * stride_qb, heads * stride_qh, head_ok, DK, BLOCK_DK)  # [BLOCK_H, BLOCK_DK]
    if HAS_ROPE:
        qr = _load_query(q_rope, b * stride_rb, heads * stride_rh, head_ok, R, BLOCK_R)  # [BLOCK_H, BLOCK_R]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the base-2 scores
    l = tl.zeros([BLOCK_H], tl.float32)  # running sum of their exponentials
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        live = t < end
        block = tl.load(tables + b * stride_tb + t // block_size, mask=live, other=0).to(tl.int64)  # [BLOCK_N]
        row = (t % block_size).to(tl.int64)
        kt = _load_rows(k_cache, block * stride_kn + row * stride_ks + kv_head * stride_kh, live, DK, BLOCK_DK)
        s = _dot(qv, tl.trans(kt), DOT_F32)  # [BLOCK_H, BLOCK_N]
        if HAS_ROPE:
            rt = _load_rows(rope_cache, block * stride_pn + row * stride_ps + kv_head * stride_ph, live, R, BLOCK_R)
            s += _dot(qr, tl.trans(rt), DOT_F32)
        s = tl.where(live[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile here has a live token
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        if SHARED_KV:
            vt = kt
        else:
            vt = _load_rows(v_cache, block * stride_vn + row * stride_vs + kv_head * stride_vh, live, DV, BLOCK_DV)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, DOT_F32)
        m = m_new

    dv = tl.arange(0, BLOCK_DV)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]  # zeros where the split had no token
    store = head_ok[:, None] & (dv[None, :] < DV)
    if SPLITS == 1:
        tl.store(out + b * stride_ob + heads[:, None] * stride_oh + dv[None, :], o.to(out.dtype.element_ty), mask=store)
    else:
        part = (b * HQ + heads) * SPLITS + split  # [BLOCK_H] indices into [B, Hq, P]
        tl.store(part_out + part[:, None] * DV + dv[None, :], o, mask=store)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))  # base 2; -inf: no token
        tl.store(part_lse + part, lse, mask=head_ok)


@triton.jit
def decode_merge(part_out, part_lse, out, stride_ob, stride_oh, HQ, DV,
                 SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """``out[b, h]``: the splits' outputs weighed by their share of the softmax (their base-2
    log-sum-exp); zeros where no split had a token."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    part = (b * HQ + h) * SPLITS + s  # [BLOCK_S]
    lse = tl.load(part_lse + part, mask=s < SPLITS, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # [BLOCK_S], 0 for empty splits
    o = tl.load(part_out + part[:, None] * DV + dv[None, :], mask=(s[:, None] < SPLITS) & (dv[None, :] < DV),
                other=0.0)  # [BLOCK_S, BLOCK_DV]
    total = tl.sum(w, 0)
    res = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out + b * stride_ob + h * stride_oh + dv, res.to(out.dtype.element_ty), mask=dv < DV)
