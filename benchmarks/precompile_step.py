"""The decode step of a precompiled runner (``inductor.precompile``) against a plain compiled one,
interleaved in one process: small MLA model, one thread, ms per step.

    python -m benchmarks.precompile_step [--json PATH]

Run it twice: the first run compiles and saves the precompiled steps (under a temporary cache
directory that outlives the run), the second loads them (``loaded`` in the output).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

from ascend_graph.config import GraphConfig, InductorOptions  # noqa: E402
from benchmarks.common import conditions, write_json  # noqa: E402

CACHE = os.path.join(tempfile.gettempdir(), "ag-precompile-step")
BATCHES = (1, 4)


def main(argv: list[str] | None = None) -> dict:
    from runner_helpers import Schedule, make_runner, prefilled, small_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model = small_model("mla")
    runners, about = {}, {}
    for name, precompile in (("plain", False), ("precompiled", True)):
        cfg = GraphConfig(enabled=True, backend="inductor", capture_sizes=BATCHES, max_batch_size=max(BATCHES),
                          compile_cache_dir=CACHE, inductor=InductorOptions(precompile=precompile))
        runner, sched = make_runner(model, cfg), Schedule(seed=1)
        runner.capture(show_progress=False)
        prefilled(runner, sched, max(BATCHES), model.config.vocab_size)
        runners[name] = (runner, sched)
        about[name] = {"compiles": runner.stats.compiles, "loaded": runner.stats.packages_loaded}
    ms = {name: {b: [] for b in BATCHES} for name in runners}
    for r in range(args.rounds):
        for name in (list(runners) if r % 2 == 0 else list(runners)[::-1]):
            runner, sched = runners[name]
            for b in BATCHES:
                entries = sched.decode_entries()[:b]
                start = time.perf_counter()
                for _ in range(50):
                    runner.execute(entries)
                ms[name][b].append((time.perf_counter() - start) / 50 * 1e3)
    rows = [{"batch": b, "plain_ms": statistics.median(ms["plain"][b]),
             "precompiled_ms": statistics.median(ms["precompiled"][b])} for b in BATCHES]
    for row in rows:
        row["ratio"] = row["precompiled_ms"] / row["plain_ms"]
        print(f"batch {row['batch']}: plain {row['plain_ms']:.3f} ms, precompiled {row['precompiled_ms']:.3f} ms, "
              f"precompiled / plain {row['ratio']:.3f}")
    out = {"benchmark": "precompile_step", "conditions": conditions(), "runners": about, "rows": rows,
           "round_ms": {n: {str(b): v for b, v in d.items()} for n, d in ms.items()}}
    if args.json:
        write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
