"""The ``ascend-graph`` command: demo, generate, parity, bench, pd-demo.

Every subcommand takes a model (``--model small`` / ``small-v3``: built-in DeepSeek-shaped models
with seeded random weights, no download; or a DeepSeek V2/V3 checkpoint directory), graph-mode
settings, and ``--json`` (print one JSON object on stdout, nothing else; progress bars stay on
stderr). Bad flag values stop with argparse's usage message; bad requests with ``error: ...``.
Exit codes: 0 ok, 1 parity mismatch, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
from typing import Iterator, Optional, Sequence

import torch

from . import commands
from .commands import BUILTIN_MODELS, DTYPES
from .pd import add_pd_demo, run_pd_demo
from ..config import BACKENDS

EPILOG = """examples:
  ascend-graph demo                                  # the quick start: small model, graph vs eager
  ascend-graph demo --json > demo.json               # the same report as JSON
  ascend-graph generate --prompt-ids 1,2,3 --prompt-ids 7,8 --max-new-tokens 16
  ascend-graph generate --model /path/to/DeepSeek-V2-Lite --prompt "Hello" --no-graph
  ascend-graph parity --model small-v3               # exit code 1 when graph and eager disagree
  ascend-graph bench --batch-sizes 1,2,4,8 --json    # decode tokens/s per batch size
  ascend-graph bench --max-model-len-sweep 4096,32768   # the same steps with wider block tables
  ascend-graph pd-demo --transport mooncake --json   # prefill and decode in two processes
  ascend-graph generate --prompt-ids 1,2,3 --tensor-parallel-size 2 --json   # two ranks of this host
"""


def positive_ints(text: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``; argparse reports anything else as a usage error."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def token_ids(text: str) -> list[int]:
    """``"1,2,3"`` -> ``[1, 2, 3]`` (the vocabulary range is checked by the engine)."""
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def positive_int(text: str, least: int = 1) -> int:
    """An integer >= ``least`` (1); argparse reports anything else as a usage error."""
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        what = "a positive integer" if least == 1 else f"an integer >= {least}"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0 (``positive_int``)."""
    return positive_int(text, 0)


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model and graph mode")
    g.add_argument("--model", default="small", metavar="small|small-v3|PATH",
                   help="built-in model (random weights) or a DeepSeek V2/V3 checkpoint directory (default: small)")
    g.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="weight dtype (default: float32 built-in, the checkpoint's own otherwise)")
    g.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    g.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="torch.compile backend (default: auto = Inductor on CPU/CUDA, torchair on NPU)")
    g.add_argument("--capture-sizes", type=positive_ints, default=(1, 2, 4, 8), metavar="N,N,...",
                   help="decode batch sizes captured as graphs (default: 1,2,4,8)")
    g.add_argument("--aot-inductor", action="store_true",
                   help="CPU: compile each capture size ahead of time into an AOTInductor package, loaded "
                        "instead of compiled by later runs with the same --compile-cache-dir (GraphConfig.inductor.aot)")
    g.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=None,
                   help="CPU: save each compiled step (trace and code) under the compile cache; later runs with the "
                        "same --compile-cache-dir load it instead of tracing (GraphConfig.inductor.precompile; "
                        "default: on wherever it applies)")
    g.add_argument("--graph-config", default=None, metavar="JSON|FILE",
                   help="graph settings over the flags above: a JSON object (or a file holding one) of GraphConfig "
                        "keys and/or vllm-ascend's torchair_graph_config / additional_config; its 'enabled' "
                        "yields to the command (docs/configuration.md)")
    g.add_argument("--compile-cache-dir", default=None, metavar="PATH",
                   help="persistent compile cache and AOTInductor packages (default: the backend's own)")
    g.add_argument("--block-size", type=positive_int, default=None,
                   help="tokens per cache block (default: the attention backend's: 16, 128 on an NPU)")
    g.add_argument("--max-model-len", type=positive_int, default=512,
                   help="longest prompt + generation (default: 512)")
    g.add_argument("--num-speculative-tokens", type=non_negative_int, default=0, metavar="K",
                   help="K > 0: draft K tokens per step with the model's MTP layer (small-v3, a V3 checkpoint; "
                        "K > 1 chains it) and verify them in the next, greedily; capture sizes then count "
                        "requests of 1 + K rows (default: 0)")
    g.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: 1 for built-in models, torch's default otherwise)")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout and nothing else")
    g.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("ranks (processes of this host; docs/distributed.md for several hosts)")
    g.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, metavar="N",
                   help="split each layer's heads and features over N ranks (default: 1)")
    g.add_argument("--data-parallel-size", "-dp", type=positive_int, default=1, metavar="N",
                   help="N replicas of the attention, each serving its own requests (default: 1)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="spread the routed experts over all tp * dp ranks")


def _workload_args(p: argparse.ArgumentParser, requests: int, new_tokens: int) -> None:
    g = p.add_argument_group("requests")
    g.add_argument("--num-requests", type=positive_int, default=requests,
                   help=f"synthetic requests of different lengths (default: {requests})")
    g.add_argument("--max-new-tokens", type=positive_int, default=new_tokens,
                   help=f"tokens the longest request generates; others fewer (default: {new_tokens})")
    g.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="requests running at once (default: the largest capture size)")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed")
    g.add_argument("--stop-token-ids", type=token_ids, default=None, metavar="ID,ID,...",
                   help="extra tokens that end a request (the model's EOS always does)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``ascend-graph``."""
    parser = argparse.ArgumentParser(
        prog="ascend-graph", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Graph-mode decoding for DeepSeek V2/V3 (MLA + MoE) over tuple KV caches: decode steps "
                    "run as captured graphs, prefill eagerly on the same caches.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_demo(_command(sub, "demo", "serve requests on the built-in model, graph vs eager: capture, throughput, "
                                    "parity, counters", ranks=True))
    _add_generate(_command(sub, "generate", "generate from token ids or text", ranks=True))
    par = _command(sub, "parity", "graph vs eager step by step (compare_step); exit 1 on mismatch", ranks=True)
    _workload_args(par, requests=6, new_tokens=24)
    _add_bench(_command(sub, "bench", "decode throughput graph vs eager per batch size", ranks=True))
    add_pd_demo(_command(sub, "pd-demo", "prefill and decode in two processes: KV blocks moved by a transfer "
                                         "engine into the decode graphs' static caches"))
    return parser


def _command(sub, name: str, summary: str, ranks: bool = False) -> argparse.ArgumentParser:
    """A subcommand whose description is its ``run_`` function's docstring, with the model flags
    (and with ``ranks``, the parallel flags)."""
    p = sub.add_parser(name, help=summary, description=_doc(name),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _model_args(p)
    if ranks:
        _parallel_args(p)
    return p


def _add_demo(p: argparse.ArgumentParser) -> None:
    _workload_args(p, requests=10, new_tokens=48)
    p.add_argument("--rounds", type=positive_int, default=3, help="timing rounds per mode (default: 3)")


def _add_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-ids", type=token_ids, action="append", default=[], metavar="ID,ID,...",
                   help="a prompt as token ids (repeat for more requests)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a text prompt (needs a checkpoint with a tokenizer; repeatable)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32, help="tokens per request (default: 32)")
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                   help="decode through captured graphs (default) or eagerly (--no-graph)")
    _sampling_args(p)


def _add_bench(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", dest="capture_sizes", type=positive_ints, metavar="N,N,...",
                   help="batch sizes to measure, each captured as a graph (same as --capture-sizes)")
    p.add_argument("--prompt-len", type=positive_int, default=32, help="prompt tokens (default: 32)")
    p.add_argument("--new-tokens", type=positive_int, default=32, help="tokens per request (default: 32)")
    p.add_argument("--rounds", type=positive_int, default=3, help="timing rounds per mode (default: 3)")
    p.add_argument("--max-model-len-sweep", type=positive_ints, default=None, metavar="N,N,...",
                   help="also graph engines whose block tables are N tokens wide (same cache blocks, same "
                        "requests), timed in the same rounds: the step should cost the same at every width")
    p.add_argument("--output", default=None, metavar="FILE", help="also write the JSON result to FILE")


def _run(command: str):
    return run_pd_demo if command == "pd-demo" else getattr(commands, f"run_{command}")


def _doc(command: str) -> str:
    return inspect.cleandoc(_run(command).__doc__)


@contextlib.contextmanager
def _threads(n: Optional[int]) -> Iterator[None]:
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``ascend-graph`` with ``argv`` (default: the process arguments); returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.threads is None and args.model in BUILTIN_MODELS:
        args.threads = 1  # the tiny built-in models run fastest on one thread
    try:
        with _threads(args.threads):
            result, text, code = _run(args.command)(args)
    except (ValueError, FileNotFoundError, ImportError) as e:
        print(f"ascend-graph {args.command}: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(text)
    output = getattr(args, "output", None)
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return code


if __name__ == "__main__":
    sys.exit(main())
