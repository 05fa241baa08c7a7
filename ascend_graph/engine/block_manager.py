"""Block manager: hands out cache blocks to sequences and takes them back.

Block ``NULL_BLOCK`` is never handed out. Host-side bookkeeping only; it never touches tensors.
A sequence's table is an int32 ``array.array`` (a ``Sequence[int]``) grown in place:
a step's metadata copies it with one memcpy instead of converting every Python int
(``attention.metadata.build_attention_metadata``).
"""

from __future__ import annotations

from array import array
from collections import deque

from ..attention.metadata import INT32_TYPECODE
from ..kv_cache import NULL_BLOCK


class OutOfBlocks(RuntimeError):
    """Raised when a request needs more blocks than are free."""


class BlockManager:
    """Per-sequence block tables over ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2 or block_size < 1:
            raise ValueError(f"need num_blocks >= 2 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._free = deque(b for b in range(num_blocks) if b != NULL_BLOCK)
        self._tables: dict[object, array] = {}

    @property
    def num_free(self) -> int:
        """Blocks not owned by any sequence."""
        return len(self._free)

    def blocks_needed(self, seq_id: object, num_tokens: int) -> int:
        """Extra blocks ``seq_id`` needs to hold ``num_tokens`` tokens in all."""
        have = len(self._tables.get(seq_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_hold(self, seq_id: object, num_tokens: int) -> bool:
        """Whether growing ``seq_id`` to ``num_tokens`` tokens fits in the free blocks."""
        return self.blocks_needed(seq_id, num_tokens) <= len(self._free)

    def ensure(self, seq_id: object, num_tokens: int) -> array:
        """Grow ``seq_id``'s block table to hold ``num_tokens`` tokens; returns the table."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} more blocks for {num_tokens} tokens, "
                              f"{len(self._free)} are free")
        table = self._tables.setdefault(seq_id, array(INT32_TYPECODE))
        table.extend(self._free.popleft() for _ in range(need))
        return table

    def table(self, seq_id: object) -> array:
        """The block table of ``seq_id``."""
        return self._tables[seq_id]

    def rename(self, seq_id: object, new_id: object) -> None:
        """Move ``seq_id``'s blocks to ``new_id`` (which must own none), leaving ``seq_id`` with none."""
        if new_id in self._tables:
            raise ValueError(f"sequence {new_id!r} already owns blocks")
        self._tables[new_id] = self._tables.pop(seq_id, array(INT32_TYPECODE))

    def free(self, seq_id: object) -> None:
        """Return all blocks of ``seq_id``."""
        self._free.extend(self._tables.pop(seq_id, ()))
