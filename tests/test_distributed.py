"""The distributed package: process groups, traceable collectives and host-side agreement.

Two ranks are spawned once for the module (gloo on 127.0.0.1, float32) and run every
multi-process check in one go (``distributed_ranks.collective_checks``); the tests below read
their results against a single-process oracle. The rest runs in this process, where nothing is
initialised and the package is the single-process case.
"""

from __future__ import annotations

import pytest
import torch

from distributed_ranks import (STEPS, collective_checks, collective_step, free_ports, rank_input,
                               recording_backend, run_ranks)
from ascend_graph.distributed import (ParallelConfig, RankFailure, agree, all_or_none, get_parallel_state,
                                      group_ranks, init_parallel)

pytestmark = pytest.mark.xdist_group("distributed")

WORLD = 2
DEADLINE_S = 3.0
GRACE_S = 2.0  # beyond a deadline, for the failure to be reported
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    """Each rank's results of ``collective_checks``."""
    return run_ranks(collective_checks, WORLD, 240.0, free_ports(2), DEADLINE_S)


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
