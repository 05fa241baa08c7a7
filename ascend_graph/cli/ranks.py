"""The commands on several ranks: the Engine's parallel arguments from the flags, and the
per-rank parts of a result (``docs/distributed.md``)."""

from __future__ import annotations

import argparse
from typing import Optional

from ..engine.engine import Engine


def parallel_sizes(args: argparse.Namespace) -> dict:
    """The Engine's parallel arguments from the flags (one process without them)."""
    return {"tensor_parallel_size": getattr(args, "tensor_parallel_size", 1),
            "data_parallel_size": getattr(args, "data_parallel_size", 1),
            "enable_expert_parallel": getattr(args, "enable_expert_parallel", False)}


def ranks_on_top(result: dict) -> dict:
    """``result`` with its counters' per-rank runner counters (multi-process) moved to ``ranks``."""
    ranks = result.get("counters", {}).pop("ranks", None)
    return {**result, "ranks": ranks} if ranks is not None else result


def parity_by_rank(engine: Engine) -> Optional[list]:
    """Per rank, its checked steps of the last ``generate_checked`` (multi-process engines; else None)."""
    if not engine.rank_parity:
        return None
    by_rank: dict[int, list] = {}
    for summaries in engine.rank_parity:
        for s in summaries:
            by_rank.setdefault(s["rank"], []).append(s)
    return [{"rank": rank, "checks": len(rows), "failures": sum(not r["ok"] for r in rows),
             "max_logit_diff": max(r["logits_max_abs"] for r in rows),
             "max_cache_diff": max(r["caches_max_abs"] for r in rows),
             "untouched_ok": all(r["untouched_ok"] is not False for r in rows)} for rank, rows in sorted(by_rank.items())]
