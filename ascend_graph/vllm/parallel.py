"""vLLM's tensor-parallel group as ascend_graph's ``ParallelState``, in a vLLM worker.

vLLM forms its groups (``init_worker_distributed_environment``) before it builds the model, so
the model class adopts them in its ``__init__`` (``adopt_vllm_groups``): the TP group's sum
all-reduce is vLLM's own ``GroupCoordinator.all_reduce`` (its shared-memory all-reduce where the
loaded ``_C`` library has one, else ``torch.distributed`` over its gloo group), which
``torch.compile`` traces into the captured step; the host agreement runs over its gloo
``cpu_group``. Expert parallel spans the TP ranks (graph mode refuses data parallel), so it
reuses the TP group. The groups stay vLLM's: ``destroy_parallel`` only forgets them.
"""

from __future__ import annotations

from typing import Any

from ..distributed import Group, ParallelConfig, ParallelState, adopt_parallel, get_parallel_state


def collective_path(coordinator: Any) -> str:
    """Which all-reduce vLLM's group ``coordinator`` runs: ``"shm"`` (vLLM's shared-memory op)
    or ``"torch.distributed"`` (gloo on CPU)."""
    communicator = getattr(coordinator, "device_communicator", None)
    return "shm" if getattr(communicator, "supports_tensor_dict", False) else "torch.distributed"


def vllm_parallel_state(vllm_config: Any) -> ParallelState:
    """This worker's ``ParallelState`` over vLLM's groups (the single-process state at TP=1)."""
    parallel = vllm_config.parallel_config
    tp_size = parallel.tensor_parallel_size
    config = ParallelConfig(tp_size, 1, bool(parallel.enable_expert_parallel))
    if tp_size == 1:
        return ParallelState(config=config)
    import vllm
    from vllm.distributed.parallel_state import get_tp_group, get_world_group

    tpg, world = get_tp_group(), get_world_group()
    ranks, rank = tuple(tpg.ranks), tpg.rank_in_group
    tp = Group(tpg.device_group, ranks, rank, reduce=tpg.all_reduce)
    return ParallelState(
        config=config, rank=world.rank,
        world=Group(world.cpu_group, tuple(world.ranks), world.rank_in_group),
        tp=tp, ep=tp if config.enable_expert_parallel else Group.single(world.rank),
        host=Group(tpg.cpu_group, ranks, rank),
        collectives=f"vllm {vllm.__version__} {tpg.unique_name} {collective_path(tpg)}")


def adopt_vllm_groups(vllm_config: Any) -> ParallelState:
    """Install ``vllm_parallel_state`` as this worker's state (one model per vLLM worker process)."""
    state = vllm_parallel_state(vllm_config)
    if state.world_size == 1 and get_parallel_state().world_size == 1:
        return state
    return adopt_parallel(state)



def check_split(vllm_config: Any) -> None:
    """``ValueError`` when the checkpoint does not split over vLLM's TP ranks (heads, features,
    experts per rank: ``models.tensor_parallel.check_split``), in the process that runs
    ``LLM(...)``, before any worker starts (vLLM itself checks only the head count)."""
    from ..models import DeepseekConfig, DeepseekForCausalLM, LlamaConfig, LlamaForCausalLM
    from ..models.tensor_parallel import check_split as check_model_split
    from .flags import ARCHITECTURES, graph_architecture

    parallel = vllm_config.parallel_config
    hf = vllm_config.model_config.hf_config
    ours = graph_architecture(getattr(hf, "architectures", None))  # the config may already name ours:
    checkpoint = {v: k for k, v in ARCHITECTURES.items()}[ours]  # vLLM's engine core checks it again
    cls, config = (LlamaForCausalLM, LlamaConfig) if ours == "AscendGraphLlamaForCausalLM" else \
        (DeepseekForCausalLM, DeepseekConfig)
    check_model_split(cls, config.from_dict({**hf.to_dict(), "architectures": [checkpoint]}),
                      ParallelConfig(parallel.tensor_parallel_size, 1, bool(parallel.enable_expert_parallel)))


def graph_config_for(config: Any, state: ParallelState) -> Any:
    """``config`` for this worker: precompile off on several ranks unless asked for (a saved step
    holds one run's process groups and does not load into another), as the Engine does."""
    import dataclasses

    if state.world_size == 1 or config.inductor.precompile is not None:
        return config
    return dataclasses.replace(config, inductor=dataclasses.replace(config.inductor, precompile=False))
