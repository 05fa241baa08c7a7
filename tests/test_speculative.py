"""Greedy speculative decoding with the MTP layer (``Engine(..., num_speculative_tokens=1)``).

Oracle: the same model served without speculation, eagerly. Random weights accept almost no
draft, so the MTP layer's drafts are also replaced (after it has run and written its cache) by a
drafter forced right (the reference's next token: every draft accepted) or forced wrong (none
accepted; ``benchmarks.speculative.forced_drafter``, which the benchmark's ceiling runs): the tokens must be the reference's in all three, graph and eager, and graph and eager
must accept the same drafts. The drafts themselves must be those of one MTP pass over each
finished sequence (no stale cache entry read, the right token after each position).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.speculative import DRAFTERS, forced_drafter, set_right

from ascend_graph import Engine, allocate_kv_caches
from ascend_graph.attention import build_attention_metadata
from ascend_graph.config import GraphConfig
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM

PROMPTS = [[1, 5, 9, 3, 200], [7, 2, 8], [4, 4, 6, 1, 2, 9, 10, 11, 30]]
BUDGETS = [13, 9, 6]  # requests leave at different steps: the verify batch shrinks 3 -> 2 -> 1 requests
MAX_LEN = 64


def _model() -> DeepseekForCausalLM:
    return DeepseekForCausalLM(DeepseekConfig.small_v3(), mtp_layers=1)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return Engine(_model(), graph_config=GraphConfig(enabled=False), max_model_len=MAX_LEN).generate(
        PROMPTS, BUDGETS, ignore_eos=True)


def _serve(graph: bool, reference) -> tuple[dict, dict]:
    """Per drafter: (tokens, the engine's speculative counters), and the runner's counters."""
    model = _model()
    forced_drafter(model, MAX_LEN)
    assert set_right(model, [p + r for p, r in zip(PROMPTS, reference)]) == 0  # every key one request's
    config = GraphConfig(enabled=graph, backend="inductor", max_batch_size=4, capture_sizes=(1, 2, 4))
    engine = Engine(model, graph_config=config, num_speculative_tokens=1, max_model_len=MAX_LEN)
    out = {}
    for name, code in DRAFTERS.items():
        model.drafter.fill_(code)
        before = dict(engine.stats["speculative"])
        tokens = engine.generate(PROMPTS, BUDGETS, ignore_eos=True)
        after = engine.stats["speculative"]
        drafted, accepted = (after[k] - before[k] for k in ("drafted_tokens", "accepted_tokens"))
        out[name] = (tokens, drafted, accepted, after["verify_steps"] - before["verify_steps"])
    return out, engine.stats


@pytest.fixture(scope="module")
def served(reference, one_torch_thread):
    return {"eager": _serve(False, reference), "graph": _serve(True, reference)}


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_every_drafter_gives_the_tokens_of_decoding_without_speculation(served, reference, mode) -> None:
    for name, (tokens, *_) in served[mode][0].items():
        assert tokens == reference, name


def test_graph_and_eager_accept_the_same_drafts_and_forced_drafters_bound_it(served) -> None:
    graph, eager = served["graph"][0], served["eager"][0]
    assert {n: r[1:] for n, r in graph.items()} == {n: r[1:] for n, r in eager.items()}
    _, drafted, accepted, steps = graph["right"]
    assert accepted == drafted > 0  # every verified draft was the next token
    assert steps < graph["wrong"][3]  # two tokens per verify step: fewer steps
    assert graph["wrong"][2] == 0
    assert graph["wrong"][3] == max(BUDGETS) - 1  # one token per step, as without speculation


def test_verify_steps_run_as_graphs_of_two_rows_per_request_without_recompiles(served) -> None:
    stats = served["graph"][1]
    assert stats["recompiles"] == 0 and stats["compile_failures"] == 0
    assert set(stats["eager_steps"]) == {"prefill"}  # every decode step verified as a graph
    assert set(stats["graph_sizes_run"]) <= {"2", "4", "8"} and "8" in stats["graph_sizes_run"]
    assert stats["graph_steps"] == sum(r[3] for r in served["graph"][0].values())


@torch.no_grad()
def test_the_drafts_are_one_mtp_pass_over_each_finished_sequence(reference) -> None:
    """The engine's MTP drafts (its own, recorded per verify step) against the MTP layer run once
    over each whole sequence with the token after every position: equal wherever a verify step
    used a draft, so no rejected row's stale cache entry was read and each row had its token."""
    model = _model()
    engine = Engine(model, graph_config=GraphConfig(enabled=False), num_speculative_tokens=1, max_model_len=MAX_LEN)
    seen: list[tuple[int, int, int]] = []  # (request, position drafted for, draft)
    decode_entries = engine.spec.decode_entries

    def record(scheduler, batch):
        entries = decode_entries(scheduler, batch)
        seen.extend((r.index, entries[2 * i + 1].num_cached, r.draft) for i, r in enumerate(batch))
        return entries

    engine.spec.decode_entries = record
    assert engine.generate(PROMPTS, BUDGETS, ignore_eos=True) == reference
    assert len(seen) > 10
    for index, position, draft in seen:
        seq = PROMPTS[index] + reference[index]
        caches = allocate_kv_caches(model.kv_cache_specs(), 8, 16)
        # the draft for ``position`` is the MTP row at position - 2, whose token after is seq[position - 1]
        positions, meta = build_attention_metadata([[1, 2, 3, 4]], [0], [position - 1], block_size=16,
                                                   num_blocks=8, max_model_len=MAX_LEN)
        hidden = model(torch.tensor(seq[:position - 1]), positions, caches, meta)
        h = model.mtp_predict(torch.tensor(seq[1:position]), positions, hidden, caches, meta)
        assert model.compute_mtp_logits(h[-1:]).argmax(-1).item() == draft, (index, position)


def test_bad_speculation_settings_name_the_argument() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens=1 needs a model with an MTP layer"):
        Engine(DeepseekForCausalLM(DeepseekConfig.small_v3()), num_speculative_tokens=1)
    with pytest.raises(ValueError, match="num_speculative_tokens=2: one draft token per step"):
        Engine(_model(), num_speculative_tokens=2)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an int >= 0"):
        Engine(_model(), num_speculative_tokens=-1)
    engine = Engine(_model(), graph_config=GraphConfig(enabled=False), num_speculative_tokens=1, max_model_len=16)
    with pytest.raises(ValueError, match="temperature must be 0"):
        engine.generate([[1, 2]], 3, temperature=0.7)
    with pytest.raises(ValueError, match=r"max_new_tokens=14 \+ num_speculative_tokens=1 = 17 exceeds max_model_len=16"):
        engine.generate([[1, 2]], 14)
    assert len(engine.generate([[1, 2]], 13, ignore_eos=True)[0]) == 13  # 2 + 13 + 1 draft slot fits
