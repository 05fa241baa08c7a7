"""Shared by the attention tests: sequences kept contiguous by the test, written into a paged
cache through shuffled, non-contiguous block tables; the ops are compared with float64 oracles
computed from the contiguous copies (never from the cache)."""

from typing import NamedTuple

import torch

from ascend_graph.attention import build_attention_metadata
from ascend_graph.kv_cache import NULL_BLOCK, write_kv_cache

S = 4  # block size: small, so that ragged lengths cross many block boundaries
MAX_LEN = 64


class MLADims(NamedTuple):
    H: int
    Dn: int
    R: int
    Dv: int
    C: int


SMALL = MLADims(H=4, Dn=16, R=8, Dv=16, C=32)
V2_LITE = MLADims(H=16, Dn=128, R=64, Dv=128, C=512)



def _tables(gen, lens, num_blocks, block_size=S):
    """Each sequence gets distinct block ids, drawn in random order from all live blocks."""
    ids = (torch.randperm(num_blocks - 1, generator=gen) + NULL_BLOCK + 1).tolist()
    tables, used = [], 0
    for n in lens:
        k = -(-n // block_size)
        tables.append(ids[used:used + k])
        used += k
    assert used < num_blocks - 1, "leave spare blocks so that tables are not contiguous"
    return tables


def _slots(table, start, stop, block_size=S):
    """Slots of positions [start, stop) by hand: block id * block_size + offset in the block."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def _write_prefix(cache, tables, seqs, counts, block_size=S):
    """Write the first ``counts[i]`` tokens of sequence ``i`` (seqs[i] = (a [L, ..], b [L, ..]))."""
    slots = [s for t, n in zip(tables, counts) for s in _slots(t, 0, n, block_size)]
    if slots:
        a = torch.cat([sa[:n] for (sa, _), n in zip(seqs, counts)])
        b = torch.cat([sb[:n] for (_, sb), n in zip(seqs, counts)])
        write_kv_cache(cache, a, b, torch.tensor(slots))


def _new_tokens(seqs, cached, new):
    a = torch.cat([sa[c:c + n] for (sa, _), c, n in zip(seqs, cached, new)])
    b = torch.cat([sb[c:c + n] for (_, sb), c, n in zip(seqs, cached, new)])
    return a, b


def _metadata(tables, cached, new, num_blocks, width=None):
    return build_attention_metadata(tables, cached, new, block_size=S, num_blocks=num_blocks,
                                    max_model_len=MAX_LEN, block_table_width=width)


def _ragged_lens(gen, batch):
    """Random lengths, plus the block-boundary cases: 1, exactly one block, one past it."""
    lens = torch.randint(2, 3 * S * 2, (batch,), generator=gen).tolist()
    lens[:3] = [1, S, S + 1]
    return lens


def _assert_matches(out, ref, rel_atol):
    """``out`` within ``rel_atol * max|ref|`` of the float64 oracle, element-wise."""
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=rel_atol * ref.abs().max().item())
