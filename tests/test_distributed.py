"""The distributed package: process groups, traceable collectives and host-side agreement.

Two ranks are spawned once for the module (gloo on 127.0.0.1, float32) and run every
multi-process check in one go (``distributed_ranks.collective_checks``): the collectives, a
tensor-parallel tiny Llama under the graph runner, agreement and failures. The tests below read
their results against single-process oracles (one process computing from every rank's inputs,
an unsharded model's eager runner). The rest runs in this process, where nothing is
initialised and the package is the single-process case.
"""

from __future__ import annotations

import pytest
import torch

from checkpoints import SMALL_JSON, hf_named_tensors, write_checkpoint
from distributed_ranks import (DECODE_STEPS, STEPS, collective_checks, collective_step, free_ports,
                               greedy_decode, rank_input, recording_backend, run_ranks, small_deepseek)
from runner_helpers import make_runner, small_model

from ascend_graph.config import GraphConfig
from ascend_graph.distributed import (Group, ParallelConfig, ParallelState, RankFailure, adopt_parallel, agree,
                                      all_or_none, all_reduce, destroy_parallel, get_parallel_state, group_ranks, init_parallel)
from ascend_graph.distributed import state as state_module
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM, load_deepseek
from ascend_graph.models.deepseek import kv_b_parts
from ascend_graph.models.llama import LlamaConfig, LlamaForCausalLM
from ascend_graph.models.llama_loader import checkpoint_names, load_llama_weights

pytestmark = pytest.mark.xdist_group("distributed")

WORLD = 2
DEADLINE_S = 3.0
GRACE_S = 15.0  # beyond a deadline, for the failure to be reported (a loaded 2-core host)
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Each rank's results of ``collective_checks``."""
    return run_ranks(collective_checks, WORLD, 400.0, free_ports(2), DEADLINE_S)


def one_process_oracle(step: int) -> list[list[torch.Tensor]]:
    """Per rank, what ``collective_step`` must return, computed from every rank's input in one process."""
    xs = [rank_input(step, r) for r in range(WORLD)]
    gathered = torch.cat(xs)
    summed = sum(x * 2 for x in xs)
    scattered = sum(gathered * 3 for _ in xs).chunk(WORLD)
    exchanged = [torch.cat([(x + 1).chunk(WORLD)[r] for x in xs]) for r in range(WORLD)]
    return [[summed, gathered, scattered[r], exchanged[r]] for r in range(WORLD)]


def test_compiled_collectives_equal_eager_and_the_one_process_oracle(ranks) -> None:
    for step in range(STEPS):
        oracle = one_process_oracle(step)
        for rank, result in enumerate(ranks):
            run = result["steps"][step]
            for name, graph, eager, want in zip(COLLECTIVES, run["graph"], run["eager"], oracle[rank]):
                assert torch.tensor(graph).equal(torch.tensor(eager)), (name, step, rank)
                torch.testing.assert_close(torch.tensor(graph), want, rtol=1e-6, atol=1e-6,
                                           msg=f"{name} step {step} rank {rank}")


def test_one_compile_for_a_fixed_shape_and_no_recompile(ranks) -> None:
    assert [r["compiles"] for r in ranks] == [1] * WORLD


def test_each_collective_is_a_node_of_the_captured_graph(ranks) -> None:
    for result in ranks:
        targets = result["targets"]
        for name in COLLECTIVES:
            assert targets.count(f"_c10d_functional.{name}") == 1, (name, targets)
        assert targets.count("_c10d_functional.wait_tensor") == len(COLLECTIVES)


def test_groups_follow_the_layout(ranks) -> None:
    tp = [r["tp_groups"] for r in ranks]
    assert [g["tp"] for g in tp] == [(0, 1)] * 2 and [g["dp"] for g in tp] == [(0,), (1,)]
    assert [g["ep"] for g in tp] == [(0,), (1,)]
    dp = [r["dp_groups"] for r in ranks]
    assert [g["dp"] for g in dp] == [(0, 1)] * 2 and [g["ep"] for g in dp] == [(0, 1)] * 2
    assert [g["tp"] for g in dp] == [(0,), (1,)] and all(g["host"] == (0, 1) for g in dp)


def test_agreement_is_the_max_or_min_across_ranks(ranks) -> None:
    assert [r["max"] for r in ranks] == [[1, 10]] * 2
    assert [r["min"] for r in ranks] == [[0, 9]] * 2


def test_a_failure_on_one_rank_raises_on_every_rank(ranks) -> None:
    zero, one = ranks[0]["failure"], ranks[1]["failure"]
    assert one["raised"] == "ValueError" and "injected on rank 1" in one["message"]
    assert zero["raised"] == "RankFailure" and zero["failed_ranks"] == [1]
    assert max(zero["seconds"], one["seconds"]) < DEADLINE_S + GRACE_S


def test_a_rank_that_never_arrives_ends_the_wait_at_the_deadline(ranks) -> None:
    absent = ranks[0]["absent"]
    assert absent["raised"] == "AgreementTimeout", absent
    assert DEADLINE_S - 0.5 < absent["seconds"] < DEADLINE_S + GRACE_S


def test_tensor_parallel_llama_decodes_the_one_process_tokens(ranks) -> None:
    model = small_model("llama")
    tokens, (logits,) = greedy_decode([make_runner(model, GraphConfig(enabled=False))])
    for result in (r["llama"] for r in ranks):
        assert result["tokens"] == tokens
        torch.testing.assert_close(torch.tensor(result["graph_logits"]), torch.tensor(logits),
                                   rtol=1e-5, atol=1e-5)


def test_tensor_parallel_llama_graph_equals_its_own_eager_runner(ranks) -> None:
    for result in (r["llama"] for r in ranks):
        torch.testing.assert_close(torch.tensor(result["graph_logits"]), torch.tensor(result["eager_logits"]),
                                   rtol=1e-5, atol=1e-5)


def test_tensor_parallel_llama_compiles_once_and_caches_its_own_kv_heads(ranks) -> None:
    heads = small_model("llama").config.num_key_value_heads
    for result in (r["llama"] for r in ranks):
        assert result["stats"] == {"compiles": 1, "recompiles": 0, "compile_failures": 0,
                                   "graph_steps": DECODE_STEPS + 1}
        assert set(result["kv_heads"]) == {heads // WORLD}


def test_tensor_parallel_llama_graph_step_runs_its_all_reduces(ranks) -> None:
    """Two per layer (o_proj, down_proj) in one compiled step, as the profiler sees c10d's
    allreduce (which Inductor's wrappers, C++ or Python, end in)."""
    layers = small_model("llama").config.num_hidden_layers
    for result in (r["llama"] for r in ranks):
        ops = result["graph_step_ops"]
        assert ops.count("c10d::allreduce_") == 2 * layers, ops


VERSIONS = ("v2", "v3")


@pytest.mark.parametrize("version", VERSIONS)
def test_tensor_parallel_deepseek_decodes_the_one_process_tokens(ranks, version) -> None:
    tokens, (logits,) = greedy_decode([make_runner(small_deepseek(version), GraphConfig(enabled=False))])
    for result in (r["deepseek"][version] for r in ranks):
        assert result["tokens"] == tokens
        torch.testing.assert_close(torch.tensor(result["graph_logits"]), torch.tensor(logits),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("version", VERSIONS)
def test_tensor_parallel_deepseek_graph_equals_its_own_eager_runner(ranks, version) -> None:
    for result in (r["deepseek"][version] for r in ranks):
        torch.testing.assert_close(torch.tensor(result["graph_logits"]), torch.tensor(result["eager_logits"]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("version", VERSIONS)
def test_tensor_parallel_deepseek_compiles_once_and_keeps_the_whole_latent_cache(ranks, version) -> None:
    config = small_deepseek(version).config
    for result in (r["deepseek"][version] for r in ranks):
        assert result["stats"] == {"compiles": 1, "recompiles": 0, "compile_failures": 0,
                                   "graph_steps": DECODE_STEPS + 1}
        shapes = result["shapes"]
        assert shapes["heads"] == config.num_attention_heads // WORLD
        assert shapes["expert_gate_up"] == [config.n_routed_experts, 2 * config.moe_intermediate_size // WORLD,
                                            config.hidden_size]  # every expert, a share of each
        assert shapes["latent_cache"] == [[config.kv_lora_rank, config.qk_rope_head_dim]] * config.num_hidden_layers


@pytest.mark.parametrize("version", VERSIONS)
def test_tensor_parallel_deepseek_graph_step_runs_two_all_reduces_per_layer(ranks, version) -> None:
    """o_proj, then the dense MLP or the MoE (routed + shared experts summed first): one each."""
    layers = small_deepseek(version).config.num_hidden_layers
    for result in (r["deepseek"][version] for r in ranks):
        ops = result["graph_step_ops"]
        assert ops.count("c10d::allreduce_") == 2 * layers, ops


# ---- one process: nothing initialised ----

def test_uninitialised_state_is_one_process() -> None:
    state = get_parallel_state()
    assert state.world_size == 1 and state.rank == 0
    groups = [getattr(state, g) for g in ("world", "tp", "dp", "ep", "host")]
    assert all(g.size == 1 and g.pg is None for g in groups)


def test_collectives_over_one_rank_are_the_identity_and_leave_the_graph_alone() -> None:
    graphs: list = []
    backend = recording_backend(graphs, inner="eager")
    compiled = torch.compile(collective_step, backend=backend, fullgraph=True)
    x = rank_input(0, 0)
    eager, graph = collective_step(x, get_parallel_state().tp), compiled(x, get_parallel_state().tp)
    for got in (eager, graph):
        for t, want in zip(got, (x * 2, x, x * 3, x + 1)):
            assert torch.equal(t, want)
    assert not [n for n in graphs[0].graph.nodes if "_c10d_functional" in str(n.target)]


def test_one_process_agreement_returns_its_values_and_reraises_its_failure() -> None:
    assert agree([3, 4], "min") == [3, 4]
    with pytest.raises(KeyError), all_or_none("a step"):
        raise KeyError("x")
    assert issubclass(RankFailure, RuntimeError)


def test_the_group_layout_puts_tensor_parallel_ranks_next_to_each_other() -> None:
    config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
    groups = group_ranks(config)
    assert groups["tp"] == [(0, 1), (2, 3)] and groups["dp"] == [(0, 2), (1, 3)]
    assert groups["ep"] == [(0, 1, 2, 3)] and groups["host"] == [(0, 1, 2, 3)]
    assert group_ranks(ParallelConfig(data_parallel_size=2))["ep"] == [(0,), (1,)]


@pytest.mark.parametrize("kwargs, name", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"data_parallel_size": 1.5}, "data_parallel_size"),
    ({"tensor_parallel_size": True}, "tensor_parallel_size"),
    ({"enable_expert_parallel": 1}, "enable_expert_parallel"),
])
def test_a_bad_parallel_config_names_its_argument(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        ParallelConfig(**kwargs)


@pytest.mark.parametrize("kwargs, name", [
    ({"rank": 0, "world_size": 3}, "world_size"),
    ({"rank": 2, "world_size": 2}, "rank"),
    ({"rank": 0, "world_size": 2, "init_method": None}, "MASTER_PORT"),
    ({"rank": 0, "world_size": 2, "device": "meta"}, "device"),
    ({"rank": 0, "world_size": 2, "timeout_s": 0}, "timeout_s"),
])
def test_bad_init_arguments_fail_before_any_group_exists(kwargs, name, monkeypatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    kwargs = {"init_method": "tcp://127.0.0.1:1"} | kwargs
    with pytest.raises(ValueError, match=name):
        init_parallel(ParallelConfig(tensor_parallel_size=2), **kwargs)
    assert not torch.distributed.is_initialized() and get_parallel_state().world_size == 1


def test_a_tensor_parallel_llama_that_does_not_split_names_the_config_key() -> None:
    three = Group(None, (0, 1, 2), 0)  # shapes only: no process group is needed to build
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        LlamaForCausalLM(LlamaConfig(), tp=three)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        LlamaForCausalLM(LlamaConfig(num_attention_heads=6), tp=three)


def test_the_llama_loader_gives_a_tensor_parallel_rank_its_share_of_each_tensor() -> None:
    full = small_model("llama", layers=1)
    rank1 = LlamaForCausalLM(full.config, tp=Group(None, (0, 1), 1))
    names = {own: checkpoint for checkpoint, own in checkpoint_names(full).items()}
    load_llama_weights(rank1, ((names[name], t) for name, t in full.state_dict().items()))
    got, want = rank1.state_dict(), full.state_dict()
    for name in ("q_proj", "k_proj", "v_proj"):
        w = want[f"layers.0.self_attn.{name}.weight"]
        assert torch.equal(got[f"layers.0.self_attn.{name}.weight"], w[w.shape[0] // 2:])
    for name in ("gate_proj", "up_proj"):
        w = want[f"layers.0.mlp.{name}.weight"]
        assert torch.equal(got[f"layers.0.mlp.{name}.weight"], w[w.shape[0] // 2:])
    for name in ("layers.0.self_attn.o_proj.weight", "layers.0.mlp.down_proj.weight"):
        assert torch.equal(got[name], want[name][:, want[name].shape[1] // 2:])
    for name in ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layers.0.input_layernorm.weight"):
        assert torch.equal(got[name], want[name])


def test_one_rank_init_forms_no_groups_and_destroy_returns_to_one_process(tmp_path) -> None:
    state = init_parallel(ParallelConfig(), rank=0, world_size=1, init_method=f"file://{tmp_path / 'rdzv'}",
                          timeout_s=10)
    try:
        assert torch.distributed.is_initialized() and get_parallel_state() is state
        groups = [getattr(state, g) for g in ("world", "tp", "dp", "ep", "host")]
        assert state.world_size == 1 and all(g.pg is None for g in groups)
        assert agree([5], "min") == [5]
    finally:
        destroy_parallel()
    assert not torch.distributed.is_initialized() and get_parallel_state() == ParallelState()


def test_a_failure_while_forming_groups_leaves_nothing_initialised(tmp_path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("group forming failed")
    monkeypatch.setattr(state_module, "_member_group", broken)
    with pytest.raises(RuntimeError, match="group forming failed"):
        init_parallel(ParallelConfig(), rank=0, world_size=1, init_method=f"file://{tmp_path / 'rdzv'}")
    assert not torch.distributed.is_initialized() and get_parallel_state().world_size == 1


def _share(w: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
    n = w.shape[dim] // WORLD
    return w.narrow(dim, rank * n, n)


@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked_experts"])
def test_the_deepseek_loader_gives_a_tensor_parallel_rank_its_share_of_each_tensor(tmp_path, stacked) -> None:
    full = DeepseekForCausalLM(DeepseekConfig.from_dict(SMALL_JSON), seed=7)
    want = full.state_dict()
    tensors = hf_named_tensors(full)
    if stacked:
        tensors = {k: v for k, v in tensors.items() if ".experts." not in k}
        tensors.update({k: v.clone() for k, v in want.items() if ".experts." in k})
    write_checkpoint(tmp_path, tensors, shards=2)
    layer = "model.layers.{}."
    for rank in range(WORLD):
        model = load_deepseek(tmp_path, tp=Group(None, (0, 1), rank))
        got = model.state_dict()
        rows = [layer.format(0) + "self_attn.q_b_proj.weight", layer.format(0) + "self_attn.kv_b_proj.weight",
                layer.format(0) + "mlp.gate_proj.weight", layer.format(0) + "mlp.up_proj.weight",
                layer.format(1) + "mlp.shared_experts.gate_proj.weight",
                layer.format(1) + "mlp.shared_experts.up_proj.weight"]
        cols = [layer.format(0) + "self_attn.o_proj.weight", layer.format(0) + "mlp.down_proj.weight",
                layer.format(1) + "mlp.shared_experts.down_proj.weight"]
        for name in rows:
            assert torch.equal(got[name], _share(want[name], 0, rank)), name
        for name in cols:
            assert torch.equal(got[name], _share(want[name], 1, rank)), name
        experts = layer.format(1) + "mlp.experts."
        gate, up = want[experts + "gate_up_proj"].chunk(2, dim=1)
        assert torch.equal(got[experts + "gate_up_proj"], torch.cat([_share(gate, 1, rank), _share(up, 1, rank)], 1))
        assert torch.equal(got[experts + "down_proj"], _share(want[experts + "down_proj"], 2, rank))
        replicated = [n for n in want if any(part in n for part in (
            "q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "embed_tokens", "lm_head",
            "mlp.gate.", "layernorm", "model.norm"))]
        assert len(replicated) > 10
        for name in replicated:
            assert torch.equal(got[name], want[name]), name
        attn, c = model.model.layers[0].self_attn, full.config
        w_uk_t, w_uv = kv_b_parts(_share(want[layer.format(0) + "self_attn.kv_b_proj.weight"], 0, rank),
                                  c.num_attention_heads // WORLD, c.qk_nope_head_dim, c.v_head_dim)
        assert torch.equal(attn.w_uk_t, w_uk_t) and torch.equal(attn.w_uv, w_uv)  # this rank's heads'


@pytest.mark.parametrize("overrides, name", [
    ({}, "num_attention_heads=4"),
    ({"num_attention_heads": 6}, "intermediate_size=128"),
    ({"num_attention_heads": 6, "intermediate_size": 96}, "moe_intermediate_size=32"),
])
def test_a_tensor_parallel_deepseek_that_does_not_split_names_the_config_key(overrides, name) -> None:
    three = Group(None, (0, 1, 2), 0)  # shapes only: no process group is needed to build
    with pytest.raises(ValueError, match=name):
        DeepseekForCausalLM(DeepseekConfig.small(**overrides), init_weights=False, tp=three)


def test_a_groups_own_reduce_is_the_sum_all_reduce_and_other_ops_keep_torchs(monkeypatch) -> None:
    """vLLM's ``GroupCoordinator.all_reduce`` sits where ``Group.reduce`` does (tests/test_vllm_tensor_parallel.py
    runs the real one); here a recording stand-in shows the dispatch, traced fullgraph."""
    calls: list = []

    def reduce(x):
        calls.append(tuple(x.shape))
        return x * 2  # what a sum over 2 ranks holding the same x gives

    group = Group(None, (0, 1), 0, reduce=reduce)
    graphs: list = []
    compiled = torch.compile(lambda x: all_reduce(x + 1, group), backend=recording_backend(graphs, "eager"),
                             fullgraph=True)
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(compiled(x), (x + 1) * 2) and calls == [(2, 3)]  # traced once, through reduce
    assert not [n for n in graphs[0].graph.nodes if "_c10d_functional" in str(n.target)]
    funcol_ops: list = []
    from ascend_graph.distributed import collectives
    monkeypatch.setattr(collectives.funcol, "all_reduce", lambda t, op, pg: funcol_ops.append(op) or t)
    all_reduce(x, group, "max")
    assert funcol_ops == ["max"] and len(calls) == 1
    assert group == Group(None, (0, 1), 0)  # the callable is not part of a group's identity


def test_an_adopted_state_is_the_processes_and_destroy_leaves_its_groups_alone(monkeypatch) -> None:
    destroyed: list = []
    monkeypatch.setattr(state_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(state_module.dist, "destroy_process_group", lambda: destroyed.append(1))
    adopted = ParallelState(config=ParallelConfig(2), tp=Group(None, (0, 1), 1), collectives="someone else's")
    try:
        assert adopt_parallel(adopted) is adopted and get_parallel_state() is adopted
    finally:
        destroy_parallel()
    assert destroyed == [] and get_parallel_state() == ParallelState()
    monkeypatch.setattr(state_module._Holder, "owned", True)
    with pytest.raises(RuntimeError, match="init_parallel"):
        adopt_parallel(adopted)
