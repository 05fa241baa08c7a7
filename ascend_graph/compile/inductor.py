"""Inductor, with options per platform: CUDA graphs on CUDA, the C++ wrapper on CPU.

Options reach Inductor as ``compile_fx(..., config_patches=...)``, which applies them for that
compile only; nothing in ``torch._inductor.config`` is changed for the rest of the process. On
CPU two compiled-only rewrites run (``COMPILED_ONLY_REWRITES``, listed in the parity report):
the decode-matmul pass and the inlined cache write (``passes/``).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from ..config import GraphConfig
from .passes.decode_matmul import SINGLE_ROW_MATMUL_AS_REDUCTION, DecodeMatmulPass
from .passes.inline_writes import INLINE_CACHE_WRITES, inline_cache_writes

# ``GraphConfig.inductor.cpp_wrapper=None`` resolves to these (CPU: the wrapper cuts host time
# per step). CUDA graphs replay the whole step, so the wrapper's host
# cost is off the per-step path there.
DEFAULT_CPP_WRAPPER = {"cpu": True, "cuda": False, "npu": False}
# Where Inductor takes the CPU's vector instruction sets from its flags (cpuinfo, which also asks
# the OS) instead of proving each by a test build (``cpp.vec_isa_ok``). The test builds compile
# ATen's vector headers three times into every new cache directory, the largest share of a cold
# capture after the step's own code, and each start loads them in a fresh Python process
# (``benchmarks/startup.py``). The ISA chosen, and so the code, is the same wherever those
# builds would pass; the AVX-512 bf16 and VNNI extensions are still test-built (small programs).
# ``TORCHINDUCTOR_VEC_ISA_OK``, when set, wins.
TRUST_CPU_VECTOR_FLAGS = {"cpu": True, "cuda": False, "npu": False}
# Where the C++ wrapper is compiled apart from the kernels (``cpp_wrapper_build_separate``): the
# wrapper's calls at -O1 (torch's level for code that only calls), the kernels at -O3 on their
# own precompiled header, instead of one -O3 unit that parses the kernels' headers again for
# every capture size. The C++ compiler is most of a cold capture; this cuts its time per size,
# and the step time stayed within noise (``benchmarks/startup.py``).
SEPARATE_WRAPPER_BUILD = {"cpu": True, "cuda": False, "npu": False}


def compiled_only_rewrites(platform: str) -> list[str]:
    """What graph mode computes differently from eager on ``platform`` (parity checks both):
    the Inductor rewrites that have no eager twin."""
    rewrites = []
    if SINGLE_ROW_MATMUL_AS_REDUCTION.get(platform):
        rewrites.append("decode_matmul: one-row bf16/fp16 matmuls as fused reductions; 2-64-row bf16 matmuls "
                        "and batched bf16 products through the CPU kernel (rows_mm, expert_rows_mm, rows_bmm)")
    if INLINE_CACHE_WRITES.get(platform):
        rewrites.append("inline_writes: the cache write op traced into the graph as index_copy")
    return rewrites


@dataclass(frozen=True, eq=False)
class InductorBackend:
    """A torch.compile backend: Inductor's ``compile_fx`` with fixed config patches and cache dir."""

    config_patches: Mapping[str, Any]
    cache_dir: Optional[str] = None
    inline_writes: bool = False  # inline_cache_writes(gm) first; see INLINE_CACHE_WRITES

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        if self.inline_writes:
            inline_cache_writes(gm)
        patches = dict(self.config_patches)
        if patches.get("cpp_wrapper") and takes_opaque_values(gm, example_inputs):
            patches.update(cpp_wrapper=False, cpp_wrapper_build_separate=False)
        with cache_dir_for_compile(self.cache_dir):
            return compile_fx(gm, example_inputs, config_patches=patches)

    def reset(self) -> None:
        """Drop recorded CUDA graphs (torch.compile calls this on ``torch._dynamo.reset()``)."""
        if self.config_patches.get("triton.cudagraphs"):
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees

            reset_cudagraph_trees()


def takes_opaque_values(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether the graph has inputs of a registered opaque type (vLLM's ``LayerName``): the C++
    wrapper cannot pass those to an op (``custom_op_wrapper`` takes no ``PyObject``), so such a
    graph is compiled with Inductor's Python wrapper."""
    try:
        from torch._library.fake_class_registry import FakeScriptObject
        from torch._library.opaque_object import is_opaque_value
    except ImportError:  # torch without opaque types
        return False
    metas = (node.meta.get("val") for node in gm.graph.find_nodes(op="placeholder"))
    return any(isinstance(x, FakeScriptObject) or is_opaque_value(x) for x in (*example_inputs, *metas))


def config_patches(config: GraphConfig, platform: str, mode: Optional[str] = None) -> dict[str, Any]:
    """Inductor config patches for ``config`` on ``platform`` (``mode``: torch.compile's mode)."""
    patches: dict[str, Any] = {}
    if mode is not None:
        from torch._inductor import list_mode_options

        patches.update(list_mode_options(mode))
    # CUDA graphs on CUDA always (the point of graph mode), elsewhere never (nothing to capture).
    patches["triton.cudagraphs"] = platform == "cuda"
    cpp_wrapper = config.inductor.cpp_wrapper
    if cpp_wrapper is None:
        cpp_wrapper = DEFAULT_CPP_WRAPPER[platform]
    elif cpp_wrapper and platform == "cuda":
        warnings.warn("inductor.cpp_wrapper=True on CUDA: torch skips CUDA graphs for C++-wrapper code "
                      "when graph partitioning is on (the default in torch 2.13), so steps replay no graph",
                      stacklevel=2)
    patches["cpp_wrapper"] = cpp_wrapper
    if cpp_wrapper and SEPARATE_WRAPPER_BUILD[platform]:
        patches["cpp_wrapper_build_separate"] = True
    from torch._inductor import config as inductor_config

    if TRUST_CPU_VECTOR_FLAGS[platform] and inductor_config.cpp.vec_isa_ok is None:
        patches["cpp.vec_isa_ok"] = True
    if SINGLE_ROW_MATMUL_AS_REDUCTION[platform]:
        patches["post_grad_custom_post_pass"] = DecodeMatmulPass()
    return patches


def make_backend(name: str, config: GraphConfig, platform: str, mode: Optional[str]) -> InductorBackend:
    """The Inductor backend for ``platform``; registered for the name ``"inductor"``."""
    return InductorBackend(config_patches(config, platform, mode), config.compile_cache_dir,
                           INLINE_CACHE_WRITES[platform])


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
