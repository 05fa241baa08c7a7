"""The engine's own counters: requests, tokens, steps, decode batch sizes and step time."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class EngineStats:
    """Counters of an engine: requests, tokens, steps, decode batch sizes and step time."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_batch_sizes: Counter = field(default_factory=Counter)

    def to_dict(self) -> dict:
        """A JSON-safe copy, with decode throughput."""
        rate = self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated_tokens, "prefill_steps": self.prefill_steps,
                "decode_steps": self.decode_steps, "decode_tokens": self.decode_tokens,
                "prefill_seconds": round(self.prefill_seconds, 4), "decode_seconds": round(self.decode_seconds, 4),
                "decode_tokens_per_s": round(rate, 2),
                "decode_batch_sizes": {str(k): v for k, v in sorted(self.decode_batch_sizes.items())}}
