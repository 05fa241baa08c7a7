"""A vLLM step's metadata in the runner's terms, without vLLM.

Oracle: a mixed step written out by hand as vLLM lays it out (decodes first, a padded block
table, spans in ``query_start_loc``), and the SequenceSteps and logits rows it must give.
"""

from types import SimpleNamespace

import torch

from ascend_graph.runner import SequenceStep
from ascend_graph.vllm.steps import logits_at_last_tokens, sequence_steps

# Two decodes (lengths 17 and 5 after this step), then a 3-token prefill; block size 16.
# The table has a padding row and padding columns, as vLLM's persistent buffers do.
MIXED = SimpleNamespace(
    num_reqs=3,
    query_start_loc_cpu=torch.tensor([0, 1, 2, 5, 5], dtype=torch.int32),
    seq_lens=torch.tensor([17, 5, 3, 0], dtype=torch.int32),
    block_table_tensor=torch.tensor([[4, 9, 0, 0], [7, 0, 0, 0], [2, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.int32),
)
TOKENS = [11, 12, 21, 22, 23]


def test_each_request_brings_its_span_its_cached_count_and_the_blocks_its_length_needs():
    assert sequence_steps(TOKENS, MIXED, block_size=16) == [
        SequenceStep([11], 16, [4, 9]),  # position 16 starts the second block
        SequenceStep([12], 4, [7]),
        SequenceStep([21, 22, 23], 0, [2]),
    ]


def test_each_requests_logits_land_on_its_last_token_and_nowhere_else():
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    out = logits_at_last_tokens(logits, MIXED, num_tokens=5)
    assert torch.equal(out, torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 0.0], [0.0, 0.0], [5.0, 6.0]]))


# Three decodes (lengths 1, 16 and 33 after this step: 1, 1 and 3 blocks of 16), a padded table.
DECODES = SimpleNamespace(
    num_reqs=3,
    query_start_loc_cpu=torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32),
    seq_lens=torch.tensor([1, 16, 33, 0], dtype=torch.int32),
    block_table_tensor=torch.tensor([[5, 0, 0, 0], [6, 0, 0, 0], [1, 2, 3, 0], [0, 0, 0, 0]], dtype=torch.int32),
)


def test_a_decode_only_step_gives_one_token_per_request_and_its_blocks():
    steps = sequence_steps([40, 41, 42], DECODES, block_size=16)
    assert steps == [SequenceStep([40], 0, [5]), SequenceStep([41], 15, [6]), SequenceStep([42], 32, [1, 2, 3])]
    assert all(type(b) is int for s in steps for b in s.block_table)  # host ints, no tensors


def test_one_token_per_request_passes_the_logits_through_uncopied():
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    assert logits_at_last_tokens(logits, DECODES, num_tokens=3) is logits
