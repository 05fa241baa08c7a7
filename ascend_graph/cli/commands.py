"""What the ``ascend-graph`` subcommands do (``cli.py`` parses the flags).

Each ``run_<command>(args)`` returns ``(result, text, exit_code)``: a JSON-safe dict, the same
result as a readable report, and the exit code. Graph and eager are always measured on the same
model object and the same requests, by two engines (graph mode on / off) with equal cache
geometry, timed in alternating rounds so that machine drift hits both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import replace
from typing import Optional, Sequence

import torch
from torch import nn

from .. import runtime
from ..config import GraphConfig, InductorOptions
from ..config_sources import from_json
from ..engine.engine import Engine
from ..engine.model_source import FromCheckpoint, FromName
from ..models.named import BUILTIN_MODELS, named_model
from ..runner.parity import ParityReport, allowed_difference, tolerances
from .ranks import parallel_sizes, parity_by_rank, ranks_on_top
from .report import capture_start, format_bench, format_demo, format_generate, format_parity

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- model, engines, workload -------------------------------------------------------------------


def load_model(args: argparse.Namespace) -> tuple[nn.Module, dict]:
    """The model ``--model`` names (built-in with seed-0 weights, or a checkpoint) and a description."""
    model, source = named_model(args.model, DTYPES[args.dtype] if args.dtype else None, args.device,
                                mtp_layers=min(getattr(args, "num_speculative_tokens", 0), 1))
    return model, describe(model, source)


def open_engines(args: argparse.Namespace, graph: bool = True, with_eager: bool = True,
                 max_num_seqs: Optional[int] = None, **kwargs) -> tuple[Engine, Optional[Engine], dict]:
    """``(engine, eager engine or None, model description)`` for ``--model``. On one process the
    two engines share the model object; on several (``--tensor-parallel-size``, ...) every rank
    builds its own share of the model, and the eager engine is the first's ``eager_twin`` (one
    process forms one set of ranks)."""
    sizes = parallel_sizes(args)
    if sizes["tensor_parallel_size"] * sizes["data_parallel_size"] == 1:
        model, info = load_model(args)
        main = make_engine(model, args, graph, max_num_seqs, **kwargs)
        return main, make_engine(model, args, False, max_num_seqs) if with_eager else None, info
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.model in BUILTIN_MODELS:
        source, text = FromName(args.model, dtype, args.device), f"built-in '{args.model}' (seeded random weights)"
    elif os.path.isdir(args.model):
        source, text = FromCheckpoint(args.model, dtype, args.device), f"checkpoint {args.model}"
    else:
        named_model(args.model)  # raises the single-process error naming the model
    main = make_engine(source, args, graph, max_num_seqs, **kwargs)
    info = {**describe(main.model, text), "parameters_of": "rank 0's share", **sizes}
    return main, main.eager_twin() if with_eager else None, info


def describe(model: nn.Module, source: str) -> dict:
    """The model's shape in a few numbers."""
    c = model.config
    return {"source": source, "architecture": c.architectures[0], "layers": c.num_hidden_layers,
            "hidden_size": c.hidden_size, "heads": c.num_attention_heads, "kv_lora_rank": c.kv_lora_rank,
            "q_lora_rank": c.q_lora_rank, "routed_experts": c.n_routed_experts, "vocab_size": c.vocab_size,
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(model.dtype).split(".")[-1]}


def make_engine(model: nn.Module, args: argparse.Namespace, graph: bool, max_num_seqs: Optional[int] = None,
                **kwargs) -> Engine:
    """An engine with the flags' cache geometry; graph mode ``graph``."""
    config = graph_config(args, graph)
    seats = max_num_seqs or getattr(args, "max_num_seqs", None) or config.max_batch_size
    return Engine(model, graph_config=config, block_size=args.block_size, max_model_len=args.max_model_len,
                  max_num_seqs=seats, device=args.device, **parallel_sizes(args),
                  num_speculative_tokens=getattr(args, "num_speculative_tokens", 0), **kwargs)


def graph_config(args: argparse.Namespace, graph: bool) -> GraphConfig:
    """The flags' graph settings, ``--graph-config`` over them, graph mode ``graph`` whatever it says."""
    sizes = tuple(sorted(set(args.capture_sizes)))
    config = GraphConfig(enabled=True, backend=args.backend, capture_sizes=sizes, max_batch_size=max(sizes),
                         inductor=InductorOptions(aot=args.aot_inductor, precompile=getattr(args, "precompile", None)),
                         compile_cache_dir=args.compile_cache_dir)
    text = getattr(args, "graph_config", None)
    if text:
        if not text.lstrip().startswith("{"):
            with open(text, encoding="utf-8") as f:
                text = f.read()
        try:
            config = from_json(text, base=config, source="--graph-config")
        except TypeError as e:  # a bad request, reported as one (exit code 2)
            raise ValueError(str(e)) from None
    return replace(config, enabled=graph)


def workload(vocab: int, num: int, max_new: int, max_model_len: int, seed: int = 0) -> tuple[list, list]:
    """``num`` seeded random prompts of 4..40 tokens (mixed order) and budgets from ``max_new`` down to
    about half of it, each fitting ``max_model_len``."""
    gen = torch.Generator().manual_seed(seed)
    budgets = [max(1, max_new - i * max_new // (2 * num)) for i in range(num)]
    lens = [max(1, min(4 + (i * 23) % 37, max_model_len - b)) for i, b in enumerate(budgets)]
    if any(n + b > max_model_len for n, b in zip(lens, budgets)):
        raise ValueError(f"--max-new-tokens={max_new} leaves no room for a prompt in --max-model-len={max_model_len}")
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lens], budgets


def measure_decode(engines: dict[str, Engine], prompts: list, budgets: list, rounds: int) -> dict:
    """Median decode tokens/s and ms per decode step of each engine over ``rounds`` alternating runs."""
    return measure_runs({name: (engine, prompts, budgets) for name, engine in engines.items()}, rounds)


def measure_runs(runs: dict[str, tuple[Engine, list, list]], rounds: int) -> dict:
    """``measure_decode`` where each run has its own engine and requests: ``name -> (engine,
    prompts, budgets)``, the runs taking turns in each of ``rounds``."""
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (engine, prompts, budgets) in runs.items():
            c = engine.counters
            tokens, seconds, steps = c.decode_tokens, c.decode_seconds, c.decode_steps
            engine.generate(prompts, budgets, ignore_eos=True)
            seconds = c.decode_seconds - seconds
            samples[name].append(((c.decode_tokens - tokens) / seconds, 1e3 * seconds / (c.decode_steps - steps)))
    return {name: {"tokens_per_s": round(statistics.median(s[0] for s in rows), 1),
                   "ms_per_step": round(statistics.median(s[1] for s in rows), 3)} for name, rows in samples.items()}


def decode_contexts(prompt_lens: Sequence[int], budgets: Sequence[int]) -> dict:
    """The live context of every decode row the requests run: one of ``p`` prompt tokens and ``b``
    new tokens (the first from its prefill) decodes at ``p + 1 .. p + b - 1`` tokens, this
    step's included. Their least, largest and mean, and how many rows (None where none decode)."""
    ctx = [p + k for p, b in zip(prompt_lens, budgets) for k in range(1, b)]
    if not ctx:
        return {"min": None, "max": None, "mean": None, "rows": 0}
    return {"min": min(ctx), "max": max(ctx), "mean": round(statistics.fmean(ctx), 1), "rows": len(ctx)}


PROBE_NEW_TOKENS = 8  # tokens per request of the demo's decode-by-context probe


def decode_by_context(graph: Engine, vocab: int, workload_prompts: list, rounds: int) -> dict:
    """The graph engine's decode step at the workload's live context and near its max_model_len:
    as many requests as it seats, ``PROBE_NEW_TOKENS`` each, prompts of the workload's mean length
    and of ``max_model_len - PROBE_NEW_TOKENS``, the two taking turns for ``rounds``. The graph's
    block tables are max_model_len wide in both; only the live context differs."""
    room = graph.max_model_len - (graph.spec.k if graph.spec else 0)  # a draft slot past the last token
    new = min(PROBE_NEW_TOKENS, room - 1)
    short = max(1, min(round(statistics.fmean(len(p) for p in workload_prompts)), room - new))
    gen, n = torch.Generator().manual_seed(1), graph.max_num_seqs
    runs = {name: [torch.randint(0, vocab, (length,), generator=gen).tolist() for _ in range(n)]
            for name, length in (("workload_context", short), ("near_max_model_len", room - new))}
    speed = measure_runs({name: (graph, prompts, [new] * n) for name, prompts in runs.items()}, rounds)
    out = {"max_model_len": graph.max_model_len, "block_table_blocks": graph.runner.table_width, "rows": n,
           "new_tokens": new, "rounds": rounds}
    for name, prompts in runs.items():
        out[name] = {"live_context": decode_contexts([len(p) for p in prompts], [new] * n), **speed[name]}
    out["near_max_over_workload"] = round(out["near_max_model_len"]["ms_per_step"]
                                          / out["workload_context"]["ms_per_step"], 2)
    return out


def conditions(args: argparse.Namespace) -> dict:
    """What the figures were measured on (``runtime.machine``), the device and compile workers."""
    return {**runtime.machine(args.device), "device": args.device,
            "compile_threads": os.environ.get("TORCHINDUCTOR_COMPILE_THREADS", "default")}


def settings(args: argparse.Namespace, engine: Engine) -> dict:
    """The graph and cache settings a run used."""
    return {"backend": engine.graph_config.backend, "capture_sizes": list(engine.runner.capture_sizes),
            "block_size": engine.block_size, "max_model_len": engine.max_model_len,
            "max_num_seqs": engine.max_num_seqs, "num_blocks": engine.num_blocks,
            "backends": engine.runner.backends()}


# -- parity bookkeeping ---------------------------------------------------------------------------


def logit_agreement(a_tokens: list, b_tokens: list, a_logits: list, b_logits: list, dtype: torch.dtype,
                    flips: Sequence[dict] = ()) -> dict:
    """Whether two greedy runs (a: graph, b: eager) chose the same tokens, their max logit
    difference up to the first differing token of each request (later logits follow different
    prefixes), and each request's first differing token.

    A difference is a near-tie when the two runs' margins between the two tokens add up to at
    most twice the parity tolerance of that row (``parity.allowed_difference``): exactly what
    two rows of logits that pass ``compare_step`` can do. It follows a routing near-tie when
    one of ``flips`` (the graph run's reproduced router near-ties, ``Engine.generate_checked``)
    came at or before the difference's step: compare_step proved that step's graph equal to
    eager with one router choice swapped, and from there the two runs continue from different
    experts, which changes how every token of the batch is grouped and rounded.
    ``tokens_agree``: every difference is one or the other.
    """
    atol, rtol = tolerances(dtype)
    worst, rows, firsts = 0.0, 0, []
    for i, (a, b, la, lb) in enumerate(zip(a_tokens, b_tokens, a_logits, b_logits)):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)) - 1)
        worst = max(worst, (la[:k + 1] - lb[:k + 1]).abs().max().item())
        rows += k + 1
        if a[k] != b[k]:
            margins = [(la[k, a[k]] - la[k, b[k]]).item(), (lb[k, b[k]] - lb[k, a[k]]).item()]
            allowed = allowed_difference(lb[k], atol, rtol).item()
            routed = any(f.get("positions", {}).get(i, k + 1) <= k for f in flips)
            firsts.append({"request": i, "position": k, "tokens": [a[k], b[k]], "margins": margins,
                           "allowed": allowed, "near_tie": sum(margins) <= 2 * allowed,
                           "after_routing_near_tie": routed})
    agree = all(f["near_tie"] or f["after_routing_near_tie"] for f in firsts)
    return {"tokens_identical": a_tokens == b_tokens, "tokens_agree": agree,
            "first_differences": firsts, "max_logit_diff": worst, "logit_rows_compared": rows}


def reports_summary(reports: Sequence[ParityReport]) -> dict:
    """Totals and worst differences of ``compare_step`` reports."""
    cache = [d["max_abs"] for r in reports for layer in r.caches for d in layer.values()]
    return {"checks": len(reports), "draft_checks": sum(r.kind == "draft" for r in reports),
            "failures": sum(not r.ok for r in reports),
            "routing_flips": sum(len(r.routing_flips) for r in reports),
            "max_logit_diff": max((r.logits["max_abs"] for r in reports), default=None),
            "max_cache_diff": max(cache, default=None),
            "untouched_ok": all(r.untouched_ok is not False for r in reports) if reports else None}


# -- the subcommands ------------------------------------------------------------------------------


def run_demo(args: argparse.Namespace) -> tuple[dict, str, int]:
    """Serve requests of different lengths with graph mode on, then eagerly, and report.

    The report: capture time and memory per batch size; decode throughput graph vs eager (same
    model, same requests, alternating rounds); parity (graph tokens vs eager tokens, max logit
    difference, and compare_step checks of every graph decode step: logits, written cache blocks,
    untouched blocks); the graph's decode step at the workload's live context and near
    --max-model-len, block tables as wide in both; the counters. Exit code 1 when graph and
    eager disagree: a step beyond tolerance, or tokens that differ other than at a near-tie
    (bfloat16 runs may flip those).
    """
    start = time.perf_counter()
    graph, eager, info = open_engines(args)
    model = graph.model
    prompts, budgets = workload(model.config.vocab_size, args.num_requests, args.max_new_tokens,
                                args.max_model_len - args.num_speculative_tokens)
    graph.capture(show_progress=not args.no_progress)
    g_tokens, g_logits = graph.generate(prompts, budgets, ignore_eos=True, return_logits=True,
                                        show_progress=not args.no_progress)
    e_tokens, e_logits = eager.generate(prompts, budgets, ignore_eos=True, return_logits=True)
    (c_tokens, c_logits), reports = graph.generate_checked(prompts, budgets, ignore_eos=True, return_logits=True)
    flips = [f for r in reports for f in r.routing_flips]
    checked = logit_agreement(c_tokens, e_tokens, c_logits, e_logits, model.dtype, flips)
    parity = {**logit_agreement(g_tokens, e_tokens, g_logits, e_logits, model.dtype, flips),
              "compare_step": reports_summary(reports), "checked_run_tokens_identical": checked["tokens_identical"],
              "checked_run_tokens_agree": checked["tokens_agree"]}
    parity["ranks"] = parity_by_rank(graph)
    parity["ok"] = bool(parity["tokens_agree"] and parity["checked_run_tokens_agree"] and reports
                        and not parity["compare_step"]["failures"]
                        and not any(r["failures"] for r in parity["ranks"] or ()))
    speed = measure_decode({"eager": eager, "graph": graph}, prompts, budgets, args.rounds)
    speed["speedup"] = round(speed["graph"]["tokens_per_s"] / speed["eager"]["tokens_per_s"], 2)
    counters = graph.stats  # before the probe below: the counters of the workload's runs
    lens = [len(p) for p in prompts]
    result = {"command": "demo", "model": info, "settings": settings(args, graph), "conditions": conditions(args),
              "requests": {"count": len(prompts), "prompt_lens": lens, "new_tokens": budgets,
                           "live_context": decode_contexts(lens, budgets)},
              "capture": graph.stats["capture"], "capture_seconds": graph.stats["capture_seconds"],
              "capture_start": capture_start(graph.stats["capture"]),
              "throughput": {**speed, "rounds": args.rounds}, "parity": parity,
              "decode_step": decode_by_context(graph, model.config.vocab_size, prompts, args.rounds),
              "counters": counters, "eager_counters": eager.stats, "sample": {"prompt": prompts[0],
                                                                              "tokens": g_tokens[0]},
              "seconds": round(time.perf_counter() - start, 1)}
    return ranks_on_top(result), format_demo(result), 0 if parity["ok"] else 1


def run_generate(args: argparse.Namespace) -> tuple[dict, str, int]:
    """Generate continuations of the given prompts (token ids, or text with a tokenizer).

    Greedy unless --temperature > 0. Graph mode on unless --no-graph.
    """
    prompts = [*args.prompt_ids, *args.prompt]
    if not prompts:
        raise ValueError("give at least one --prompt-ids or --prompt")
    tokenizer = None if args.model in BUILTIN_MODELS else args.model  # loaded when first needed
    engine, _, info = open_engines(args, args.graph, False, max(args.capture_sizes), tokenizer=tokenizer)
    engine.capture(show_progress=not args.no_progress and args.graph)
    start = time.perf_counter()
    tokens = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                             top_p=args.top_p, seed=args.seed, stop_token_ids=args.stop_token_ids,
                             show_progress=not args.no_progress)
    outputs = [{"prompt": p, "tokens": t, "text": _text(engine, t) if args.prompt else None}
               for p, t in zip(prompts, tokens)]
    result = {"command": "generate", "model": info, "settings": settings(args, engine), "graph": args.graph,
              "outputs": outputs, "seconds": round(time.perf_counter() - start, 3), "counters": engine.stats}
    return ranks_on_top(result), format_generate(result), 0


def _text(engine: Engine, tokens: list[int]) -> Optional[str]:
    return engine.decode(tokens) if engine.tokenizer is not None else None


def run_parity(args: argparse.Namespace) -> tuple[dict, str, int]:
    """Serve the same requests with every graph decode step checked against eager (compare_step).

    Per step: max logit and cache differences, and whether blocks outside the step stayed
    untouched; plus the tokens of a separate eager run, which may differ only at a near-tie (the two
    tokens within tolerance of each other in both runs). Exit code 1 on any mismatch.
    """
    graph, eager, info = open_engines(args)
    model = graph.model
    prompts, budgets = workload(model.config.vocab_size, args.num_requests, args.max_new_tokens,
                                args.max_model_len - args.num_speculative_tokens)
    graph.capture(show_progress=not args.no_progress)
    (tokens, logits), reports = graph.generate_checked(prompts, budgets, ignore_eos=True, return_logits=True,
                                                       show_progress=not args.no_progress)
    eager_tokens, eager_logits = eager.generate(prompts, budgets, ignore_eos=True, return_logits=True)
    agreement = logit_agreement(tokens, eager_tokens, logits, eager_logits, model.dtype,
                                [f for r in reports for f in r.routing_flips])
    steps = [{"step": i, "kind": r.kind, "batch_size": r.batch_size, "ok": r.ok, "logits_max_abs": r.logits["max_abs"],
              "caches_max_abs": max((d["max_abs"] for layer in r.caches for d in layer.values()), default=0.0),
              "untouched_ok": r.untouched_ok, "untouched_changed": r.untouched_changed,
              "routing_flips": r.routing_flips} for i, r in enumerate(reports)]
    summary = reports_summary(reports)
    by_rank = parity_by_rank(graph)
    ok = (bool(reports) and not summary["failures"] and agreement["tokens_agree"]
          and not any(r["failures"] for r in by_rank or ()))
    result = {"command": "parity", "model": info, "settings": settings(args, graph), "ok": ok,
              "tokens_identical": agreement["tokens_identical"], "tokens_agree": agreement["tokens_agree"],
              "first_differences": agreement["first_differences"], "summary": summary, "steps": steps,
              "counters": graph.stats}
    if by_rank is not None:
        result["rank_parity"] = by_rank
    return ranks_on_top(result), format_parity(result), 0 if ok else 1


def run_bench(args: argparse.Namespace) -> tuple[dict, str, int]:
    """Decode throughput graph vs eager for each batch size (the capture sizes).

    For batch size n, n requests of --prompt-len tokens generate --new-tokens each, all running
    together, so every decode step has n rows; graph and eager engines alternate for --rounds.
    Each row names the live context its decode steps ran at. --max-model-len-sweep adds graph
    engines whose block tables are that many tokens wide, timed in the same rounds: decode
    attention reads the live blocks only, so their steps should cost what the base engine's do.
    """
    widths = sorted(set(args.max_model_len_sweep or ()) - {args.max_model_len})
    for length in (args.max_model_len, *widths):
        if args.prompt_len + args.new_tokens > length:
            raise ValueError(f"--prompt-len + --new-tokens = {args.prompt_len + args.new_tokens} exceeds "
                             f"max_model_len {length} (--max-model-len, --max-model-len-sweep)")
    if widths and parallel_sizes(args)["tensor_parallel_size"] * parallel_sizes(args)["data_parallel_size"] > 1:
        raise ValueError("--max-model-len-sweep runs one process (its engines would each need their own ranks); "
                         "drop it or --tensor-parallel-size/--data-parallel-size")
    sizes = sorted(set(args.capture_sizes))
    graph, eager, info = open_engines(args, max_num_seqs=max(sizes))
    model = graph.model
    engines = {"eager": eager, "graph": graph}
    for length in widths:  # the same cache blocks, graphs whose block tables are ``length`` wide
        engines[f"graph@{length}"] = make_engine(model, argparse.Namespace(**{**vars(args), "max_model_len": length}),
                                                 True, max(sizes), num_blocks=graph.num_blocks)
    for name, engine in engines.items():
        if name != "eager":
            engine.capture(show_progress=not args.no_progress)
    gen, rows = torch.Generator().manual_seed(0), []
    for n in sizes:
        prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(n)]
        for engine in engines.values():  # warm-up: first runs of a batch shape are slower
            engine.generate(prompts, args.new_tokens, ignore_eos=True)
        t = measure_decode(engines, prompts, [args.new_tokens] * n, args.rounds)
        rows.append({"batch": n, "eager": t["eager"], "graph": t["graph"],
                     "speedup": round(t["graph"]["tokens_per_s"] / t["eager"]["tokens_per_s"], 2),
                     "live_context": decode_contexts([args.prompt_len] * n, [args.new_tokens] * n)})
        if widths:
            rows[-1]["max_model_len_sweep"] = width_sweep(t, args.max_model_len)
    result = {"command": "bench", "benchmark": "engine_decode_throughput", "model": info,
              "settings": {**settings(args, graph), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                           "rounds": args.rounds, "max_model_len_sweep": [args.max_model_len, *widths]},
              "conditions": conditions(args), "capture": graph.stats["capture"], "rows": rows,
              "counters": graph.stats}
    return ranks_on_top(result), format_bench(result), 0


def width_sweep(times: dict, base_len: int) -> dict:
    """The graph engines of ``times`` (``graph``: the one ``base_len`` wide; ``graph@L``: ``L``
    wide) by max_model_len: tokens/s, ms per step, and ms per step over the base engine's."""
    base = times["graph"]["ms_per_step"]
    engines = {base_len: times["graph"], **{int(k.split("@")[1]): v for k, v in times.items() if "@" in k}}
    return {str(length): {**t, "over_base": round(t["ms_per_step"] / base, 3)} for length, t in sorted(engines.items())}
