"""``ascend_graph::triton_decode_attention``: ``ascend_graph::decode_attention``'s signature and
semantics (``attention.py``) on CUDA, in Triton (``triton_decode.py``): each row reads its live
tokens only (``context_lens``, a loop bound read in the kernel), so a captured graph keeps one call
over the full-width block table, with no host sync, and the step costs what the live context costs.

Shape legend: B rows, Hq query heads, Hk kv heads (Hq a multiple), N blocks, S block size, W
block-table width, Dk / Dv key / value width, R MLA's rope width, P splits of a row.

MLA (absorbed) passes ``q = q_latent [B, H, C]``, ``q_rope = q_pe [B, H, R]``, ``k_cache =
v_cache = kv_c [N, S, 1, C]`` (the same tensor: each tile is read once, for scores and values),
``rope_cache = k_pe [N, S, 1, R]``; standard attention passes ``q [B, Hq, D]``, ``k [N, S, Hk,
D]``, ``v [N, S, Hk, D]`` and no rope.

Work split (flash decoding): one program per row, kv head and ``BLOCK_H`` of its query heads; where
those are fewer than twice the GPU's multiprocessors (small batches), each row's tokens are split
over ``P`` programs (at most ``MAX_SPLITS``, one tile each at least) and a second kernel merges
their partial softmax. ``P`` follows the shapes only (rows, heads, table width), so a captured
size always launches the same grids; the tokens of each split follow the row's context in the kernel.

triton is imported when the op first runs, never at import: ``available()`` says whether it can.
Under Triton's interpreter (``TRITON_INTERPRET=1`` set before the first call) the op takes CPU
tensors, which is how it is tested without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Optional

import torch
from torch import Tensor

from .attention import check_layout, check_values

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_H = 16  # query heads per program: tl.dot's least M; a GQA group below it is padded
MAX_SPLITS = 32
INTERPRETER_PROGRAMS = 8  # "multiprocessors" under the interpreter: small batches there split too


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether triton imports here (the kernels are compiled at their first call, not now). An
    installed triton that fails to import is a RuntimeWarning naming the error."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    except (OSError, RuntimeError) as e:
        warnings.warn(f"triton is installed but does not import ({type(e).__name__}: {e}); the Triton decode "
                      "attention is not used", RuntimeWarning, stacklevel=2)
        return False
    return True


@torch.library.custom_op("ascend_graph::triton_decode_attention", mutates_args=())
def triton_decode_attention(q: Tensor, q_rope: Optional[Tensor], k_cache: Tensor, rope_cache: Optional[Tensor],
                            v_cache: Tensor, block_tables: Tensor, context_lens: Tensor, scale: float) -> Tensor:
    """``out[b, h] = sum_t softmax_t(scale * (q[b, h] . k_t + q_rope[b, h] . r_t)) * v_t`` over the
    first ``context_lens[b]`` tokens of row b (token t in block ``block_tables[b, t // S]``, row ``t
    % S``, kv head ``h // (Hq / Hk)``) -> ``[B, Hq, Dv]`` in q's dtype. A row of context 0 reads
    nothing and gives zeros. Float32 sums and softmax, one rounding of the output. CUDA tensors
    (CPU ones under Triton's interpreter), float16, bfloat16 or float32 throughout; call only
    where ``available()``. Lengths and block ids are checked on CPU tensors only (on CUDA that
    would need a host sync); the kernel clamps each length to the table."""
    hk, g = _check("triton_decode_attention", q, q_rope, k_cache, rope_cache, v_cache, block_tables, context_lens)
    return run(q, q_rope, k_cache, rope_cache, v_cache, block_tables, context_lens, scale, hk, g)


@triton_decode_attention.register_fake
def _(q, q_rope, k_cache, rope_cache, v_cache, block_tables, context_lens, scale):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])


def num_splits(programs: int, slots: int, block_n: int, wanted: int) -> int:
    """How many programs share a row: enough that ``programs`` (rows x head programs) reach
    ``wanted``, at most ``MAX_SPLITS`` and at most one per ``block_n`` tile of the ``slots``."""
    return max(1, min(MAX_SPLITS, -(-slots // block_n), -(-wanted // programs)))


def run(q: Tensor, q_rope: Optional[Tensor], k_cache: Tensor, rope_cache: Optional[Tensor], v_cache: Tensor,
        block_tables: Tensor, context_lens: Tensor, scale: float, hk: int, g: int) -> Tensor:
    """The kernels (``triton_decode``) on checked arguments, ``hk`` kv heads of ``g`` query heads each."""
    from . import triton_decode

    q = q.contiguous()
    qr = q_rope.contiguous() if q_rope is not None else q  # q, r: placeholders the kernel never reads
    r = rope_cache if rope_cache is not None else k_cache
    tables, ctx = block_tables.contiguous(), context_lens.contiguous()
    b, hq, dk = q.shape
    dv, rw = v_cache.shape[-1], (q_rope.shape[-1] if q_rope is not None else 0)
    out = q.new_empty(b, hq, dv)
    if out.numel() == 0:
        return out
    shared = (k_cache.data_ptr() == v_cache.data_ptr() and k_cache.shape == v_cache.shape
              and k_cache.stride() == v_cache.stride())
    slots = tables.shape[1] * k_cache.shape[1]
    head_programs = -(-g // BLOCK_H)
    splits = num_splits(b * hk * head_programs, slots, block_tokens(dk, dv), _programs_wanted(q.device))
    constants = partial_constants(g, dk, rw, dv, splits, shared, q.dtype == torch.bfloat16 and interpreted())
    part_out = q.new_empty(b, hq, splits, dv, dtype=torch.float32) if splits > 1 else out  # out: unused
    part_lse = q.new_empty(b, hq, splits, dtype=torch.float32) if splits > 1 else out
    with _on(q.device):
        triton_decode.decode_partial[(b, hk * head_programs, splits)](
            q, qr, k_cache, r, v_cache, tables, ctx, out, part_out, part_lse, float(scale) * math.log2(math.e),
            *q.stride()[:2], *qr.stride()[:2], *k_cache.stride()[:3], *r.stride()[:3], *v_cache.stride()[:3],
            tables.stride(0), *out.stride()[:2], slots, k_cache.shape[1], hq, g, dk, rw, dv, **constants,
            num_warps=4, num_stages=2)
        if splits > 1:
            triton_decode.decode_merge[(b, hq)](part_out, part_lse, out, *out.stride()[:2], hq, dv,
                                                **merge_constants(dv, splits), num_warps=4)
    return out


def block_tokens(dk: int, dv: int) -> int:
    """Tokens a program takes per step (``BLOCK_N``): fewer for wide rows, whose tiles fill the registers."""
    return 32 if max(dk, dv) <= 128 else 16


def partial_constants(g: int, dk: int, rw: int, dv: int, splits: int, shared: bool, dot_f32: bool) -> dict:
    """``decode_partial``'s compile-time arguments for ``g`` query heads per kv head, widths ``dk``,
    ``rw`` (0: no rope) and ``dv``, ``splits`` per row, ``shared`` k and v, ``dot_f32`` (the interpreter's
    bfloat16)."""
    return dict(HEAD_PROGRAMS=-(-g // BLOCK_H), SPLITS=splits, BLOCK_H=BLOCK_H, BLOCK_N=block_tokens(dk, dv),
                BLOCK_DK=_tile(dk), BLOCK_R=_tile(rw), BLOCK_DV=_tile(dv), HAS_ROPE=rw > 0, SHARED_KV=shared,
                DOT_F32=dot_f32)


def merge_constants(dv: int, splits: int) -> dict:
    """``decode_merge``'s compile-time arguments."""
    return dict(SPLITS=splits, BLOCK_S=_tile(splits, 1), BLOCK_DV=_tile(dv))


def _tile(n: int, least: int = 16) -> int:
    """A tile width for ``n``: the next power of two, at least ``least`` (tl.dot's least K and N)."""
    return max(least, 1 << max(0, n - 1).bit_length())


def _programs_wanted(device: torch.device) -> int:
    if device.type == "cuda":
        return 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


def _on(device: torch.device) -> contextlib.AbstractContextManager:
    """The device Triton launches on: ``device`` itself where it is a GPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when they were defined)."""
    from triton.runtime.interpreter import InterpretedFunction

    from . import triton_decode

    return isinstance(triton_decode.decode_partial, InterpretedFunction)


def _check(name: str, q: Tensor, q_rope: Optional[Tensor], k: Tensor, r: Optional[Tensor], v: Tensor,
           block_tables: Tensor, context_lens: Tensor) -> tuple[int, int]:
    """``(Hk, Hq / Hk)``, or ValueError naming the argument that is off; nothing has run yet."""
    tensors = [t for t in (q, q_rope, k, r, v) if t is not None]
    devices = {t.device for t in (*tensors, block_tables, context_lens)}
    if q.dtype not in DTYPES or any(t.dtype != q.dtype for t in tensors) or len(devices) != 1:
        raise ValueError(f"{name}: q, q_rope, k_cache, rope_cache and v_cache must be of one dtype (float16, "
                         f"bfloat16 or float32) and every argument on one device; got "
                         f"{[str(t.dtype) for t in tensors]} on {sorted(str(d) for d in devices)}")
    if q.device.type != "cuda" and not (q.device.type == "cpu" and interpreted()):
        raise ValueError(f"{name}: expected CUDA tensors (CPU ones only under Triton's interpreter, "
                         f"TRITON_INTERPRET=1 before the first call); got {q.device}")
    heads = check_layout(name, q, q_rope, k, r, v, block_tables, context_lens)
    if q.device.type == "cpu":  # on CUDA the ranges would cost a device sync: the kernel clamps lengths instead
        check_values(name, k, block_tables, context_lens)
    return heads
