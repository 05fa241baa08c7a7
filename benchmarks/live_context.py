"""The decode step against the block table's width and against the live context.

A capture size's graph keeps its block tables ``ceil(max_model_len / block_size)`` blocks wide;
decode attention reading each row's live blocks only (``ascend_graph::decode_attention``) makes
the step cost what the live context costs, whatever that width:

- ``width``: one runner per max_model_len (256, 4096, 32768) over one model, the same cache
  blocks, the same live context (256) and batches; t(max_model_len) / t(256) (target <= 1.15).
- ``context``: the runner of the widest tables the contexts need (4096) at live contexts 64 ..
  4096, batch 8: the step should grow linearly with the context; the least-squares line's slope
  and intercept and its residuals, and the rate the added context is read at (its cache bytes
  over the slope) beside the copy bandwidth timed right after.

Each step is ``GraphRunner.execute(mode="graph")``, host preparation included; the variants of a
sweep are timed in the same rounds (``common.interleaved_samples``). The caches hold seeded random
entries (``models.filled_tables``: one per row and layer, so that the MoE layers choose the same
experts at every context), not a prefill's. Cases: the small model in float32 and bfloat16, the
V2-Lite slice in bfloat16 (``<model>_<dtype>``).

    python -m benchmarks.live_context [--cases small_float32 ...] [--json out.json]

``python -m benchmarks.before_after --live-context`` runs this module over another checkout's
package (the one before ``decode_attention``), in turns with this one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ascend_graph.config import GraphConfig  # noqa: E402
from ascend_graph.engine.block_manager import BlockManager  # noqa: E402
from benchmarks.common import (conditions, interleaved_medians, interleaved_samples, linear_fit,  # noqa: E402
                               set_malloc_keeps_freed_memory, write_json)
from benchmarks.models import ModelCase, build, cases, decode_rows, filled_tables, make_runner  # noqa: E402
from benchmarks.roofline import CopyProbe  # noqa: E402

WIDTHS = (256, 4096, 32768)
CONTEXTS = (64, 128, 256, 512, 1024, 2048, 4096)
CASES = ("small_float32", "small_bfloat16", "v2_lite_slice_bfloat16")
BLOCK_SIZE = 16
SAMPLE_SECONDS = 0.02  # calls per round: enough for the fastest variant's sample to last this long


def model_case(name: str, quick: bool = False) -> ModelCase:
    """``<model>_<dtype>`` (``CASES``) as a suite model case in that dtype."""
    model, dtype = name.rsplit("_", 1)
    return dataclasses.replace(cases(quick)[model], dtype=getattr(torch, dtype))


def width_ratios(times: dict[str, float]) -> dict[str, float]:
    """t(L) / t(smallest L) for each max_model_len ``L`` (string keys, as JSON keeps them)."""
    base = times[min(times, key=int)]
    return {k: t / base for k, t in times.items()}


def round_ratios(samples: dict[str, list[float]], base: str) -> dict[str, list[float]]:
    """Per round, each variant's sample over ``base``'s, the two timed back to back."""
    return {k: [a / b for a, b in zip(s, samples[base])] for k, s in samples.items() if k != base}


def calls_per_round(fn, seconds: float = SAMPLE_SECONDS) -> int:
    """Calls of ``fn`` (already warm) that last about ``seconds``."""
    start = time.perf_counter()
    fn()
    return max(1, round(seconds / (time.perf_counter() - start)))


def cache_bytes_per_token(runner) -> int:
    """One token's cache entries over every layer."""
    return sum(t[0, 0].numel() * t.element_size() for cache in runner.kv_caches for t in cache)


class Runners:
    """One graph runner per table width over one model, each with the same cache blocks holding
    the same random entries: ``rows`` sequences of ``longest`` tokens."""

    def __init__(self, case: ModelCase, widths: tuple[int, ...], sizes: tuple[int, ...], rows: int,
                 longest: int) -> None:
        self.model = build(case)
        num_blocks = 1 + rows * -(-longest // BLOCK_SIZE)
        config = GraphConfig(enabled=True, backend="inductor", capture_sizes=sizes, max_batch_size=max(sizes))
        self.runners, self.tables = {}, {}
        for width in widths:
            runner = make_runner(self.model, config, sizes, longest, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                 max_model_len=width)
            runner.capture(show_progress=False)
            self.runners[width] = runner
            self.tables[width] = filled_tables(runner, BlockManager(num_blocks, BLOCK_SIZE), rows, longest)

    def step_fn(self, width: int, n: int, context: int):
        """One graph decode step of ``n`` rows at ``context`` tokens in the runner ``width`` wide."""
        runner = self.runners[width]
        steps = decode_rows(self.tables[width][:n], context, BLOCK_SIZE, runner.model.config.vocab_size)
        return lambda: runner.execute(steps, mode="graph")


def timed(fns: dict, rounds: int, pace: str) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Medians and samples of ``fns`` in the same rounds, as many calls per round as ``pace`` takes
    for ``SAMPLE_SECONDS``."""
    for fn in fns.values():
        fn(), fn()
    samples = interleaved_samples(fns, rounds=rounds, calls_per_round=calls_per_round(fns[pace]), warmup=0)
    return {k: statistics.median(s) for k, s in samples.items()}, samples


def measure_case(case: ModelCase, widths=WIDTHS, context: int = 256, sizes=(1, 8), contexts=CONTEXTS,
                 context_batch: int = 8, rounds: int = 9) -> dict:
    """Both sweeps for one model case (module docstring)."""
    captured = tuple(sorted({*sizes, context_batch}))
    wide = max(contexts)
    r = Runners(case, tuple(sorted({*widths, wide})), captured, max(captured), max(wide, context))
    width_rows = []
    for n in sizes:
        fns = {str(w): r.step_fn(w, n, context) for w in widths}
        t, samples = timed(fns, rounds, str(min(widths)))
        width_rows.append({"batch": n, "step_s": t, "ratio": width_ratios(t),
                           "round_ratios": round_ratios(samples, str(min(widths)))})
        print(f"  {case.name} {case.dtype_name} batch {n}, context {context}: "
              + "  ".join(f"max_model_len {w} {t[str(w)] * 1e3:.2f} ms" for w in widths), flush=True)
    fns = {str(c): r.step_fn(wide, context_batch, c) for c in contexts}
    t, _ = timed(fns, rounds, str(min(contexts)))
    fit = linear_fit(list(contexts), [t[str(c)] for c in contexts])
    per_token = cache_bytes_per_token(r.runners[wide])
    probe = CopyProbe()  # after the sweep, not in its rounds: its 512 MiB would evict the step's weights
    copy_bw = probe.bytes / interleaved_medians({"copy": probe}, rounds=rounds, calls_per_round=1, warmup=1)["copy"]
    fit.update(cache_bytes_per_token=per_token, copy_bytes_per_s=copy_bw,
               context_bytes_per_s=context_batch * per_token / fit["slope"] if fit["slope"] > 0 else None)
    print(f"  {case.name} {case.dtype_name} batch {context_batch}, max_model_len {wide}: "
          + "  ".join(f"{c} {t[str(c)] * 1e3:.2f}" for c in contexts)
          + f" ms; slope {fit['slope'] * 1e6:.3f} µs/token, r2 {fit['r2']:.4f}", flush=True)
    return {"model": case.name, "dtype": case.dtype_name, "backends": r.runners[wide].backends(),
            "width": width_rows,
            "context": {"batch": context_batch, "max_model_len": wide, "step_s": t, "fit": fit}}


def measure(names=CASES, widths=WIDTHS, context: int = 256, sizes=(1, 8), contexts=CONTEXTS,
            context_batch: int = 8, rounds: int = 9, quick: bool = False) -> dict:
    """``measure_case`` for every case in ``names``, under ``cases``."""
    out = {"widths": list(widths), "context": context, "sizes": list(sizes), "contexts": list(contexts),
           "context_batch": context_batch, "rounds": rounds, "block_size": BLOCK_SIZE, "cases": {}}
    for name in names:
        out["cases"][name] = measure_case(model_case(name, quick), widths, context, sizes, contexts,
                                          context_batch, rounds)
    return out


def medians(result: dict) -> dict:
    """The step medians of a ``measure`` result, nested ``{case: {"width": {batch: {L: s}},
    "context": {context: s}}}`` (what ``before_after`` compares)."""
    return {name: {"width": {str(row["batch"]): row["step_s"] for row in c["width"]},
                   "context": c["context"]["step_s"]} for name, c in result["cases"].items()}


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    p.add_argument("--widths", type=ints, default=WIDTHS, help="max_model_len of each runner (default 256,4096,32768)")
    p.add_argument("--context", type=int, default=256, help="live context of the width sweep")
    p.add_argument("--sizes", type=ints, default=(1, 8), help="batches of the width sweep")
    p.add_argument("--contexts", type=ints, default=CONTEXTS, help="live contexts of the context sweep")
    p.add_argument("--context-batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep = set_malloc_keeps_freed_memory(True)
    result = {"benchmark": "live_context", "conditions": conditions(), "malloc_keeps_freed_memory": keep,
              **measure(args.cases, args.widths, args.context, args.sizes, args.contexts, args.context_batch,
                        args.rounds)}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
