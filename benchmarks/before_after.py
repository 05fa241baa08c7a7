"""Before and after a change: the suite's decode step and MLA decode attention, timed in two
checkouts of this repository in one run, taking turns (old, new, old, new, ...).

    git worktree add /tmp/old <commit>
    python -m benchmarks.before_after --old /tmp/old --new . --json benchmarks/results/before_after.json
    python -m benchmarks.before_after --old /tmp/old_attn --sizes '' --attention-dtypes bfloat16,float32 \
        --live-context '--rounds 5' --json benchmarks/results/before_after_decode_attention.json

Each turn is a fresh process in that checkout (its own package and benchmarks), so the two
never share a build or a compile cache entry; the alternation spreads the machine's load over
both. ``--new-benchmarks`` runs the new checkout's ``benchmarks.decode_step`` over each
checkout's package instead (a model case the old checkout's benchmarks lack, as
``v2_lite_fp32``):

    python -m benchmarks.before_after --old /tmp/old --model v2_lite_fp32 --new-benchmarks --attention '' \
        --json benchmarks/results/before_after_fp32.json
 ``--live-context`` turns run the new checkout's ``benchmarks.live_context`` over each
checkout's package (an older checkout may not have that module). Ratios are new / old time:
below 1 is faster.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

from benchmarks.common import conditions, write_json

# One MLA decode attention step over the tuple cache, eager and compiled, as a model of that
# checkout runs it: through its attention backend where it has one, else ``mla_decode``.
ATTENTION = r"""
import json, os, time, torch
torch.set_num_threads(1)
import ascend_graph
from ascend_graph.attention import DecodeMetadata, mla_decode
from ascend_graph.kv_cache import MLACache
# by the checkout's own files (an installed copy elsewhere must not answer for a missing module)
if os.path.isdir(os.path.join(os.path.dirname(ascend_graph.__file__), "compile")):
    from ascend_graph.attention import select_attention_backend
    from ascend_graph.compile import resolve_backend
    decode = select_attention_backend("mla", "cpu", torch.{dtype}).decode
else:
    from ascend_graph.backends import resolve_backend
    decode = mla_decode
from ascend_graph.config import GraphConfig
b, ctx, h, dn, r, c, s = {batch}, {context}, 16, 128, 64, 512, 16
g = torch.Generator().manual_seed(0)
per = ctx // s
blocks = b * per + 8
bf = lambda *shape: (torch.randn(*shape, generator=g) * 0.5).to(torch.{dtype})
cache = MLACache(bf(blocks, s, 1, c), bf(blocks, s, 1, r))
tables = torch.randperm(blocks - 1, generator=g)[:b * per].add(1).view(b, per).int()
meta = DecodeMetadata(tables, torch.full((b,), ctx, dtype=torch.int32))
w_uk = (bf(h, c, dn) / c ** 0.5).transpose(1, 2)
w_uv = bf(h, dn, c) / c ** 0.5
q_nope, q_pe = bf(b, h, dn), bf(b, h, r)
def step(q_nope, q_pe, kv_c, k_pe, tables, lens):
    return decode(q_nope, q_pe, MLACache(kv_c, k_pe), DecodeMetadata(tables, lens), w_uk, w_uv, 0.1)
args = (q_nope, q_pe, *cache, tables, meta.context_lens)
backend = resolve_backend(GraphConfig(enabled=True, backend="inductor"), "cpu")
fns = {{"eager": step, "graph": torch.compile(step, backend=backend, fullgraph=True, dynamic=False)}}
out = {{}}
with torch.inference_mode():
    for name, fn in fns.items():
        fn(*args); fn(*args)
    times = {{name: [] for name in fns}}
    for _ in range({reps}):
        for name, fn in fns.items():
            t0 = time.perf_counter(); fn(*args); times[name].append(time.perf_counter() - t0)
print(json.dumps({{k: sorted(v)[len(v) // 2] for k, v in times.items()}}))
"""


def _run(tree: str, argv: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=tree, env={**env, "PYTHONPATH": tree}, text=True,
                          capture_output=True, check=True)


def decode_turn(tree: str, model: str, sizes: str, rounds: int, env: dict, benchmarks_of: str | None = None) -> dict:
    """``{batch: {"graph": s, "eager": s}}`` from one ``benchmarks.decode_step`` run in ``tree``
    (``benchmarks_of``: that checkout's benchmarks over ``tree``'s package)."""
    argv = ["-m", "benchmarks.decode_step", "--model", model, "--sizes", sizes, "--rounds", str(rounds), "--calls", "1"]
    with tempfile.TemporaryDirectory(prefix="ag-before-after-") as farm, \
            tempfile.NamedTemporaryFile(suffix=".json") as f:
        if benchmarks_of is not None:
            os.symlink(os.path.join(tree, "ascend_graph"), os.path.join(farm, "ascend_graph"))
            os.symlink(os.path.join(benchmarks_of, "benchmarks"), os.path.join(farm, "benchmarks"))
            tree = farm
        _run(tree, [*argv, "--json", f.name], env)
        rows = json.load(open(f.name))["rows"]
    return {str(r["batch"]): {"graph": r["graph_s"], "eager": r["eager_s"]} for r in rows}


def attention_turn(tree: str, batch: int, context: int, reps: int, env: dict, dtype: str = "bfloat16") -> dict:
    """``{"graph": s, "eager": s}`` of one MLA decode attention step in ``tree``."""
    out = _run(tree, ["-c", ATTENTION.format(batch=batch, context=context, reps=reps, dtype=dtype)], env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def live_context_turn(tree: str, new: str, argv: list[str], env: dict) -> tuple[dict, dict]:
    """The step medians of ``benchmarks.live_context`` (``live_context.medians``), the new
    checkout's module over ``tree``'s package, and each case's backends."""
    from benchmarks.live_context import medians

    with tempfile.TemporaryDirectory(prefix="ag-before-after-") as farm, \
            tempfile.NamedTemporaryFile(suffix=".json") as f:
        os.symlink(os.path.join(tree, "ascend_graph"), os.path.join(farm, "ascend_graph"))
        os.symlink(os.path.join(new, "benchmarks"), os.path.join(farm, "benchmarks"))
        _run(farm, ["-m", "benchmarks.live_context", *argv, "--json", f.name], env)
        result = json.load(open(f.name))
    return medians(result), {name: c["backends"] for name, c in result["cases"].items()}


def compare(turns: dict[str, list[dict]]) -> dict:
    """Per key and mode: each checkout's median over its turns and new / old."""
    def flat(turn: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in turn.items():
            out.update(flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": v})
        return out
    old, new = ([flat(t) for t in turns[side]] for side in ("old", "new"))
    table = {}
    for key in old[0]:
        o, n = statistics.median(t[key] for t in old), statistics.median(t[key] for t in new)
        table[key] = {"old_ms": o * 1e3, "new_ms": n * 1e3, "new_over_old": n / o}
    return table


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", required=True, help="the checkout before the change")
    p.add_argument("--new", default=".", help="the checkout after it (default: this one)")
    p.add_argument("--turns", type=int, default=2, help="turns of each checkout, taken alternately")
    p.add_argument("--model", default="v2_lite_slice", choices=["small", "v2_lite_slice", "v2_lite_fp32"])
    p.add_argument("--new-benchmarks", action="store_true",
                   help="decode turns run the new checkout's benchmarks over each checkout's package")
    p.add_argument("--sizes", default="1,8,32")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--attention", default="32,2048", help="batch,context of the attention step ('' to skip)")
    p.add_argument("--attention-dtypes", default="bfloat16",
                   help="dtypes of the attention step; more than one: keyed attention/<dtype>/<mode>")
    p.add_argument("--live-context", default=None, metavar="ARGS",
                   help="also benchmarks.live_context with these arguments ('' for its defaults)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each turn (OMP_NUM_THREADS)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1", "OMP_NUM_THREADS": str(args.threads)}
    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    turns, backends = {"old": [], "new": []}, {}
    dtypes = args.attention_dtypes.split(",")
    for i in range(args.turns):
        for side in ("old", "new") if i % 2 == 0 else ("new", "old"):
            bench = trees["new"] if args.new_benchmarks else None
            turn = {"decode": decode_turn(trees[side], args.model, args.sizes, args.rounds, env, bench)} if args.sizes else {}
            if args.attention:
                batch, context = (int(v) for v in args.attention.split(","))
                att = {d: attention_turn(trees[side], batch, context, 2 * args.rounds + 1, env, d) for d in dtypes}
                turn["attention"] = att if len(dtypes) > 1 else att[dtypes[0]]
            if args.live_context is not None:
                turn["live_context"], backends[side] = live_context_turn(
                    trees[side], trees["new"], shlex.split(args.live_context), env)
            turns[side].append(turn)
            print(f"  turn {i + 1}, {side}: {json.dumps(turn)}", flush=True)
    table = compare(turns)
    for key, row in table.items():
        print(f"  {key:<24} old {row['old_ms']:9.2f} ms  new {row['new_ms']:9.2f} ms  new/old {row['new_over_old']:.3f}")
    commits = {side: subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip() for side, tree in trees.items()}
    given = argv if argv is not None else sys.argv[1:]
    command = " ".join(["python -m benchmarks.before_after", *map(shlex.quote, given)])
    result = {"benchmark": "before_after", "conditions": conditions("cpu"), "trees": trees, "commits": commits,
              "command": command,
              "model": args.model, "new_benchmarks": args.new_benchmarks, "threads": args.threads, "sizes": args.sizes, "rounds": args.rounds, "attention": args.attention,
              "attention_dtypes": dtypes, "live_context": args.live_context, "backends": backends,
              "turns": turns, "table": table}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
