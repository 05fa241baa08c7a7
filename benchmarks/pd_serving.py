"""Serving with prefill and decode in two processes against one process: time to first token and
decode ms per step, same requests, same decode graphs, the two taking turns in every round.

    python -m benchmarks.pd_serving [--transports mooncake,gloo] [--batches 1,4] [--json PATH]

Both sides decode with graph mode on (capture sizes = ``--batches``) on the built-in small
model, one thread each. ``ttft`` is the time from a request's admission to its first token: in
one process, the batched eager prefill step; with PD, the prefill process's step, the control
message and the KV transfer. The tokens of every round are checked equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import torch  # noqa: E402

from ascend_graph.config import GraphConfig  # noqa: E402
from ascend_graph.engine.engine import Engine  # noqa: E402
from ascend_graph.models.named import named_model  # noqa: E402
from ascend_graph.pd import DecodeEngine, PrefillProcess, resolve_transport  # noqa: E402
from benchmarks.common import conditions, write_json  # noqa: E402

GEOMETRY = dict(block_size=16, max_model_len=256)
NEW_TOKENS = 32


def prompts(batch: int, vocab: int) -> list[list[int]]:
    """``batch`` prompts of 40..(40 + 24 * batch) tokens."""
    return [[(11 * i + 7 * j) % vocab for j in range(40 + 24 * i)] for i in range(batch)]


class TimedEngine(Engine):
    """A single-process engine that notes when each request's first token was made."""

    def _serve(self, requests, *args, **kwargs):
        self.first_token_at, self.started = {}, time.monotonic()
        return super()._serve(requests, *args, **kwargs)

    def _advance(self, scheduler, batch, logits, prefill, *args):
        done = super()._advance(scheduler, batch, logits, prefill, *args)
        if prefill:
            now = time.monotonic()
            self.first_token_at.update({r.index: now - self.started for r in batch})
        return done


def serve(engine: Engine, reqs: list, budgets: list) -> tuple[list, float, float]:
    """Tokens, mean ttft (s) and decode ms per step of one ``generate`` run."""
    c = engine.counters
    steps, seconds = c.decode_steps, c.decode_seconds
    if isinstance(engine, DecodeEngine):
        before = len(engine.transfer.ttft_seconds)
        tokens = engine.generate(reqs, budgets, ignore_eos=True)
        ttft = statistics.fmean(engine.transfer.ttft_seconds[before:])
    else:
        tokens = engine.generate(reqs, budgets, ignore_eos=True)
        ttft = statistics.fmean(engine.first_token_at.values())
    return tokens, ttft, 1e3 * (c.decode_seconds - seconds) / (c.decode_steps - steps)


def measure(model, transport: str, batches: tuple[int, ...], rounds: int) -> list[dict]:
    config = GraphConfig(enabled=True, capture_sizes=batches, max_batch_size=max(batches))
    seats = max(batches)
    num_blocks = 1 + seats * GEOMETRY["max_model_len"] // GEOMETRY["block_size"]
    single = TimedEngine(model, graph_config=config, max_num_seqs=seats, num_blocks=num_blocks, **GEOMETRY)
    single.capture(show_progress=False)
    rows = []
    with PrefillProcess("small", transport=transport, threads=1, num_blocks=num_blocks, **GEOMETRY) as server:
        pd = DecodeEngine(model, server, transport=transport, graph_config=config, max_num_seqs=seats,
                          num_blocks=num_blocks, **GEOMETRY)
        try:
            pd.capture(show_progress=False)
            for batch in batches:
                reqs, budgets = prompts(batch, model.config.vocab_size), [NEW_TOKENS] * batch
                samples = {"single": [], "pd": []}
                for r in range(rounds + 1):  # round 0 warms both up
                    order = (("single", single), ("pd", pd)) if r % 2 else (("pd", pd), ("single", single))
                    outs = {name: serve(engine, reqs, budgets) for name, engine in order}
                    if outs["pd"][0] != outs["single"][0]:
                        raise AssertionError(f"batch {batch}: PD tokens differ from the single process's")
                    if r:
                        for name, (_, ttft, ms) in outs.items():
                            samples[name].append((ttft, ms))
                rows.append(row(transport, batch, reqs, samples, pd))
        finally:
            pd.close()
    return rows


def row(transport: str, batch: int, reqs: list, samples: dict, pd: DecodeEngine) -> dict:
    med = {name: (statistics.median(s[0] for s in v), statistics.median(s[1] for s in v))
           for name, v in samples.items()}
    t = pd.transfer
    out = {"transport": transport, "batch": batch, "prompt_tokens": [len(p) for p in reqs],
           "single_ttft_ms": round(1e3 * med["single"][0], 3), "pd_ttft_ms": round(1e3 * med["pd"][0], 3),
           "single_decode_ms": round(med["single"][1], 3), "pd_decode_ms": round(med["pd"][1], 3),
           "transfer_bytes_per_request": t.bytes // max(t.transfers, 1),
           "transfer_ms_per_request": round(1e3 * t.seconds / max(t.transfers, 1), 3),
           "decode_recompiles": pd.runner.stats.recompiles, "tokens_equal": True}
    out["pd_over_single_ttft"] = round(out["pd_ttft_ms"] / out["single_ttft_ms"], 3)
    out["pd_over_single_decode"] = round(out["pd_decode_ms"] / out["single_decode_ms"], 3)
    print(f"{transport:>8} batch {batch}: ttft single {out['single_ttft_ms']:.2f} ms, PD {out['pd_ttft_ms']:.2f} ms "
          f"({out['pd_over_single_ttft']:.2f}x); decode step single {out['single_decode_ms']:.3f} ms, PD "
          f"{out['pd_decode_ms']:.3f} ms ({out['pd_over_single_decode']:.2f}x)", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--transports", default="auto")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    out = run(args.transports.split(","), tuple(int(b) for b in args.batches.split(",")), args.rounds)
    if args.json:
        write_json(args.json, out)
    return out


def run(transports: list[str], batches: tuple[int, ...], rounds: int) -> dict:
    """Every transport (a name or ``auto``) at every batch size: the figures as one JSON object."""
    torch.set_num_threads(1)
    model = named_model("small")[0]
    rows = [r for t in transports for r in measure(model, resolve_transport(t), batches, rounds)]
    return {"benchmark": "pd_serving", "conditions": conditions(), "model": "small", "new_tokens": NEW_TOKENS,
            "rounds": rounds, **GEOMETRY, "rows": rows}


if __name__ == "__main__":
    main()
