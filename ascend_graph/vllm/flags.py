"""The flag: vLLM's ``additional_config`` read onto a ``GraphConfig``, without importing vLLM.

Two sections of ``additional_config`` are ours:

- ``torchair_graph_config``: vllm-ascend's keys, read by
  ``ascend_graph.integrations.vllm_ascend.graph_config`` (its validation and mapping);
- ``ascend_graph``: our own ``GraphConfig`` keys (``GraphConfig.from_dict``), e.g.
  ``parity_interval``, ``on_recompile``, ``backend``; and the plugin's own ``moe_kernel``
  (``MOE_KERNELS``, ``moe_kernel``).

``max_batch_size`` is vLLM's ``max_num_seqs`` and cannot be set here. Any other key of
``additional_config`` belongs to someone else and is left alone. Errors are ``ValueError`` /
``TypeError`` whose message starts with the section that holds the bad key or value.

One owner per flag: graph mode runs where vLLM's active platform is one of ``RUNS_ON`` (its
``device_type``; the model is built on the host, so CPU only). Elsewhere, e.g. under
vllm-ascend's NPU platform, ``torchair_graph_config`` is that platform's, and only our own
section is ours (an error there: ``check_platform``).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from ..config import GraphConfig
from ..integrations.vllm_ascend import SECTION as TORCHAIR_SECTION
from ..integrations.vllm_ascend import graph_config

OWN_SECTION = "ascend_graph"
# A checkpoint's architecture -> the class the flag switches it to (registered by the plugin).
ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "AscendGraphDeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "AscendGraphDeepseekV3ForCausalLM",
    "LlamaForCausalLM": "AscendGraphLlamaForCausalLM",
}


RUNS_ON = ("cpu",)  # vLLM platforms' device_type where graph mode runs: the model is built on the host


# additional_config["ascend_graph"]["moe_kernel"]: whose kernel runs the routed experts ("vllm":
# vLLM's cpu_fused_moe over weights packed for it, where it takes the model; the default)
MOE_KERNELS = ("vllm", "ascend_graph")
PLUGIN_KEYS = frozenset({"moe_kernel"})  # keys of our section that are not GraphConfig's


def runs_graph_mode(platform: Any) -> bool:
    """Whether graph mode runs on vLLM ``platform`` (its ``device_type`` is in ``RUNS_ON``)."""
    return getattr(platform, "device_type", None) in RUNS_ON


def platform_name(platform: Any) -> str:
    """``platform`` as errors name it: its class and ``device_type``."""
    cls = platform if isinstance(platform, type) else type(platform)
    return f"{cls.__name__} (device_type {getattr(platform, 'device_type', None)!r})"


def check_platform(additional_config: Any, platform: Any) -> bool:
    """Whether our sections of ``additional_config`` are ours to read on ``platform``: False
    without them or where graph mode does not run (``torchair_graph_config`` is then that
    platform's); ``ValueError`` naming the platform for our own section there."""
    if not has_flag(additional_config):
        return False
    if runs_graph_mode(platform):
        return True
    if OWN_SECTION in additional_config:
        raise ValueError(f"additional_config[{OWN_SECTION!r}]: ascend_graph's graph mode runs on vLLM's CPU "
                         f"platform only (its model is built on the host); the active platform is "
                         f"{platform_name(platform)}. Remove the section")
    return False


def has_flag(additional_config: Any) -> bool:
    """Whether ``additional_config`` holds one of our sections (otherwise the plugin does nothing;
    on a platform graph mode does not run on, see ``check_platform``)."""
    return isinstance(additional_config, Mapping) and (
        TORCHAIR_SECTION in additional_config or OWN_SECTION in additional_config)


def parse_additional_config(additional_config: Any, *, max_num_seqs: int) -> Optional[GraphConfig]:
    """The ``GraphConfig`` our sections of ``additional_config`` ask for; ``None`` without them.

    ``max_num_seqs`` (vLLM's scheduler limit) is the runner's ``max_batch_size``.
    """
    if not has_flag(additional_config):
        return None
    own = additional_config.get(OWN_SECTION, {})
    if not isinstance(own, Mapping):
        raise TypeError(f"additional_config[{OWN_SECTION!r}] must be a dict, got {type(own).__name__}")
    if "max_batch_size" in own:
        raise ValueError(f"additional_config[{OWN_SECTION!r}].max_batch_size: the largest batch is vLLM's "
                         "max_num_seqs; set max_num_seqs instead")
    moe_kernel(additional_config)
    d: dict[str, Any] = {k: v for k, v in own.items() if k not in PLUGIN_KEYS}
    if TORCHAIR_SECTION in additional_config:
        d[TORCHAIR_SECTION] = additional_config[TORCHAIR_SECTION]
    where = " / ".join(f"additional_config[{s!r}]" for s in (TORCHAIR_SECTION, OWN_SECTION)
                       if s in additional_config)
    try:
        return graph_config(d, base=GraphConfig(max_batch_size=max_num_seqs))
    except (TypeError, ValueError) as e:
        note = f" (max_batch_size is vLLM's max_num_seqs={max_num_seqs})" if "max_batch_size" in str(e) else ""
        raise type(e)(f"{where}: {e}{note}") from e


def moe_kernel(additional_config: Any, expert_parallel: bool = False) -> str:
    """The ``moe_kernel`` our section asks for: ``"vllm"``, vLLM's own fused-MoE kernel
    (``vllm.moe``), or ``"ascend_graph"``, the project's MoE backend (``model.backends()``).
    Unset (or without the flag) it is ``"vllm"``, but ``"ascend_graph"`` under ``expert_parallel``:
    vLLM's kernel runs all of a layer's experts, not a rank's range of them, so an explicit
    ``"vllm"`` there is a ``ValueError`` naming both, as is any value not in ``MOE_KERNELS``."""
    own = additional_config.get(OWN_SECTION, {}) if has_flag(additional_config) else {}
    default = "ascend_graph" if expert_parallel else "vllm"
    value = own.get("moe_kernel", default) if isinstance(own, Mapping) else default
    if value not in MOE_KERNELS:
        raise ValueError(f"additional_config[{OWN_SECTION!r}].moe_kernel must be one of {list(MOE_KERNELS)}, "
                         f"got {value!r}")
    if expert_parallel and value == "vllm":
        raise ValueError(f"additional_config[{OWN_SECTION!r}].moe_kernel 'vllm' runs every routed expert of a "
                         "layer and cannot be combined with enable_expert_parallel=True; leave it unset "
                         "('ascend_graph' runs each rank's experts)")
    return value


def graph_architecture(architectures: Any) -> str:
    """The class graph mode runs for a checkpoint's ``architectures``; ``ValueError`` naming it otherwise."""
    arch = architectures[0] if isinstance(architectures, (list, tuple)) and architectures else architectures
    if arch in ARCHITECTURES.values():
        return arch
    if arch not in ARCHITECTURES:
        raise ValueError(f"ascend_graph's graph mode (additional_config[{TORCHAIR_SECTION!r}].enabled) runs "
                         f"{', '.join(ARCHITECTURES)}; this model's architecture is {arch!r}")
    return ARCHITECTURES[arch]
