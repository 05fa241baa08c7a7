"""The pure-torch attention backends: gathered rows and einsums (``mla.py``, ``paged.py``).

They run on every device and dtype; the oracle tests and the other backends are checked against them.
"""

from __future__ import annotations

import torch

from .base import MLABackend, PagedBackend
from .mla import mla_decode, mla_prefill
from .paged import paged_decode, paged_prefill


class ReferenceMLA(MLABackend):
    """MLA over gathered cache rows: ``mla.mla_decode`` / ``mla.mla_prefill``."""

    name = "reference"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return True

    def decode(self, q_nope, q_pe, cache, decode, w_uk, w_uv, scale):
        return mla_decode(q_nope, q_pe, cache, decode, w_uk, w_uv, scale)

    def prefill(self, q_nope, q_pe, cache, prefill, w_uk, w_uv, scale):
        return mla_prefill(q_nope, q_pe, cache, prefill, w_uk, w_uv, scale)


class ReferencePaged(PagedBackend):
    """Standard attention over gathered keys and values: ``paged.paged_decode`` / ``paged_prefill``."""

    name = "reference"

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype) -> bool:
        return True

    def decode(self, q, cache, decode, scale):
        return paged_decode(q, cache, decode, scale)

    def prefill(self, q, cache, prefill, scale):
        return paged_prefill(q, cache, prefill, scale)
