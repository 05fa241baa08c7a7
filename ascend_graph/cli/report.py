"""Readable reports of the ``ascend-graph`` subcommands, from their JSON-safe results."""

from __future__ import annotations

from typing import Optional


def _yes(flag: Optional[bool]) -> str:
    return "unchecked" if flag is None else ("yes" if flag else "NO")


def _num(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _mib(n: int) -> str:
    return f"{n / 2**20:8.1f} MiB"


def _graph_mode(settings: dict) -> str:
    if not settings["capture_sizes"]:
        return "graph mode off (every step eager)"
    return f"graph mode: backend {settings['backend']}, capture sizes {','.join(map(str, settings['capture_sizes']))}"


def model_lines(result: dict) -> list[str]:
    """The model, the graph settings, the backends and the machine."""
    m, s = result["model"], result["settings"]
    experts = f"{m['routed_experts']} routed experts" if m["routed_experts"] else "dense"
    q = f"q_lora_rank {m['q_lora_rank']}, " if m["q_lora_rank"] else ""
    lines = [f"model: {m['architecture']} from {m['source']}",
             f"  {m['layers']} layers, hidden {m['hidden_size']}, {m['heads']} heads, {q}kv_lora_rank "
             f"{m['kv_lora_rank']}, {experts}, {m['parameters'] / 1e6:.2f} M parameters, {m['dtype']}",
             f"{_graph_mode(s)}; cache {s['num_blocks']} blocks of {s['block_size']}; "
             f"max_num_seqs {s['max_num_seqs']}"]
    b = s.get("backends")
    if b:
        rewrites = b["compiled_only_rewrites"]
        lines.append(f"backends: attention {b.get('attention', '?')}, moe {b.get('moe', '?')} (eager and graph alike)"
                     + "".join(f"\n  compiled-only rewrite: {r}" for r in rewrites))
    c = result.get("conditions")
    if c:
        lines.append(f"machine: {c['cpu']} ({c['cores']} cores; torch threads {c['torch_threads']}), "
                     f"torch {c['torch']}, device {c['device']}")
    return lines


def capture_lines(capture: dict) -> list[str]:
    """Seconds, memory and compile cache outcome per capture size; the total, cold or warm."""
    lines = ["Graph capture (compile + warm-up per batch size; memory: allocator growth, RSS on CPU; "
             "compile cache: hit = loaded, miss = compiled)",
             f"  {'batch size':>10} {'seconds':>9} {'memory':>12} {'compile cache':>14}"]
    for size, c in sorted(capture.items(), key=lambda kv: int(kv[0])):
        lines.append(f"  {size:>10} {c['seconds']:>9.2f} {_mib(c['memory_bytes']):>12} "
                     f"{c.get('compile_cache') or '-':>14}")
    total = sum(c["seconds"] for c in capture.values())
    start = capture_start(capture)
    lines.append(f"  {'total':>10} {total:>9.2f}" + (f"  ({start} start)" if start else ""))
    return lines


def capture_start(capture: dict) -> Optional[str]:
    """``"cold"`` when every size was compiled (a cache miss or bypass), ``"warm"`` when every size
    came from the compile cache, ``"mixed"`` otherwise; ``None`` when no size went through
    Inductor's cache."""
    outcomes = {c.get("compile_cache") for c in capture.values()} - {None}
    if not outcomes:
        return None
    return "warm" if outcomes == {"hit"} else "cold" if "hit" not in outcomes else "mixed"


def counter_lines(stats: dict) -> list[str]:
    """The runner's and the engine's counters."""
    eager = ", ".join(f"{k} {v}" for k, v in sorted(stats["eager_steps"].items())) or "none"
    sizes = " ".join(f"{k}x{v}" for k, v in stats["decode_batch_sizes"].items())
    return [f"  graph steps {stats['graph_steps']} | eager steps: {eager} | compiles {stats['compiles']} | "
            f"recompiles {stats['recompiles']} | compile failures {stats['compile_failures']} | "
            + (f"packages loaded {stats['packages_loaded']} | " if stats.get("packages_loaded") else "")
            + (f"recaptures {stats['recaptures']} | " if stats.get("recaptures") else "")
            + f"capture {stats['capture_seconds']:.1f} s",
            f"  requests {stats['requests']} | prompt tokens {stats['prompt_tokens']} | generated tokens "
            f"{stats['generated_tokens']} | prefill steps {stats['prefill_steps']} | "
            f"decode steps {stats['decode_steps']}",
            f"  decode batch sizes (size x steps): {sizes}"] + speculative_lines(stats)


def speculative_lines(stats: dict) -> list[str]:
    """The MTP drafts' counters, where the engine speculates."""
    spec = stats.get("speculative")
    if not spec:
        return []
    per = " ".join(f"{r:.2f}" for r in spec["acceptance_rate_per_position"])
    return [f"  speculative: {spec['num_speculative_tokens']} draft token(s) per step | drafted "
            f"{spec['drafted_tokens']} | accepted {spec['accepted_tokens']} (rate {spec['acceptance_rate']:.2f}; "
            f"per position {per}) | verify steps {spec['verify_steps']} (graph steps above)"] + chain_lines(spec)


def chain_lines(spec: dict) -> list[str]:
    """The draft chain's steps (``num_speculative_tokens > 1``), graph and eager, and their checks."""
    chain = spec.get("draft_chain")
    if not chain:
        return []
    eager = ", ".join(f"{n} {why}" for why, n in chain["eager_steps"].items()) or "0"
    return [f"  draft chain: graph steps {chain['graph_steps']} | eager steps {eager} | compiles "
            f"{chain['compiles']} (recompiles {chain['recompiles']}, failures {chain['compile_failures']}) | "
            f"capture {chain['capture_seconds']:.1f} s | parity checks {chain['parity_checks']} "
            f"(failures {chain['parity_failures']})"]


def compile_failure_lines(stats: dict) -> list[str]:
    """One line per failed compile (``RunnerStats.compile_errors``): the size or compile group,
    what it fell back to, and the exception's first line; one per attention fallback reason
    (``RunnerStats.attention_fallbacks``); none when nothing fell back."""
    errors = stats.get("compile_errors") or {}
    lines = [f"WARNING: attention ran a slower form {n} time(s) per layer: {reason}"
             for reason, n in (stats.get("attention_fallbacks") or {}).items()]
    if not errors:
        return lines
    lines += [f"WARNING: {stats['compile_failures']} graph compile(s) failed; a failed size runs eagerly, "
             "a failed compile group compiles its sizes one by one:"]
    for key, error in errors.items():
        first = error.splitlines()[0] if error else ""
        lines.append(f"  {'sizes' if '-' in key else 'size'} {key}: {first[:200]}")
    return lines


def _verdict(ok: bool) -> str:
    return "PASS: graph mode reproduces eager" if ok else "FAIL: graph and eager differ"


def format_demo(r: dict) -> str:
    """The demo's report."""
    req, t, p = r["requests"], r["throughput"], r["parity"]
    cs = p["compare_step"]
    lines = [f"ascend-graph demo: {req['count']} requests (prompts {min(req['prompt_lens'])}-"
             f"{max(req['prompt_lens'])} tokens, {min(req['new_tokens'])}-{max(req['new_tokens'])} new tokens each) "
             "served with graph mode on, then eagerly", *model_lines(r), "", *capture_lines(r["capture"]), "",
             f"Decode throughput (median of {t['rounds']} alternating rounds; same model, same requests)"
             + (f"; live context {_context(req['live_context'])}" if "live_context" in req else ""),
             f"  eager  {t['eager']['tokens_per_s']:>10.1f} tokens/s  {t['eager']['ms_per_step']:>8.3f} ms/step",
             f"  graph  {t['graph']['tokens_per_s']:>10.1f} tokens/s  {t['graph']['ms_per_step']:>8.3f} ms/step",
             f"  graph / eager: {t['speedup']:.2f}x", "", *decode_step_lines(r["decode_step"]), "",
             "Parity, graph vs eager",
             f"  tokens identical          {_yes(p['tokens_identical'])} ({req['count']} requests, "
             f"{sum(req['new_tokens'])} tokens){_first_differences(p['first_differences'])}",
             f"  max |logit difference|    {_num(p['max_logit_diff'])} over {p['logit_rows_compared']} logit rows",
             f"  compare_step checks       {cs['checks'] - cs['failures']} of {cs['checks']} decode steps OK"
             f"{_flip_count(cs.get('routing_flips'))}; "
             f"max logit diff {_num(cs['max_logit_diff'])}, max cache diff {_num(cs['max_cache_diff'])}, "
             f"other blocks untouched: {_yes(cs['untouched_ok'])}",
             f"  verdict                   {_verdict(p['ok'])}",
             "", "Counters (graph engine; compare_step checks are not counted as graph steps)",
             *counter_lines(r["counters"]), *compile_failure_lines(r["counters"]), "",
             f"sample: request 0 prompt {r['sample']['prompt'][:8]}... -> {r['sample']['tokens'][:12]}...",
             f"finished in {r['seconds']:.1f} s"]
    return "\n".join(lines)


def _context(c: dict) -> str:
    """A ``decode_contexts`` summary: ``least-largest (mean m)``."""
    return "none" if c["min"] is None else f"{c['min']}-{c['max']} (mean {c['mean']:g})"


def decode_step_lines(d: dict) -> list[str]:
    """The demo's graph step with prompts of the workload's mean length and near max_model_len."""
    lines = [f"Decode step by live context (graph, {d['rows']} requests of {d['new_tokens']} new tokens, median of "
             f"{d['rounds']} alternating rounds; block tables {d['block_table_blocks']} blocks wide: max_model_len "
             f"{d['max_model_len']}, in both)"]
    for name, label in (("workload_context", "workload's prompts"), ("near_max_model_len", "near max_model_len")):
        run = d[name]
        lines.append(f"  {label:<19} live context {_context(run['live_context']):<22} "
                     f"{run['ms_per_step']:>8.3f} ms/step")
    return lines + [f"  near max_model_len / workload's prompts: {d['near_max_over_workload']:.2f}x"]


def _first_differences(firsts: list) -> str:
    """Where requests' tokens first differed, and whether each was a near-tie ('' when none did)."""
    if not firsts:
        return ""
    ties = sum(f["near_tie"] for f in firsts)
    routed = sum(not f["near_tie"] and f.get("after_routing_near_tie", False) for f in firsts)
    unexplained = len(firsts) - ties - routed
    if unexplained:
        return f"; {unexplained} of {len(firsts)} request(s) first differ beyond tolerance"
    return (f"; {len(firsts)} request(s) first differ: {ties} at a near-tie of two tokens, {routed} after a "
            "reproduced routing near-tie")


def format_generate(r: dict) -> str:
    """Each request's new tokens (and text when a tokenizer decoded them)."""
    lines = [*model_lines(r), ""]
    for i, out in enumerate(r["outputs"]):
        prompt = out["prompt"] if isinstance(out["prompt"], str) else f"{out['prompt']}"
        lines.append(f"[{i}] {prompt}")
        lines.append(f"    -> {out['tokens']}" + (f" {out['text']!r}" if out["text"] is not None else ""))
    s = r["counters"]
    lines += ["", f"{s['generated_tokens']} tokens in {r['seconds']:.2f} s; decode {s['decode_tokens_per_s']:.1f} "
              f"tokens/s; graph steps {s['graph_steps']}, eager steps {s['eager_steps_total']}",
              *compile_failure_lines(s)]
    return "\n".join(lines)


def format_parity(r: dict) -> str:
    """Per-step differences and the verdict."""
    lines = [*model_lines(r), "", f"{'step':>5} {'kind':>6} {'batch':>5} {'logits max|diff|':>17} {'cache max|diff|':>16} "
             f"{'untouched':>9}  ok"]
    for s in r["steps"]:
        lines.append(f"{s['step']:>5} {s['kind']:>6} {s['batch_size']:>5} {s['logits_max_abs']:>17.3g} {s['caches_max_abs']:>16.3g} "
                     f"{_yes(s['untouched_ok']):>9}  {'ok' if s['ok'] else 'MISMATCH'}{_flips(s['routing_flips'])}"
                     + "".join(f"; layer {c['layer']} {c['element']} blocks {c['blocks'][:8]} changed outside the step"
                               for c in s.get("untouched_changed", ())))
    sm = r["summary"]
    drafts = f" ({sm['draft_checks']} of them draft chain steps)" if sm.get("draft_checks") else ""
    lines += ["", f"{sm['checks']} graph decode steps checked{drafts}, {sm['failures']} mismatched"
              f"{_flip_count(sm['routing_flips'])}; tokens identical to a "
              f"separate eager run: {_yes(r['tokens_identical'])}{_first_differences(r['first_differences'])}",
              *(f"rank {x['rank']}: {x['checks']} steps checked, {x['failures']} mismatched, logits max|diff| "
                f"{x['max_logit_diff']:.3g}, cache max|diff| {x['max_cache_diff']:.3g}, untouched "
                f"{_yes(x['untouched_ok'])}" for x in r.get("rank_parity") or ()),
              *compile_failure_lines(r["counters"]), f"verdict: {'PASS' if r['ok'] else 'FAIL'}"]
    return "\n".join(lines)


def _flip_count(n) -> str:
    """How many tokens of the checks passed only as routing near-ties (``ParityReport.routing_flips``)."""
    return (f" ({n} token(s) at a router's near-tie: the graph equals eager with that token's K-th expert "
            "swapped for its (K+1)-th, or its last group for the next)") if n else ""


def _flips(flips: list) -> str:
    """A step's routing near-ties that eager, swapped, reproduced (``ParityReport.routing_flips``)."""
    def swap(f: dict) -> str:
        kind = "expert" if "experts" in f else "group"
        old, new = f[f"{kind}s"]
        return f"{kind} {new} for {old}"

    return "".join(f"; token {f['token']} at {f['router']}: {swap(f)} (margin {f['margin']:.1e})" for f in flips)


def format_bench(r: dict) -> str:
    """Throughput per batch size."""
    st = r["settings"]
    widths = st.get("max_model_len_sweep", [])[1:]
    lines = [*model_lines(r), f"each request: {st['prompt_len']} prompt tokens, {st['new_tokens']} new tokens; "
             f"median of {st['rounds']} alternating rounds", "",
             f"{'batch':>5} {'eager tok/s':>12} {'graph tok/s':>12} {'eager ms':>9} {'graph ms':>9} {'speed-up':>8}"
             f" {'live context':>22}" + "".join(f" {f'graph ms @{w}':>16}" for w in widths)]
    for row in r["rows"]:
        e, g = row["eager"], row["graph"]
        sweep = row.get("max_model_len_sweep", {})
        lines.append(f"{row['batch']:>5} {e['tokens_per_s']:>12.1f} {g['tokens_per_s']:>12.1f} "
                     f"{e['ms_per_step']:>9.3f} {g['ms_per_step']:>9.3f} {row['speedup']:>7.2f}x"
                     f" {_context(row['live_context']):>22}"
                     + "".join(f" {sweep[str(w)]['ms_per_step']:>8.3f} ({sweep[str(w)]['over_base']:.2f}x)"
                               for w in widths))
    lines.append(f"graph ms: block tables max_model_len {st['max_model_len']} wide"
                 + (f"; graph ms @N: N wide, (x) over the {st['max_model_len']}-wide step" if widths else ""))
    return "\n".join(lines)
