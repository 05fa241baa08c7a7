"""The ``ascend_graph::*`` kernel ops: their schemas and contracts, their fake implementations
(shapes for tracing), defined here; their CPU kernels are C++ (``csrc/ops.cpp``), registered with
the dispatcher when the build loads (``build._library()``), so a compiled step calls them without
entering Python. Each checks its arguments first: a ValueError naming the op, the argument and
what was expected, before anything runs. CPU only; call them where ``build.available()``.

- ``rows_mm(x [M, K], w [N, K]) -> [M, N]``: ``F.linear(x, w)`` over the weight as stored,
  bfloat16 or float32. The compiled step runs it for the rows ``decode_matmul.runs_rows_mm`` names
  (graph mode only; eager keeps aten's).
- ``rows_bmm(x [X, M, K], w [X, K, N]) -> [X, M, N]``: ``torch.bmm`` over matrices stored with
  the reduced dimension first (``w[e]`` row-major ``[K, N]``; the entries may lie apart, as per-head
  slices of one weight do), bfloat16. The compiled MLA decode step runs it for the attention's
  probabilities times the latent cache rows.
- ``expert_rows_mm(x [P, K], w [X, N, K], ends [X]) -> [P, N]``: rows sorted by expert, each
  times its expert's weight transposed, ``ends`` (int32 or int64) the end of each expert's rows
  (``ends[-1] <= P``), as ``torch._grouped_mm(x, w.transpose(1, 2), offs=ends)``; bfloat16 or
  float32. Rows past ``ends[-1]`` belong to no expert and come out zero (``torch._grouped_mm``
  leaves them unwritten): an expert-parallel rank sorts the pairs that are not its own there. Eager and compiled steps run it for the MoE (``RoutedExperts.sorted_by_expert``), the
  compiled MLA decode step also with one "expert" per sequence or head.
- ``decode_attention(q, q_rope, k_cache, rope_cache, v_cache, block_tables, context_lens, scale)``:
  ``kernels/attention.py``.

The products sum in float32 and round each bfloat16 output once (``docs/cpu-kernels.md``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import build

# Each op's schema (``csrc/ops.cpp`` registers a CPU kernel for each name).
SCHEMAS = {
    "rows_mm": "(Tensor x, Tensor w) -> Tensor",
    "rows_bmm": "(Tensor x, Tensor w) -> Tensor",
    "expert_rows_mm": "(Tensor x, Tensor w, Tensor ends) -> Tensor",
    "decode_attention": "(Tensor q, Tensor? q_rope, Tensor k_cache, Tensor? rope_cache, Tensor v_cache, "
                        "Tensor block_tables, Tensor context_lens, float scale) -> Tensor",
}


def check_shapes(name: str, ok: bool, expected: str, *tensors: Tensor) -> None:
    """ValueError ``"{name}: expected {expected}; got <the shapes>"`` unless ``ok``."""
    if not ok:
        raise ValueError(f"{name}: expected {expected}; got {', '.join(str(tuple(t.shape)) for t in tensors)}")


def _before_the_build(name: str):
    """The op's kernel for any tensors while its CPU kernel is not registered: loads the build
    (which registers it) and calls the op again; a ValueError for tensors off the CPU, a
    RuntimeError where the kernels do not run here."""
    def kernel(*args):
        devices = {a.device.type for a in args if isinstance(a, Tensor)}
        if devices != {"cpu"}:
            raise ValueError(f"{name}: its tensors must be CPU tensors, got {sorted(devices)}")
        if not build.available():
            raise RuntimeError(f"ascend_graph::{name}: the native kernels do not run here (kernels.available() "
                               "is False: no C/C++ compiler, no AVX2, or ASCEND_GRAPH_EXPERT_KERNEL=0)")
        return getattr(torch.ops.ascend_graph, name).default(*args)
    return kernel


def _define() -> None:
    """Each op of ``SCHEMAS``, with ``_before_the_build``'s kernel for any device."""
    for name, schema in SCHEMAS.items():
        torch.library.define(f"ascend_graph::{name}", schema)
        torch.library.impl(f"ascend_graph::{name}", "CompositeExplicitAutograd")(_before_the_build(name))


_define()


@torch.library.register_fake("ascend_graph::rows_mm")
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("ascend_graph::rows_bmm")
def _(x: Tensor, w: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], x.shape[1], w.shape[2])


@torch.library.register_fake("ascend_graph::expert_rows_mm")
def _(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


@torch.library.register_fake("ascend_graph::decode_attention")
def _(q, q_rope, k_cache, rope_cache, v_cache, block_tables, context_lens, scale):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
