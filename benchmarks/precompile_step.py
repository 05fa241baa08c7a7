"""The decode step of a precompiled (loaded) runner against a plain compiled one, interleaved in
one process: ``python benchmarks/precompile_step.py`` (run it twice: the first run compiles and saves,
the second loads). Small MLA model, one thread, batches 1 and 4, ms per step."""

import os, sys, time, statistics
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
import torch
torch.set_num_threads(1)
from runner_helpers import make_runner, small_model, Schedule, prefilled
from ascend_graph.config import GraphConfig, InductorOptions
model = small_model("mla")
runners = {}
for name, pre in (("plain", False), ("precompiled", True)):
    cfg = GraphConfig(enabled=True, backend="inductor", capture_sizes=(1, 4), max_batch_size=4,
                      compile_cache_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "ag-precompile-step"), inductor=InductorOptions(precompile=pre))
    r = make_runner(model, cfg); r.capture(show_progress=False)
    s = Schedule(seed=1); prefilled(r, s, 4, model.config.vocab_size)
    runners[name] = (r, s)
    print(name, "loaded", r.stats.packages_loaded, "compiles", r.stats.compiles, flush=True)
res = {n: {1: [], 4: []} for n in runners}
for rnd in range(7):
    for name, (r, s) in (runners.items() if rnd % 2 == 0 else reversed(list(runners.items()))):
        for b in (1, 4):
            e = s.decode_entries()[:b]
            t = time.perf_counter()
            for _ in range(50):
                r.execute(e)
            res[name][b].append((time.perf_counter() - t) / 50 * 1e3)
for b in (1, 4):
    p, q = statistics.median(res["plain"][b]), statistics.median(res["precompiled"][b])
    print(f"batch {b}: plain {p:.3f} ms, precompiled {q:.3f} ms, ratio {q/p:.3f}")
