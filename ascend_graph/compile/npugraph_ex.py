"""The npugraph_ex backend (Ascend NPU): torchair's aclgraph capture, by its public API.

What is called: the torch.compile backend torch_npu (7.3.0 and later) registers under the name
``"npugraph_ex"`` (``torch._dynamo.lookup_backend("npugraph_ex")``), with the options as the
``options`` keyword, exactly what ``torch.compile(fn, backend="npugraph_ex", options={...})``
hands it. Why that one: it is the entry point torchair's npugraph_ex guide documents, and looking
it up (rather than passing the name) lets the runner count each compile.
``torch.npu.npugraph_ex.compile_fx`` is the same compiler for a caller's own AOTAutograd backend,
which that guide says lacks multi-stream, core limits and the input in-place pass; torchair's own
``CompilerConfig.mode="reduce-overhead"`` is deprecated for this backend. Neither is used. Not
run here (no NPU); the contract tests check what is handed over.

Options (``NpugraphExOptions``) use npugraph_ex's names. A mutated input (a KV cache) whose
address changes makes npugraph_ex recapture; it counts them in
``torch._dynamo.utils.counters["npugraph_ex"]["recapture_due_to_mutated_input_change_<graph>"]``,
which the runner reports as ``RunnerStats.recaptures``.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ..config import GraphConfig, NpugraphExOptions
from .recipe import CompileRecipe
from .torchair import MISSING

RECAPTURE_PREFIX = "recapture_due_to_mutated_input_change_"


def recapture_counts() -> dict[str, int]:
    """npugraph_ex's recaptures for a changed mutated-input address, per graph counter."""
    from torch._dynamo.utils import counters

    return {key: n for key, n in counters["npugraph_ex"].items() if key.startswith(RECAPTURE_PREFIX)}


def compile_recipe(config: GraphConfig) -> CompileRecipe:
    """As torchair's GE (``compile.torchair.compile_recipe``): shapes static per capture size,
    host integers of the fused attention symbolic (npugraph_ex refreshes ``actual_seq_lengths_kv``
    before each replay rather than capturing per value)."""
    return CompileRecipe(dynamic=True, mark_static=True, recapture_counts=recapture_counts)


def options_dict(options: NpugraphExOptions) -> dict:
    """The ``options`` npugraph_ex gets for ``options``; ``use_graph_pool`` becomes a new pool."""
    d = {"capture_limit": options.capture_limit, "clone_input": options.clone_input,
         "frozen_parameter": options.frozen_parameter, "force_eager": options.force_eager}
    if options.use_graph_pool:
        d["use_graph_pool"] = torch.npu.graph_pool_handle()
    return d


def make_backend(name: str, config: GraphConfig, platform: str, mode: Optional[str]) -> Callable:
    """npugraph_ex with ``config.npugraph_ex``; it has no modes (its guide: unsupported), so ``mode`` raises."""
    if mode is not None:
        raise ValueError(f"mode={mode!r} has no meaning for the 'npugraph_ex' backend; leave mode unset")
    backend = import_npugraph_ex()
    torch.npu.set_compile_mode(jit_compile=False)  # the prebuilt operator binaries, as on GE
    return functools.partial(backend, options=options_dict(config.npugraph_ex))


def import_npugraph_ex() -> Callable:
    """torch_npu, then its ``"npugraph_ex"`` backend; a clear ImportError when either is absent."""
    try:
        import torch_npu  # noqa: F401  (registers the NPU device and its torch.compile backends)
    except ImportError as e:
        raise ImportError(f"{MISSING} (import torch_npu failed: {e})") from e
    try:
        return torch._dynamo.lookup_backend("npugraph_ex")
    except torch._dynamo.exc.InvalidBackend as e:
        raise ImportError(f"{MISSING} (torch_npu is installed but registers no 'npugraph_ex' torch.compile "
                          f"backend: it needs torch_npu 7.3.0 or later)") from e
