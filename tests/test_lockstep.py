"""Data-parallel graph runners decide each step together (``runner/lockstep.py``).

Two spawned ranks (gloo, 127.0.0.1, float32; tiny DeepSeek V3 with DP=2 and expert parallel, so
every MoE layer all-reduces across them) run ``distributed_lockstep.SCRIPT``: row counts that
differ (3 and 1 rows, one capture size), a prefill on one rank while the other decodes, an idle
rank; then compile failures injected on one rank. Oracle: the unsharded model's single-process
eager runner replaying each rank's own entries.
"""

from __future__ import annotations

import pytest
import torch

from distributed_lockstep import SCRIPT, eager_oracle, lockstep_checks
from distributed_ranks import run_ranks, small_deepseek
from runner_helpers import small_model

from ascend_graph.config import GraphConfig
from ascend_graph.distributed import ParallelState
from ascend_graph.runner import GraphRunner

pytestmark = pytest.mark.xdist_group("distributed")
DEADLINE_S = 120.0  # the ranks' group timeout; a disagreement would wait this long, then fail


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    init_file = tmp_path_factory.mktemp("lockstep") / "init"
    return run_ranks(lockstep_checks, 2, 500.0, str(init_file))


def test_every_rank_equals_its_single_process_eager_replay(ranks) -> None:
    model = small_deepseek("v3")  # the unsharded model
    for rank, result in enumerate(ranks):
        oracle = eager_oracle(model, result["steps"])
        for i, (step, want) in enumerate(zip(result["steps"], oracle)):
            got = torch.tensor(step["logits"])
            if want is None:
                assert got.numel() == 0, (rank, i)
                continue
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"rank {rank} step {i} {step['action']}")


def test_one_and_three_rows_run_the_same_capture_size(ranks) -> None:
    # step 1: rank 0 decodes 3 rows, rank 1 one row: both run size 4
    zero, one = (r["stats"] for r in ranks)
    assert SCRIPT[1] == ("decode", "decode")
    assert zero["graph_sizes_run"]["4"] >= 1 and one["graph_sizes_run"]["4"] >= 1
    # rank 1 never has more than 2 rows: every size-4 step it ran was padded for rank 0
    assert max(len(s["entries"]) for s in ranks[1]["steps"]) <= 2


def test_a_prefill_on_one_rank_makes_every_rank_eager(ranks) -> None:
    zero, one = (r["stats"] for r in ranks)
    assert zero["eager_steps"].get("dp_peer") == 1  # step 2: rank 1's prefill
    assert one["eager_steps"].get("prefill") == 2
    assert zero["eager_steps"].get("prefill") == 1


def test_an_idle_rank_runs_the_others_step_on_padding(ranks) -> None:
    assert SCRIPT[4] == ("decode", "idle") and SCRIPT[5] == ("idle", "decode")
    for rank, result in enumerate(ranks):
        stats = result["stats"]
        assert stats["idle_steps"] == 1, rank
        assert stats["graph_steps"] == 3, (rank, stats)  # steps 1, 3 and its busy one of 4, 5
        groups = {c["compile_group"] for c in stats["capture"].values()}
        assert stats["recompiles"] == 0 and stats["compiles"] == len(groups), (rank, stats)
    # step 4: rank 0's 3 rows, size 4; step 5: rank 1's 2 rows, size 2, rank 0 on padding alone
    assert [len(s["entries"]) for s in ranks[1]["steps"]][4:] == [0, 2]
    assert [len(s["entries"]) for s in ranks[0]["steps"]][4:] == [3, 0]
    assert all(r["stats"]["graph_sizes_run"] == {"2": 1, "4": 3} for r in ranks), [r["stats"] for r in ranks]


def test_a_size_that_fails_to_compile_on_one_rank_is_dropped_on_every_rank(ranks) -> None:
    zero, one = ranks[0]["dropped"], ranks[1]["dropped"]
    assert zero["graph_sizes"] == one["graph_sizes"] == [2]
    assert "injected compile failure of size 4 on rank 1" in one["stats"]["compile_errors"]["4"]
    assert zero["stats"]["compile_errors"]["4"] == "RankFailure: compiling a decode graph failed on rank(s) [1]"
    model = small_deepseek("v3")
    for result in (zero, one):
        assert result["stats"]["eager_steps"] == {"prefill": 1, "compile_failed": 1}
        assert result["seconds"] < DEADLINE_S
        for step, want in zip(result["steps"], eager_oracle(model, result["steps"])):
            torch.testing.assert_close(torch.tensor(step["logits"]), want, rtol=1e-5, atol=1e-5)


def test_a_failed_compile_without_fallback_raises_on_every_rank_in_time(ranks) -> None:
    zero, one = ranks[0]["raised"], ranks[1]["raised"]
    assert zero["raised"] == one["raised"] == "GraphCompileError"
    assert "injected compile failure of size 4 on rank 0" in zero["message"]
    assert "failed on rank(s) [0]" in one["message"]
    assert max(zero["seconds"], one["seconds"]) < DEADLINE_S


def test_one_process_runs_without_agreement() -> None:
    runner = GraphRunner(small_model("llama"), GraphConfig(enabled=False), num_blocks=8, max_model_len=32)
    assert runner.parallel == ParallelState()
    with pytest.raises(ValueError, match="seqs must hold at least one"):
        runner.execute([])  # only a data-parallel rank may be idle
