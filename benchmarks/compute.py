"""The compute limit next to the bandwidth limit: FLOPs of a V2-Lite-slice decode step and this
machine's bfloat16 matmul rate, for the batches where reading the weights is not the bound.

A decode step of B rows multiplies every dense weight by B rows and each routed expert's weights
by the rows that chose it (B * K row-expert pairs in all); absorbed MLA adds per row and layer
``2 H (Dn C + T (C + R) + T C + C Dv)``. The rate is the median of a ``[B, 2048] x [2048, 10944]``
bfloat16 matmul (the dense MLP's shape) timed interleaved with the copy probe, with aten's
weights, with weights pre-packed for oneDNN (what ``inductor.freezing_min_batch`` compiles to),
and, at the batches where the compiled step runs it, with the project's kernel (``rows_mm``).
Above every matmul rate: the core's peak multiply-add rate (``benchmarks/peak.py``).

``StepMatmuls`` is the tighter floor, timed in the decode rounds themselves: the step's own
matmuls (all but the routed experts'), recorded from an eager step and replayed alone.
"""

from __future__ import annotations

import functools
from typing import Callable
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ascend_graph.attention import paging
from ascend_graph.moe import RoutedExperts
from benchmarks import peak
from benchmarks.common import interleaved_medians
from benchmarks.models import v2_lite_slice
from benchmarks.roofline import CopyProbe


def step_flops(batch: int, context: int) -> float:
    """Multiply-add FLOPs (2 per MAC) of one decode step of the V2-Lite slice."""
    c = v2_lite_slice()
    e, h = c.hidden_size, c.num_attention_heads
    attn_w = e * h * c.qk_head_dim + e * (c.kv_lora_rank + c.qk_rope_head_dim) + h * c.v_head_dim * e
    absorbed = 2 * h * (c.qk_nope_head_dim * c.kv_lora_rank + context * (2 * c.kv_lora_rank + c.qk_rope_head_dim)
                        + c.kv_lora_rank * c.v_head_dim)
    dense_mlp = 3 * e * c.intermediate_size
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    shared = 3 * e * c.moe_intermediate_size * c.n_shared_experts + e * c.n_routed_experts
    routed_pairs = c.num_experts_per_tok * 3 * e * c.moe_intermediate_size
    per_row = (c.num_hidden_layers * attn_w + c.first_k_dense_replace * dense_mlp
               + moe_layers * (shared + routed_pairs) + e * c.vocab_size)
    return 2.0 * batch * per_row + batch * c.num_hidden_layers * absorbed


_aten = torch.ops.aten
MATMUL_OPS = frozenset({_aten.linear.default, _aten.einsum.default, _aten.matmul.default, _aten.mm.default,
                        _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default, _aten._grouped_mm.default,
                        torch.ops.ascend_graph.grouped_mm.default, torch.ops.ascend_graph.expert_rows_mm.default})


class _MatmulRecorder(TorchDispatchMode):
    """Keeps every matmul call (op, args, kwargs) made while active; composite ops such as
    ``linear`` and ``einsum`` are seen whole, their inner ``mm``/``bmm`` are not seen again."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in MATMUL_OPS:
            self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


class StepMatmuls:
    """The matmuls of one eager decode step except the routed experts', replayed as aten runs them.

    Recorded once from ``run_step`` (an eager step, its attention through the reference backend)
    with their arguments: the model's own weights and that step's activations and gathered KV, each product as the model writes it and the
    compiled step sees it (MLA's cache products in bfloat16, not eager's float32 form on a CPU
    without native bfloat16 matmuls: ``attention.mla.product_rows``). Attention's projections
    and absorbed products, the dense MLP, the shared experts, the router and the LM head. Called,
    the replay is what these products cost with aten's matmul; ``as_compiled()`` runs them as the
    compiled step does from 2 rows on (bfloat16 linears of up to ``ROWS_MM_MAX`` rows in ``rows_mm``, MLA decode's
    attention products in the kernel's batched forms, the rest in the same aten kernels; at 1 row
    the decode-matmul pass makes ``rows_mm`` calls of them, or generated reductions where
    ``kernels.ONE_ROW_KERNEL`` says so). The
    routed experts are left out because the compiled step runs them in forms of its own
    (``RoutedExperts.decode``).
    """

    def __init__(self, model: torch.nn.Module, run_step) -> None:
        experts = {p.untyped_storage().data_ptr() for m in model.modules() if isinstance(m, RoutedExperts)
                   for p in m.parameters()}
        recorder = _MatmulRecorder()
        layers = list(model.attention_layers())  # recorded through the reference attention: aten's products
        requests = [layer._backend_request for layer in layers]
        try:
            for layer in layers:
                layer.use_backend("reference")
            with recorder, mock.patch.object(paging, "aten_bf16_emulated", lambda: False):
                run_step()
        finally:
            for layer, request in zip(layers, requests):
                layer.use_backend(request)

        def reads_experts(call: tuple) -> bool:
            return any(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in experts
                       for t in tree_leaves((call[1], call[2])))

        self.calls = [c for c in recorder.calls if not reads_experts(c)]
        self.skipped = len(recorder.calls) - len(self.calls)

    def __call__(self) -> list[torch.Tensor]:
        with torch.inference_mode():
            return [op(*args, **kwargs) for op, args, kwargs in self.calls]

    def as_compiled(self, batched_rows_max: int | None = None, batched_min_elements: int | None = None):
        """The replay with each bias-free ``linear`` that the compiled step runs in
        ``ascend_graph::rows_mm`` (``compile.inductor.runs_rows_mm``: bfloat16, 2 to
        ``ROWS_MM_MAX`` rows, float32 from one, a row-major weight) run in it, and each ``bmm`` it runs in the
        kernel (``compile.inductor.batched_rows_form``: MLA decode's attention products) in
        ``expert_rows_mm`` or ``rows_bmm``, over the gathered copy of the cache rows that the
        eager step made, as the reference attention backend's compiled step runs them (the
        ``cpu_kernel`` backend's step runs one ``decode_attention`` call instead, which this
        replay does not time); None where no call is. ``batched_in_kernel`` counts those ``bmm``.
        ``batched_rows_max`` and ``batched_min_elements`` as the pass's (tests: smaller models)."""
        from ascend_graph.compile.passes.decode_matmul import batched_rows_form, runs_rows_mm

        limits = (batched_rows_max, batched_min_elements)

        calls, kernel, self.batched_in_kernel = [], 0, 0
        for op, args, kwargs in self.calls:
            fn = None
            if op is _aten.linear.default and len(args) == 2 and not kwargs and args[0].dim() > 1:
                x, w = args[0].flatten(0, -2), args[1]
                if runs_rows_mm(x, w):
                    shape = (*args[0].shape[:-1], w.shape[0])
                    fn = functools.partial(lambda x, w, shape: torch.ops.ascend_graph.rows_mm(x, w).view(shape),
                                           x, w, shape)
                    kernel += 1
            elif op is _aten.bmm.default and len(args) == 2 and not kwargs:
                fn = _batched_in_kernel(*args, batched_rows_form(*args, *limits))
                self.batched_in_kernel += fn is not None
            elif op is _aten.einsum.default:  # its inner bmm, where the kernel takes it
                fn = _KernelBmm.around(op, args, kwargs, limits)
                self.batched_in_kernel += fn is not None
            calls.append(fn or functools.partial(op, *args, **kwargs))
        return _replay(calls) if kernel or self.batched_in_kernel else None

    def packed(self):
        """The replay with every bias-free ``linear`` on a weight pre-packed for oneDNN, as Inductor's
        freezing packs it (``inductor.freezing_min_batch``); None where this torch has no oneDNN
        linear for these weights (no oneDNN, or bfloat16 weights on a CPU without AVX-512 or
        AVX-NE-CONVERT). The packed copies live as long as the returned function."""
        calls = []
        for op, args, kwargs in self.calls:
            fn = None
            if op is _aten.linear.default and len(args) == 2 and not kwargs:
                fn = _packed_linear(*args)
                if fn is None:
                    return None
            calls.append(fn or functools.partial(op, *args, **kwargs))
        return _replay(calls)


def _batched_in_kernel(x: torch.Tensor, w: torch.Tensor, form: str | None):
    """``bmm(x, w)`` as the compiled step's kernel computes it (``form``: ``batched_rows_form``'s
    answer), as an argument-free callable; None for aten's."""
    if form == "rows_bmm":
        return functools.partial(torch.ops.ascend_graph.rows_bmm, x, w)
    if form != "expert_rows_mm":
        return None
    b, m, k = x.shape
    ends = torch.arange(m, (b + 1) * m, m, dtype=torch.int32)  # one "expert" per entry, m rows each
    return lambda: torch.ops.ascend_graph.expert_rows_mm(x.reshape(b * m, k), w.transpose(1, 2), ends).view(b, m, -1)


class _KernelBmm(TorchDispatchMode):
    """Runs each ``bmm`` made while active that the compiled step runs in the kernel
    (``batched_rows_form``) in it instead, and counts them: an ``einsum`` stays as it
    decomposes (its views and any copy), only its product changes."""

    def __init__(self, limits: tuple[int, int]) -> None:
        super().__init__()
        self.limits, self.hits = limits, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from ascend_graph.compile.passes.decode_matmul import batched_rows_form

        if func is _aten.bmm.default and not kwargs and (fn := _batched_in_kernel(*args, batched_rows_form(
                *args, *self.limits))):
            self.hits += 1
            return fn()
        return func(*args, **(kwargs or {}))

    @classmethod
    def around(cls, op, args, kwargs, limits: tuple[int, int]):
        """``op`` (a composite such as ``einsum``) as an argument-free callable decomposed under
        this mode, or None where none of its products would run in the kernel."""
        def call():
            with cls(limits) as mode:
                out = op.decompose(*args, **kwargs)
            return out, mode.hits

        with torch.inference_mode():
            if call()[1] == 0:
                return None
        return lambda: call()[0]


def _replay(calls: list) -> Callable[[], list[torch.Tensor]]:
    """A function that makes ``calls`` (argument-free callables) in order, under inference mode."""
    def replay() -> list[torch.Tensor]:
        with torch.inference_mode():
            return [call() for call in calls]
    return replay


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU have oneDNN's pre-packed linear for ``dtype`` weights: bfloat16
    needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (a Zen 3 has neither)."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_for_onednn(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` (a linear's ``[N, K]`` weight) packed for oneDNN as Inductor's freezing packs it, for
    inputs of ``rows`` rows: an opaque mkldnn tensor that only ``onednn_linear`` reads."""
    return torch.ops.mkldnn._reorder_linear_weight(w, rows)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``linear(x, w)`` without bias, ``w`` given as ``pack_for_onednn`` packed it."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _packed_linear(x: torch.Tensor, w: torch.Tensor):
    """``linear(x, w)`` with ``w`` pre-packed for oneDNN as Inductor's freezing packs it (packed
    for ``x``'s row count), or None where this torch has no oneDNN linear for ``w``'s dtype here."""
    try:
        packed = pack_for_onednn(w, x.flatten(0, -2).shape[0])
        onednn_linear(x, packed)
    except (AttributeError, RuntimeError):
        return None
    return lambda: onednn_linear(x, packed)


def measure(batches=(1, 8, 32, 64), context: int = 256, rounds: int = 7) -> dict:
    """FLOPs per step and the bf16 matmul rate (FLOP/s) at each batch, with copy bandwidth."""
    from ascend_graph.compile.passes.decode_matmul import runs_rows_mm

    probe, rows = CopyProbe(), []
    w = torch.randn(10944, 2048).to(torch.bfloat16)
    for b in batches:
        x = torch.randn(b, 2048).to(torch.bfloat16)
        fns = {"mm": lambda: torch.nn.functional.linear(x, w), "copy": probe}
        packed = _packed_linear(x, w)
        if packed is not None:
            fns["packed"] = packed
        if runs_rows_mm(x, w):
            fns["kernel"] = lambda: torch.ops.ascend_graph.rows_mm(x, w)
        t = interleaved_medians(fns, rounds=rounds, calls_per_round=3)
        rate = 2 * b * w.numel() / t["mm"]
        rows.append({"batch": b, "step_flops": step_flops(b, context), "bf16_matmul_flops_per_s": rate,
                     "copy_bytes_per_s": probe.bytes / t["copy"]})
        for name, key in (("packed", "bf16_packed_matmul_flops_per_s"), ("kernel", "bf16_kernel_matmul_flops_per_s")):
            if name in t:
                rows[-1][key] = 2 * b * w.numel() / t[name]
        packed_rate, kernel_rate = (rows[-1].get(k) for k in ("bf16_packed_matmul_flops_per_s",
                                                               "bf16_kernel_matmul_flops_per_s"))
        print(f"  compute batch {b}: step {rows[-1]['step_flops'] / 1e9:.1f} GFLOP, bf16 matmul "
              f"{rate / 1e9:.1f} GFLOP/s -> {rows[-1]['step_flops'] / rate * 1e3:.0f} ms"
              + (f"; pre-packed {packed_rate / 1e9:.1f} GFLOP/s" if packed_rate else "")
              + (f"; rows_mm {kernel_rate / 1e9:.1f} GFLOP/s" if kernel_rate else ""), flush=True)
    core = peak.measure()
    if core.get("bf16_dot_flops_per_s"):
        print(f"  compute: one core's peak bf16 dot-product rate {core['bf16_dot_flops_per_s'] / 1e9:.0f} GFLOP/s, "
              f"float32 FMA {core['fp32_fma_flops_per_s'] / 1e9:.0f} GFLOP/s", flush=True)
    few_rows = peak.few_rows_streams()
    for row in few_rows:
        print(f"  compute: {row['rows']}-row products on plain bf16 weights, aten "
              f"{row['aten_bytes_per_s'] / 1e9:.1f} GB/s, rows_mm {row['kernel_bytes_per_s'] / 1e9:.1f} GB/s",
              flush=True)
    return {"context": context, "rows": rows, "core_peak": core, "few_rows": few_rows}
