"""The parity rules themselves: the per-row tolerance and the near-tie rule for separate runs.

Oracles: hand-built logits whose differences are known; and, through the CLI, the bfloat16
model that the former per-element rule failed although graph and eager each erred about as much
against a float64 run (parity.py gives the figures).
"""

from __future__ import annotations

import pytest
import torch

from ascend_graph.cli.commands import logit_agreement
from ascend_graph.runner.parity import _close_rows, allowed_difference, tolerances


def test_tolerance_scales_with_the_rows_largest_value_not_each_element():
    eager = torch.tensor([[3.0, 0.01, -0.5], [0.2, 0.1, 0.0]])
    atol, rtol = tolerances(torch.bfloat16)
    allowed = allowed_difference(eager, atol, rtol).flatten().tolist()
    assert allowed == pytest.approx([atol + rtol * 3.0, atol + rtol * 0.2], rel=1e-6)
    near_zero = eager.clone()
    near_zero[0, 1] += 0.09  # within 0.05 + 0.02 * 3 of the first row, far beyond 0.05 + 0.02 * 0.01
    assert bool(_close_rows(near_zero, eager, atol, rtol).all())
    too_far = eager.clone()
    too_far[1, 2] += 0.06  # the second row's largest value is 0.2: 0.054 allowed
    assert not bool(_close_rows(too_far, eager, atol, rtol).all())
    assert not bool(_close_rows(eager + float("nan"), eager, atol, rtol).all())
    assert not bool(_close_rows(eager + 1e-3, eager, *tolerances(torch.float32)).all())


def _logits(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows)


def test_identical_tokens_agree_and_differences_count_up_to_the_first_split():
    a = [_logits([[1.0, 0.0], [0.0, 1.0]])]
    b = [_logits([[1.0, 0.01], [0.0, 1.0]])]
    r = logit_agreement([[0, 1]], [[0, 1]], a, b, torch.float32)
    assert r["tokens_identical"] and r["tokens_agree"] and r["first_differences"] == []
    assert r["max_logit_diff"] == pytest.approx(0.01, rel=1e-6) and r["logit_rows_compared"] == 2


def test_a_split_is_a_near_tie_only_within_twice_the_rows_tolerance():
    # position 1: graph picks token 0 by 0.02, eager token 1 by 0.03; bfloat16 allows 0.05 + 0.02 * 2
    graph = [_logits([[2.0, 0.0], [1.02, 1.0], [9.0, 0.0]])]
    eager = [_logits([[2.0, 0.0], [1.0, 1.03], [0.0, 9.0]])]
    r = logit_agreement([[0, 0, 0]], [[0, 1, 1]], graph, eager, torch.bfloat16)
    (split,) = r["first_differences"]
    assert split["position"] == 1 and split["tokens"] == [0, 1] and split["near_tie"]
    assert [round(m, 5) for m in split["margins"]] == [0.02, 0.03]
    assert r["tokens_agree"] and not r["tokens_identical"]
    assert r["logit_rows_compared"] == 2  # the third row follows another prefix: not compared
    r = logit_agreement([[0, 0, 0]], [[0, 1, 1]], graph, eager, torch.float32)  # 1e-4 + 1e-4 * 1.03 each way
    assert not r["tokens_agree"] and not r["first_differences"][0]["near_tie"]
    far = [_logits([[2.0, 0.0], [1.0, 1.3], [0.0, 9.0]])]  # margins 0.02 + 0.3 > 2 * (0.05 + 0.026)
    assert not logit_agreement([[0, 0, 0]], [[0, 1, 1]], graph, far, torch.bfloat16)["tokens_agree"]


def test_a_split_after_a_reproduced_routing_near_tie_of_that_request_agrees():
    """A split beyond tolerance agrees only where the graph run reproduced a router near-tie at or
    before the split's step (``Engine.generate_checked`` gives each request's position there)."""
    graph = [_logits([[2.0, 0.0], [3.0, 0.0], [9.0, 0.0]])]
    eager = [_logits([[2.0, 0.0], [0.0, 3.0], [0.0, 9.0]])]  # position 1: 3.0 apart both ways
    split = lambda flips: logit_agreement([[0, 0, 0]], [[0, 1, 1]], graph, eager, torch.bfloat16, flips)  # noqa: E731
    assert not split([])["tokens_agree"]
    for flips, agree in (([{"positions": {0: 1}}], True), ([{"positions": {0: 0, 1: 4}}], True),
                         ([{"positions": {0: 2}}], False), ([{"positions": {1: 0}}], False)):
        r = split(flips)
        assert r["tokens_agree"] is agree and r["first_differences"][0]["after_routing_near_tie"] is agree, flips
        assert not r["first_differences"][0]["near_tie"]


# -- routing near-ties ------------------------------------------------------------------------


def _flip_case(monkeypatch, swap=None, bump=None, grouped=False):
    """A bf16 MLA + MoE runner at a 3-sequence decode step whose first router (``model.layers.1``)
    scores all experts within rounding of each other (every token at a near-tie there), and a
    stand-in "graph": the eager step with ``swap = (router index, token[, kind])``'s K-th expert
    replaced by its (K+1)-th (or, ``kind`` "groups", its last group by the next), ``bump = (token,
    value)`` added to that token's logits. ``grouped``: the V3-shaped model, whose routers pick
    within their 2 best of 4 groups (then every group is near-tied too). Returns ``(report,
    stand-in's caches after, routers, margins {(router, token): margin / its row's largest choice})``
    (the experts' margins)."""
    from ascend_graph.runner import parity
    from ascend_graph.config import GraphConfig
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
    from tests.runner_helpers import Schedule, make_runner, prefilled, small_model

    if grouped:
        torch.manual_seed(0)
        model = DeepseekForCausalLM(DeepseekConfig.small_v3()).to(torch.bfloat16).eval()
    else:
        model = small_model("mla", dtype=torch.bfloat16, layers=3)  # two routers
    routers = parity._routers(model)
    assert [name for name, _ in routers] == ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    flat = routers[0][1].weight
    with torch.no_grad():
        flat.copy_(flat[:1] + 1e-5 * torch.randn(flat.shape, generator=torch.Generator().manual_seed(1)))
    runner = make_runner(model, GraphConfig(enabled=False))
    sched = Schedule()
    prefilled(runner, sched, 3, model.config.vocab_size)
    step = runner.prepare(sched.decode_entries())
    eager = runner.run_prepared
    every = []
    with parity._routing(routers, float("inf"), near=every):
        eager(step, "eager")
    margins = {(n["router"], n["token"]): n["margin"] for n in every if "experts" in n}
    stand_in = {}

    def run_prepared(step, mode):
        if mode == "eager":
            return eager(step, mode)
        with parity._routing(routers, 0.0, swap=swap):
            logits = eager(step, "eager")
        stand_in["caches"] = [[t.clone() for t in cache] for cache in runner.kv_caches]
        if bump is not None:
            logits = logits.clone()
            logits[bump[0]] += bump[1]
        return logits

    monkeypatch.setattr(runner, "run_prepared", run_prepared)
    return parity.compare_prepared(runner, step), stand_in["caches"], runner, margins


def test_a_graph_that_took_a_near_tied_expert_passes_with_the_flip_reported(monkeypatch):
    """The stand-in graph swapped token 0's second expert at the flattened router: its logits and
    cache blocks are beyond tolerance of eager's, yet eager with that same swap reproduces them, so
    the step passes and names the flip; the caches end as after the graph step."""
    plain, *_ = _flip_case(monkeypatch)
    assert plain.ok and plain.routing_flips == []
    report, graph_caches, runner, margins = _flip_case(monkeypatch, swap=(0, 0))
    assert report.ok, report.summary()  # flips are looked for only where a token is beyond tolerance
    assert [(f["token"], f["router"]) for f in report.routing_flips] == [(0, "model.layers.1.mlp.gate")]
    assert report.routing_flips[0]["margin"] == pytest.approx(margins[(0, 0)])
    assert all(torch.equal(t, g) for cache, saved in zip(runner.kv_caches, graph_caches) for t, g in zip(cache, saved))
    assert "1 routing near-tie(s) reproduced" in report.summary()


def test_a_flip_that_is_no_near_tie_or_leaves_a_difference_is_a_mismatch(monkeypatch):
    """Swapping where the router was not at a near-tie (the second router, its widest margin), or
    a near-tie swap with another token's logits off (a real defect beside it) or its own, fails the step."""
    *_, margins = _flip_case(monkeypatch)
    router, token = max((k for k in margins if k[0] == 1), key=margins.get)
    assert margins[(router, token)] > 0.05  # no near-tie by the bf16 rule (rtol 0.02 of a row's largest choice)
    report, *_ = _flip_case(monkeypatch, swap=(router, token))
    assert report.logits["max_abs"] > 0.1 and not report.ok and report.routing_flips == []
    for bumped in (2, 0):
        report, *_ = _flip_case(monkeypatch, swap=(0, 0), bump=(bumped, 0.5))
        assert not report.ok and report.routing_flips == []


def test_a_graph_that_took_a_near_tied_group_passes_with_the_group_flip_reported(monkeypatch):
    """V3's grouped routing: the stand-in graph gave token 0 its third-best group instead of its
    second at the flattened router, so different experts ran; eager with that same group swap
    reproduces it, and no expert swap does. Without groups in the near-tie rule this step failed
    (the case behind it: ``ascend-graph parity --model small-v3 --dtype bfloat16 --backend inductor
    --capture-sizes 1,4``, step 15, a group margin of 8.6e-4 of the row's largest)."""
    plain, *_ = _flip_case(monkeypatch, grouped=True)
    assert plain.ok and plain.routing_flips == []
    report, graph_caches, runner, _ = _flip_case(monkeypatch, swap=(0, 0, "groups"), grouped=True)
    assert report.logits["max_abs"] > 0.5  # the swap ran other experts: far beyond tolerance
    assert report.ok, report.summary()  # flips are looked for only where a token is beyond tolerance
    assert [(f["token"], f["router"], "groups" in f) for f in report.routing_flips] == [
        (0, "model.layers.1.mlp.gate", True)]
    assert all(torch.equal(t, g) for cache, saved in zip(runner.kv_caches, graph_caches) for t, g in zip(cache, saved))
    # the same swap with another token's logits off is a mismatch
    report, *_ = _flip_case(monkeypatch, swap=(0, 0, "groups"), bump=(1, 0.5), grouped=True)
    assert not report.ok and report.routing_flips == []


def test_a_group_swap_is_tried_only_where_the_groups_are_near_tied():
    """Groups far apart record no group near-tie; within ``rtol`` of the row's largest group score
    they do, naming the last chosen group and the next."""
    from ascend_graph.runner import parity
    from ascend_graph.models import DeepseekConfig
    from ascend_graph.moe import Router

    router = Router(DeepseekConfig.small_v3())
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, 0] = torch.tensor([4.0, 3.9, 2.0, 1.9, 0.0, -0.1, -2.0, -2.1])  # groups of 2
        router.weight[:, 1] = torch.tensor([4.0, 3.9, 2.0, 1.9, 1.95, 1.96, -2.0, -2.1])  # groups 1, 2 level
    x = torch.eye(2, router.weight.shape[1])  # token 0 by the first pattern, token 1 by the second
    near = []
    with parity._routing([("gate", router)], 0.02, near=near):
        router(x)
    groups = [n for n in near if "groups" in n]
    assert [(n["token"], n["groups"]) for n in groups] == [(1, [2, 1])]  # sigmoid sums 1.752 and 1.751
    assert not [n for n in near if "experts" in n]  # the experts within the groups are far apart
    every_group = Router(DeepseekConfig.small_v3(topk_group=4))  # all 4 groups kept: no group to swap
    every_group.load_state_dict(router.state_dict())
    near = []
    with parity._routing([("gate", every_group)], 0.02, near=near):
        every_group(x)
    assert not [n for n in near if "groups" in n]


# -- blocks a step must not touch --------------------------------------------------------------


def test_parity_sampling_catches_a_graph_step_that_writes_a_block_it_must_not():
    """A broken graph step (its backend adds 1 to sequence 2's first block of layer 1's ``v``
    after every 2-row step, a sequence outside the batch) passes the logits and written-block
    comparison, yet each sampled check fails, counted, and names the block; the same check with
    a copy of the cache names the same block."""
    from ascend_graph.config import GraphConfig
    from ascend_graph.runner.parity import compare_step
    from tests.runner_helpers import Schedule, make_runner, prefilled, small_model

    victim = {"block": None}

    def corrupting(gm, example_inputs, **kwargs):
        def run(*args):
            out = gm(*args)
            if victim["block"] is not None:
                runner.kv_caches[1].v[victim["block"]] += 1
            return out
        return run

    model = small_model("llama")
    config = GraphConfig(enabled=True, backend="aot_eager", capture_sizes=(2,), max_batch_size=2, parity_interval=2)
    runner, sched = make_runner(model, config, backend=corrupting), Schedule()
    prefilled(runner, sched, 3, model.config.vocab_size)

    def decode(steps: int) -> None:
        for _ in range(steps):
            entries = sched.decode_entries()[:2]  # sequences 0 and 1
            sched.advance([0, 1], entries, runner.execute(entries))

    decode(2)
    assert (runner.stats.parity_checks, runner.stats.parity_failures) == (1, 0)  # the step itself is right
    victim["block"] = block = sched.blocks.table(2)[0]
    decode(4)
    assert (runner.stats.graph_steps, runner.stats.parity_checks, runner.stats.parity_failures) == (6, 3, 2)
    assert f"layer 1 v blocks [{block}]" in runner.stats.last_parity_failure
    for mode in ("digest", "copy"):
        report = compare_step(runner, sched.decode_entries()[:2], check_untouched=mode)
        assert not report.ok and report.untouched_ok is False and report.untouched_check == mode
        assert report.untouched_changed == [{"layer": 1, "element": "v", "blocks": [block]}]
        assert report.logits["max_abs"] < 1e-4  # only the untouched-blocks check sees it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8])
def test_a_block_digest_changes_with_any_one_element_and_only_that_blocks(dtype):
    """Oracle: the block changed by construction. Every bit of one element, in turn, flipped in
    a block of a cache tensor ``[blocks, block_size, heads, dim]``: exactly that block's digest
    changes. A NaN stays equal to itself; -0.0 differs from 0.0 (bits, not values)."""
    from ascend_graph.runner.block_digest import tensor_digest

    gen = torch.Generator().manual_seed(0)
    cache = (torch.randn(5, 4, 2, 3, generator=gen) * 50).to(dtype)
    before = tensor_digest(cache)
    unit = torch.int16 if cache.element_size() % 2 == 0 else torch.uint8
    for lane in range(cache.view(unit).shape[-1]):  # 3 * units per element
        for bit in range(unit.itemsize * 8):
            changed = cache.clone()
            word = changed.view(unit)[3, 2, 1, lane:lane + 1]
            word ^= torch.tensor(1 << bit).to(unit)  # the top bit wraps to the unit's sign bit
            assert (tensor_digest(changed) != before).any(dim=1).nonzero().flatten().tolist() == [3], (lane, bit)
    if dtype.is_floating_point:
        nan = torch.zeros(2, 3, dtype=dtype)
        nan[1, 0] = float("nan")
        assert torch.equal(tensor_digest(nan), tensor_digest(nan.clone()))
        signed = nan.clone()
        signed[0, 1] = -0.0
        assert (tensor_digest(signed) != tensor_digest(nan)).any(dim=1).tolist() == [True, False]
