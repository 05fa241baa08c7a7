"""Compiled-only rewrite: the matmuls of a CPU decode step as fused reductions or the project's
kernel (``DecodeMatmulPass``); eager runs aten's matmuls, parity compares the two."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from ... import kernels, runtime

# Where one-row matmuls become reductions (CPU only: elsewhere aten's GEMV is kept).
SINGLE_ROW_MATMUL_AS_REDUCTION = {"cpu": True, "cuda": False, "npu": False}
# The most rows a bfloat16 or float32 matmul takes the kernel's ``rows_mm`` for (decode batches stop here).
ROWS_MM_MAX = 64
# The fewest rows a float32 matmul takes ``rows_mm`` for: aten's float32 GEMV streams slower (docs/cpu-kernels.md).
FLOAT32_ROWS_MM_MIN = 1
# Batched bf16 products take the kernel where each entry has at most ``rows max`` rows and a
# matrix of at least ``min elements`` elements, per the kernel's build (docs/cpu-kernels.md).
BATCHED_LIMITS = {"AVX512-BF16": (32, 1 << 17), "AVX2": (ROWS_MM_MAX, 1 << 13)}
BATCHED_ROWS_MAX, BATCHED_MIN_ELEMENTS = BATCHED_LIMITS["AVX512-BF16"]

# the kernels' Python side (their ops' schemas, the build's choices): a change to any of it is a new pass
KERNEL_FILES = tuple(m.__file__ for m in (kernels.build, kernels.ops, kernels.attention))


def batched_limits() -> tuple[int, int]:
    """``(rows max, min elements)`` of ``BATCHED_LIMITS`` for the kernel's build here (AVX512-BF16's
    where it does not run)."""
    return BATCHED_LIMITS.get(kernels.isa(), (BATCHED_ROWS_MAX, BATCHED_MIN_ELEMENTS))


class DecodeMatmulPass(CustomGraphPass):
    """Post-grad pass over the matmuls of a CPU decode step (graph mode only; eager keeps aten):

    - ``mm``/``addmm``/``bmm`` with one row, bfloat16/float16 -> a fused float32 reduction that
      streams the weight once and folds an indexing that produced it (gathered experts) into the
      same loop; a reduction longer than ``runtime.LONG_REDUCTION`` is split into equal chunks.
    - ``mm``/``addmm`` of ``min_rows`` (2; 1 with ``one_row_kernel``) to ``ROWS_MM_MAX`` rows,
      bfloat16, or ``FLOAT32_ROWS_MM_MIN`` to ``ROWS_MM_MAX`` rows float32, over a row-major
      ``[N, K]`` weight transposed -> ``ascend_graph::rows_mm``; a bias or fused residual is added
      after the product is rounded, as eager's separate add is.
    - ``bmm`` of batch 1 with more rows -> ``mm`` of the two matrices (aten's CPU ``bmm`` copies an
      operand whose size-1 batch has a zero stride).
    - ``bmm(x [B, M, K], w [B, K, N])`` bfloat16 with 2 <= M <= ``batched_rows_max`` and
      ``K * N >= batched_min_elements`` -> ``expert_rows_mm`` (each ``w[b]`` a row-major ``[N, K]``
      transposed) or ``rows_bmm`` (each ``w[b]`` a row-major ``[K, N]``).
    Every rewrite sums in float32 and rounds each output once, as aten's product does. The
    choices and their measurements: docs/cpu-kernels.md ("The compiled step's matmuls"). The
    keyword arguments turning a rewrite off exist for measuring it by hand.
    """

    def __init__(self, split_long_reductions: bool = True, batch_one_bmm_as_mm: bool = True,
                 few_rows_kernel: bool = True, batched_rows_kernel: bool = True,
                 batched_rows_max: Optional[int] = None, batched_min_elements: Optional[int] = None,
                 one_row_kernel: Optional[bool] = None) -> None:
        self._one_row_kernel = one_row_kernel  # None: kernels.ONE_ROW_KERNEL's choice for the build here
        self.split_long_reductions = split_long_reductions  # False: only for measuring the split
        self.batch_one_bmm_as_mm = batch_one_bmm_as_mm  # False: only for measuring it
        self.few_rows_kernel = few_rows_kernel
        self.batched_rows_kernel = few_rows_kernel and batched_rows_kernel  # False: only for measuring it
        # None: batched_limits(), for the kernel's build here; tests: smaller models
        self._batched_limits = (batched_rows_max, batched_min_elements)

    def __call__(self, graph: torch.fx.Graph) -> None:
        import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)

        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default,
                                                                  aten.bmm.default):
                continue
            bias, x, w = (node.args if node.target is aten.addmm.default else (None, *node.args))[:3]
            if node.kwargs:
                continue
            kernel_rows = (self.few_rows_kernel and node.target is not aten.bmm.default
                           and self._few_rows(x, w, 1 if self.one_row_kernel else 2)
                           and (bias is None or bias.meta["val"].dtype == x.meta["val"].dtype))
            if not kernel_rows and self._applies(x, w):
                with graph.inserting_before(node):
                    out = self._reduction(graph, x, w, node.meta["val"].dtype, bias)
            elif self.batch_one_bmm_as_mm and node.target is aten.bmm.default and self._batch_of_one(x, w):
                with graph.inserting_before(node):
                    out = self._as_mm(graph, x, w)
            elif self.batched_rows_kernel and node.target is aten.bmm.default and self._few_rows_batched(x, w):
                with graph.inserting_before(node):
                    out = self._as_expert_rows_mm(graph, x, w)
            elif self.batched_rows_kernel and node.target is aten.bmm.default and self._few_rows_kn(x, w):
                with graph.inserting_before(node):
                    out = _call(graph, torch.ops.ascend_graph.rows_bmm.default, x, w)
            elif kernel_rows:
                with graph.inserting_before(node):
                    out = _call(graph, torch.ops.ascend_graph.rows_mm.default, x,
                                _call(graph, aten.permute.default, w, [1, 0]))
                    if bias is not None:  # Inductor's fusion of a residual add, or a linear's bias
                        out = _call(graph, aten.add.Tensor, out, bias)
            else:
                continue
            node.replace_all_uses_with(out)
            graph.erase_node(node)

    @staticmethod
    def _batch_of_one(x, w) -> bool:
        vals = _fake_values(x, w)
        return (vals is not None and all(v.device.type == "cpu" for v in vals)
                and isinstance(vals[0].shape[0], int) and vals[0].shape[0] == 1)

    @staticmethod
    def _as_mm(graph: torch.fx.Graph, x, w) -> torch.fx.Node:
        """``bmm(x [1, M, K], w [1, K, N])`` as ``mm`` of the two matrices, viewed back to ``[1, M, N]``."""
        aten = torch.ops.aten
        x2 = _call(graph, aten.squeeze.dim, x, 0)  # [M, K]
        w2 = _call(graph, aten.squeeze.dim, w, 0)  # [K, N]
        return _call(graph, aten.unsqueeze.default, _call(graph, aten.mm.default, x2, w2), 0)  # [1, M, N]

    def _reduction(self, graph: torch.fx.Graph, x, w, dtype: torch.dtype, bias) -> torch.fx.Node:
        aten, prims = torch.ops.aten, torch.ops.prims
        f32 = lambda n: _call(graph, prims.convert_element_type.default, n, torch.float32)  # noqa: E731
        k_dim = x.meta["val"].dim() - 2  # the one-row dim of x = the reduced dim of w: 0 (mm), 1 (bmm)
        chunks = runtime.reduction_chunks(x.meta["val"].shape[-1]) if k_dim == 0 and self.split_long_reductions else 1
        if chunks > 1:
            k = x.meta["val"].shape[-1]
            n = w.meta["val"].shape[-1]
            xs = _call(graph, prims.inductor_force_stride_order.default, x, list(x.meta["val"].stride()))
            xc = _call(graph, aten.view.default, f32(xs), [chunks, k // chunks, 1])  # [C, L, 1]
            wc = _call(graph, aten.view.default, f32(w), [chunks, k // chunks, n])  # [C, L, N]
            partial = _call(graph, aten.sum.dim_IntList, _call(graph, aten.mul.Tensor, xc, wc), [1])  # [C, N]
            out = _call(graph, aten.sum.dim_IntList, partial, [0], True)  # [1, N]
            if bias is not None:
                out = _call(graph, aten.add.Tensor, out, f32(bias))
            return _call(graph, prims.convert_element_type.default, out, dtype)
        # x is stored once before the reduction. Left as a pointwise, Inductor inlines whatever
        # produced x (the final RMSNorm before the LM head: 3 more loads and the normalisation)
        # into the reduction loop, recomputing it for each of the N output columns.
        xf = f32(x)
        xf = _call(graph, prims.inductor_force_stride_order.default, xf, list(xf.meta["val"].stride()))
        xt = _call(graph, aten.unsqueeze.default, _call(graph, aten.squeeze.dim, xf, k_dim), -1)  # [.., K, 1]
        out = _call(graph, aten.sum.dim_IntList, _call(graph, aten.mul.Tensor, xt, f32(w)), [k_dim], True)
        if bias is not None:
            out = _call(graph, aten.add.Tensor, out, f32(bias))
        return _call(graph, prims.convert_element_type.default, out, dtype)

    @staticmethod
    def _applies(x, w) -> bool:
        vals = _fake_values(x, w)
        if vals is None:
            return False
        xv, wv = vals
        rows = xv.shape[-2]
        return (xv.device.type == "cpu" and xv.dtype in (torch.bfloat16, torch.float16) and wv.dtype == xv.dtype
                and isinstance(rows, int) and rows == 1)

    @property
    def one_row_kernel(self) -> bool:
        """Whether one-row bfloat16 products over a row-major weight run ``rows_mm`` (else reductions)."""
        choice = self._one_row_kernel
        if choice is None:
            choice = kernels.one_row_kernel()
        return self.few_rows_kernel and choice and kernels.available()

    @property
    def batched_rows_max(self) -> int:
        return self._batched_limits[0] or batched_limits()[0]

    @property
    def batched_min_elements(self) -> int:
        return self._batched_limits[1] or batched_limits()[1]

    @staticmethod
    def _few_rows(x, w, min_rows: int) -> bool:
        vals = _fake_values(x, w)
        return vals is not None and vals[1].dim() == 2 and runs_rows_mm(vals[0], vals[1].t(), min_rows)

    def _batched_form(self, x, w) -> Optional[str]:
        """``batched_rows_form`` of the fake values of ``bmm(x, w)``, with this pass's limits."""
        vals = _fake_values(x, w)
        return None if vals is None else batched_rows_form(*vals, self.batched_rows_max, self.batched_min_elements)

    def _few_rows_batched(self, x, w) -> bool:
        """Each ``w[b]`` a row-major ``[N, K]`` transposed: ``expert_rows_mm``."""
        return self._batched_form(x, w) == "expert_rows_mm"

    def _few_rows_kn(self, x, w) -> bool:
        """Each ``w[b]`` a row-major ``[K, N]`` (the entries may lie apart): ``rows_bmm``."""
        return self._batched_form(x, w) == "rows_bmm"

    @staticmethod
    def _as_expert_rows_mm(graph: torch.fx.Graph, x, w) -> torch.fx.Node:
        """``bmm(x [X, M, K], w [X, K, N])``, ``w`` a contiguous ``[X, N, K]`` transposed, as
        ``expert_rows_mm`` with one "expert" per batch entry, each of M rows."""
        aten = torch.ops.aten
        xs, m, k = x.meta["val"].shape
        n = w.meta["val"].shape[2]
        if not x.meta["val"].is_contiguous():
            x = _call(graph, aten.clone.default, x, memory_format=torch.contiguous_format)
        ends = _call(graph, aten.arange.start_step, m, (xs + 1) * m, m, dtype=torch.int32,
                     device=x.meta["val"].device)  # [X]: each entry's M rows end there
        out = _call(graph, torch.ops.ascend_graph.expert_rows_mm.default,
                    _call(graph, aten.view.default, x, [xs * m, k]),
                    _call(graph, aten.permute.default, w, [0, 2, 1]), ends)  # [X * M, N]
        return _call(graph, aten.view.default, out, [xs, m, n])

    def uuid(self) -> Optional[Any]:
        available = int(self.few_rows_kernel and kernels.available())
        return (get_hash_for_files((__file__, runtime.__file__, *KERNEL_FILES)).hex()
                + f"-split{int(self.split_long_reductions)}-bmm1{int(self.batch_one_bmm_as_mm)}-rows{available}"
                + f"-batched{int(self.batched_rows_kernel)}-{self.batched_rows_max}-{self.batched_min_elements}"
                + f"-one{int(self.one_row_kernel)}")


def runs_rows_mm(x: torch.Tensor, w: torch.Tensor, min_rows: int = 2) -> bool:
    """Whether ``DecodeMatmulPass`` has the compiled step compute ``x @ w.T`` (``x [M, K]``,
    ``w [N, K]``; real or fake tensors) with ``rows_mm``: both bfloat16 on CPU with ``min_rows`` <= M
    <= ``ROWS_MM_MAX`` (1 with ``DecodeMatmulPass.one_row_kernel``), or both float32 with
    ``FLOAT32_ROWS_MM_MIN`` <= M <= ``ROWS_MM_MAX``; ``w`` contiguous (a row-major weight), and the
    kernel runs here."""
    if (x.dim() != 2 or w.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32) or w.dtype != x.dtype
            or x.device.type != "cpu" or w.device.type != "cpu"):
        return False
    if x.dtype == torch.float32:
        min_rows = FLOAT32_ROWS_MM_MIN
    lo, hi = row_bounds(x.shape[0])
    return min_rows <= lo and hi <= ROWS_MM_MAX and w.is_contiguous() and kernels.available()


def row_bounds(rows) -> tuple[float, float]:
    """The least and most a row count can be: itself where static; a symbolic one's range (a
    compile group's dynamic batch, ``runner.groups``) from its shape environment, so a graph
    shared by batches 2..8 takes the kernel exactly where each of its sizes would."""
    if isinstance(rows, int):
        return rows, rows
    node = getattr(rows, "node", None)
    if node is None or getattr(node, "shape_env", None) is None:
        return float("inf"), float("-inf")  # unknown: fits no range
    r = node.shape_env.bound_sympy(node.expr)
    return float(r.lower), float(r.upper)


def batched_rows_form(x: torch.Tensor, w: torch.Tensor, rows_max: Optional[int] = None,
                      min_elements: Optional[int] = None) -> Optional[str]:
    """The kernel's op that ``DecodeMatmulPass`` has the compiled step compute ``bmm(x [B, M, K],
    w [B, K, N])`` with (real or fake tensors), or None (aten's ``bmm``): static shapes but M (whose
    range ``row_bounds`` reads), bfloat16 on CPU, 2 <= M <= ``rows_max``, K * N at least ``min_elements`` (None: ``batched_limits()``),
    the kernel built here; then
    ``"expert_rows_mm"`` where each ``w[b]`` is a row-major ``[N, K]`` transposed, ``"rows_bmm"``
    where it is a row-major ``[K, N]`` (the entries may lie apart)."""
    if x.dim() != 3 or w.dim() != 3:
        return None
    rows_max, min_elements = rows_max or batched_limits()[0], min_elements or batched_limits()[1]
    lo, hi = row_bounds(x.shape[1])
    fits = (all(isinstance(d, int) for d in (x.shape[0], x.shape[2], *w.shape))
            and all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for v in (x, w))
            and 2 <= lo and hi <= rows_max and w.shape[1] * w.shape[2] >= min_elements
            and kernels.available())
    if not fits:
        return None
    if w.transpose(1, 2).is_contiguous():
        return "expert_rows_mm"
    return "rows_bmm" if w.stride(2) == 1 and w.stride(1) == w.shape[2] else None


def _fake_values(*args) -> Optional[list[torch.Tensor]]:
    """The fake tensors (``meta["val"]``) of graph nodes ``args``, or None unless all have one."""
    vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in args]
    return vals if all(isinstance(v, torch.Tensor) for v in vals) else None


def _call(graph: torch.fx.Graph, target, *args, **kwargs) -> torch.fx.Node:
    """A new node of ``target(*args, **kwargs)`` with its fake-tensor ``meta["val"]`` filled in,
    under the fake mode of its tensor arguments (without any: the graph's)."""
    node = graph.call_function(target, tuple(args), kwargs)
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    fake_mode = next((v.fake_mode for v in vals if isinstance(v, torch.Tensor)), None)
    if fake_mode is None:  # no tensor among the arguments (an arange): the graph's fake mode
        fake_mode = next(n.meta["val"].fake_mode for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor))
    with fake_mode:
        node.meta["val"] = target(*vals, **kwargs)
    return node
