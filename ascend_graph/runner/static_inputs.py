"""The decode graphs' static inputs: one buffer per step input, rows for the largest capture size.

The graph of capture size ``s`` reads the buffers' first ``s`` rows: views marked as static
addresses, their batch dimension dynamic where the size's compile group shares one graph. A step
writes its ``n`` live rows in place and rows ``n:s`` with ``DECODE_PADDING`` (``pad_decode``'s
rows), so a smaller batch after a larger one never replays the larger one's rows.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..attention import AttentionMetadata, DecodeMetadata
from ..attention.metadata import DECODE_PADDING
from .groups import CompileGroup, mark_batch_dynamic


class StaticInputs:
    """``buffers``: input ids, positions and slots ``[S]`` int64, block tables ``[S, M]`` and
    context lengths ``[S]`` int32, ``S`` the largest capture size, ``M`` the block-table width."""

    def __init__(self, max_size: int, table_width: int, device: torch.device) -> None:
        z = lambda *shape, dtype=torch.int64: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        self.buffers = {"input_ids": z(max_size), "positions": z(max_size), "slot_mapping": z(max_size),
                        "block_tables": z(max_size, table_width, dtype=torch.int32),
                        "context_lens": z(max_size, dtype=torch.int32)}
        self._views: dict[int, tuple[Tensor, Tensor, AttentionMetadata]] = {}

    def views(self, size: int, group: Optional[CompileGroup]) -> tuple[Tensor, Tensor, AttentionMetadata]:
        """``(input_ids, positions, metadata)`` over the first ``size`` rows, made once per size."""
        if size not in self._views:
            v = {k: t[:size] for k, t in self.buffers.items()}
            for t in v.values():
                torch._dynamo.mark_static_address(t)
            mark_batch_dynamic(list(v.values()), group)
            meta = AttentionMetadata(v["slot_mapping"], DecodeMetadata(v["block_tables"], v["context_lens"]), None)
            self._views[size] = (v["input_ids"], v["positions"], meta)
        return self._views[size]

    def forget_views(self, size: int) -> None:
        """New views for ``size`` at its next ``views`` (its compile group changed)."""
        self._views.pop(size, None)

    def fill(self, live: dict[str, Tensor], n: int, size: int) -> None:
        """Rows ``:n`` from ``live`` (a block table narrower than ``M`` padded with the null block),
        rows ``n:size`` padding."""
        for name, buf in self.buffers.items():
            rows, value = buf[:n], live[name]
            if buf.dim() == 2 and value.shape[1] < buf.shape[1]:
                rows[:, value.shape[1]:].fill_(DECODE_PADDING[name])
                rows = rows[:, :value.shape[1]]
            rows.copy_(value, non_blocking=True)
            if n < size:
                buf[n:size].fill_(DECODE_PADDING[name])

    def pad(self, size: int) -> None:
        """Rows ``:size`` padding (capture runs on them)."""
        for name, buf in self.buffers.items():
            buf[:size].fill_(DECODE_PADDING[name])

    def by_name(self) -> dict[str, Tensor]:
        return {f"static {k}": t for k, t in self.buffers.items()}
