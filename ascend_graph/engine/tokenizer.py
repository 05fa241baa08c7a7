"""Loading a checkpoint's tokenizer (optional: only string prompts need one).

transformers' ``AutoTokenizer`` is used when installed; otherwise the ``tokenizers`` package
reads ``tokenizer.json`` directly. Either way the result has ``encode(text) -> list[int]`` and
``decode(ids) -> str``.
"""

from __future__ import annotations

import os
from typing import Protocol, Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class Tokenizer(Protocol):
    """What the engine needs of a tokenizer."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...


class _FastTokenizer:
    """``tokenizers.Tokenizer`` behind the ``encode``/``decode`` of transformers' tokenizers."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(token_ids))


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved in checkpoint directory ``path``; clear errors when there is none."""
    path = os.fspath(path)
    present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(path, f))]
    if not present:
        raise ValueError(f"{path} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): string prompts need "
                         "one; pass prompt token ids instead, or Engine(tokenizer=...)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        pass
    else:
        return AutoTokenizer.from_pretrained(path)
    if "tokenizer.json" in present:
        try:
            from tokenizers import Tokenizer as RawTokenizer
        except ImportError:
            pass
        else:
            return _FastTokenizer(RawTokenizer.from_file(os.path.join(path, "tokenizer.json")))
    raise ImportError(f"loading the tokenizer in {path} needs the 'transformers' (or, for tokenizer.json, "
                      "'tokenizers') package: pip install 'ascend-graph[hf]'; or pass prompt token ids")
