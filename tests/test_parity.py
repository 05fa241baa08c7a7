"""The parity rules themselves: the per-row tolerance and the near-tie rule for separate runs.

Oracles: hand-built logits whose differences are known; and, through the CLI, the bfloat16
model that the former per-element rule failed although graph and eager each erred about as much
against a float64 run (parity.py gives the figures).
"""

from __future__ import annotations

import pytest
import torch

from ascend_graph.commands import logit_agreement
from ascend_graph.parity import _close, allowed_difference, tolerances


def test_tolerance_scales_with_the_rows_largest_value_not_each_element():
    eager = torch.tensor([[3.0, 0.01, -0.5], [0.2, 0.1, 0.0]])
    atol, rtol = tolerances(torch.bfloat16)
    allowed = allowed_difference(eager, atol, rtol).flatten().tolist()
    assert allowed == pytest.approx([atol + rtol * 3.0, atol + rtol * 0.2], rel=1e-6)
    near_zero = eager.clone()
    near_zero[0, 1] += 0.09  # within 0.05 + 0.02 * 3 of the first row, far beyond 0.05 + 0.02 * 0.01
    assert _close(near_zero, eager, atol, rtol)
    too_far = eager.clone()
    too_far[1, 2] += 0.06  # the second row's largest value is 0.2: 0.054 allowed
    assert not _close(too_far, eager, atol, rtol)
    assert not _close(eager + float("nan"), eager, atol, rtol)
    assert not _close(eager + 1e-3, eager, *tolerances(torch.float32))


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
