"""Inductor, with options per platform: CUDA graphs on CUDA, the C++ wrapper on CPU.

Options reach Inductor as ``compile_fx(..., config_patches=...)``, which applies them for that
compile only; nothing in ``torch._inductor.config`` is changed for the rest of the process.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .. import runtime
from ..config import GraphConfig

# ``inductor_cpp_wrapper=None`` resolves to these. CPU: measured with
# benchmarks/inductor_options.py (torch 2.13, 2-layer decode step, batch 1/4/8): the C++ wrapper
# cut 30-40 us of a 270-500 us step. CUDA and NPU: not measured; CUDA graphs replay the whole
# step there, so the wrapper's host cost is off the per-step path anyway.
DEFAULT_CPP_WRAPPER = {"cpu": True, "cuda": False, "npu": False}

# CPU: a one-row bfloat16/float16 matmul becomes an Inductor reduction (see SingleRowMatmulPass).
# Measured with benchmarks/ (torch 2.13, 1 thread, [1, 2048] x [2048, 102400] bfloat16): aten's
# GEMV streams the weight at 0.43 of the copy bandwidth, the generated reduction at 0.84. With 2+
# rows the reduction re-reads the weight per row (2 rows: 5.6 vs aten 6.7 GB/s), so only 1 row.
SINGLE_ROW_MATMUL_AS_REDUCTION = {"cpu": True, "cuda": False, "npu": False}


class SingleRowMatmulPass(CustomGraphPass):
    """Post-grad pass: one-row bfloat16/float16 matmuls on CPU become reductions.

    ``mm(x [1, K], w [K, N])`` -> ``sum(x.float().T * w.float(), 0)``; ``addmm`` adds its bias
    after; ``bmm(x [B, 1, K], w [B, K, N])`` likewise per batch. Inductor generates each as one
    fused reduction that streams ``w`` once, and folds an indexing that produced ``w`` (the
    gathered experts of a MoE decode) into the same loop instead of copying the weights first.
    A decode step at batch 1 is made of these.

    A reduction longer than ``runtime.LONG_REDUCTION`` elements (a row-major weight of long rows;
    the DeepSeek models keep theirs chunk-major on CPU, ``models.layers.ChunkedLinear``, and
    never reach this) is split into equal chunks: Inductor otherwise accumulates it through its
    cascade-summation helper, which keeps the accumulator in memory. Its row is stored in the
    matmul's own dtype, as the unrewritten matmul reads it: as float32 it would no longer stay
    in L1 next to the weight stream.
    """

    def __init__(self, split_long_reductions: bool = True) -> None:
        self.split_long_reductions = split_long_reductions  # False: only for measuring the split

    def __call__(self, graph: torch.fx.Graph) -> None:
        import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)

        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in (aten.mm.default, aten.addmm.default,
                                                                  aten.bmm.default):
                continue
            bias, x, w = (node.args if node.target is aten.addmm.default else (None, *node.args))[:3]
            if node.kwargs or not self._applies(x, w):
                continue
            with graph.inserting_before(node):
                out = self._reduction(graph, x, w, node.meta["val"].dtype, bias)
            node.replace_all_uses_with(out)
            graph.erase_node(node)

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
        vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in (x, w)]
        if any(not isinstance(v, torch.Tensor) for v in vals):
            return False
        xv, wv = vals
        rows = xv.shape[-2]
        return (xv.device.type == "cpu" and xv.dtype in (torch.bfloat16, torch.float16) and wv.dtype == xv.dtype
                and isinstance(rows, int) and rows == 1)

    def uuid(self) -> Optional[Any]:
        return get_hash_for_files((__file__, runtime.__file__)).hex() + f"-split{int(self.split_long_reductions)}"


def _call(graph: torch.fx.Graph, target, *args) -> torch.fx.Node:
    """A new node of ``target(*args)`` with its fake-tensor ``meta["val"]`` filled in."""
    node = graph.call_function(target, tuple(args))
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    fake_mode = next(v.fake_mode for v in vals if isinstance(v, torch.Tensor))
    with fake_mode:
        node.meta["val"] = target(*vals)
    return node


@dataclass(frozen=True, eq=False)
class InductorBackend:
    """A torch.compile backend: Inductor's ``compile_fx`` with fixed config patches and cache dir."""

    config_patches: Mapping[str, Any]
    cache_dir: Optional[str] = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        with cache_dir_for_compile(self.cache_dir):
            return compile_fx(gm, example_inputs, config_patches=dict(self.config_patches))

    def reset(self) -> None:
        """Drop recorded CUDA graphs (torch.compile calls this on ``torch._dynamo.reset()``)."""
        if self.config_patches.get("triton.cudagraphs"):
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()


def config_patches(config: GraphConfig, platform: str, mode: Optional[str] = None) -> dict[str, Any]:
    """Inductor config patches for ``config`` on ``platform`` (``mode``: torch.compile's mode)."""
    patches: dict[str, Any] = {}
    if mode is not None:
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode))
    # CUDA graphs on CUDA always (the point of graph mode), elsewhere never (nothing to capture).
    patches["triton.cudagraphs"] = platform == "cuda"
    cpp_wrapper = config.inductor_cpp_wrapper
    if cpp_wrapper is None:
        cpp_wrapper = DEFAULT_CPP_WRAPPER[platform]
    elif cpp_wrapper and platform == "cuda":
        warnings.warn("inductor_cpp_wrapper=True on CUDA: torch skips CUDA graphs for C++-wrapper code "
                      "when graph partitioning is on (the default in torch 2.13), so steps replay no graph",
                      stacklevel=2)
    patches["cpp_wrapper"] = cpp_wrapper
    if SINGLE_ROW_MATMUL_AS_REDUCTION[platform]:
        patches["post_grad_custom_post_pass"] = SingleRowMatmulPass()
    return patches


def make_backend(name: str, config: GraphConfig, platform: str, mode: Optional[str]) -> InductorBackend:
    """The Inductor backend for ``platform``; registered for the name ``"inductor"``."""
    return InductorBackend(config_patches(config, platform, mode), config.compile_cache_dir)


@contextlib.contextmanager
def cache_dir_for_compile(directory: Optional[str]) -> Iterator[None]:
    """Point Inductor's on-disk caches (FX graph cache, AOTAutograd cache, kernels) at ``directory``.

    Inductor reads its cache root from ``TORCHINDUCTOR_CACHE_DIR`` at each use, so the variable is
    set for the compile and restored afterwards. Kernels autotuned lazily at first run (Triton on
    CUDA) still go to the process-wide directory.
    """
    if directory is None:
        yield
        return
    os.makedirs(directory, exist_ok=True)
    try:
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    except ImportError:  # older torch: set and restore the variable ourselves
        temporary_cache_dir = _set_cache_dir
    with temporary_cache_dir(os.path.abspath(directory)):
        yield


@contextlib.contextmanager
def _set_cache_dir(directory: str) -> Iterator[None]:
    old = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = old
