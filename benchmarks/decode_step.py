"""Decode-step time, graph vs eager, per capture size, measured side by side in one run.

Both modes run through the same runner on the same caches (``execute(mode="graph"|"eager")``),
interleaved, after the graphs were captured. Host preparation (metadata, padding, copies into
the static buffers) is part of each step, as in serving.

    TORCHINDUCTOR_COMPILE_THREADS=1 python benchmarks/decode_step.py --model mla --json out.json
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from common import conditions, interleaved_medians, write_json  # noqa: E402

from ascend_graph.block_manager import BlockManager  # noqa: E402
from ascend_graph.config import GraphConfig  # noqa: E402
from ascend_graph.runner import GraphRunner, SequenceStep  # noqa: E402


def build_model(kind: str, dtype: torch.dtype) -> torch.nn.Module:
    """The built-in small model of ``kind`` with seeded random weights."""
    torch.manual_seed(0)
    if kind == "llama":
        from ascend_graph.models.llama import LlamaConfig, LlamaForCausalLM
        return LlamaForCausalLM(LlamaConfig()).to(dtype).eval()
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
    return DeepseekForCausalLM(DeepseekConfig.small()).to(dtype).eval()


def decode_batch(runner: GraphRunner, blocks: BlockManager, n: int, context: int) -> list[SequenceStep]:
    """``n`` sequences with ``context - 1`` tokens prefilled (eagerly); their next decode step."""
    vocab = runner.model.config.vocab_size
    entries = []
    for i in range(n):
        seq_id = (n, i)
        prompt = [(7 * i + j) % vocab for j in range(context - 1)]
        runner.execute([SequenceStep(prompt, 0, blocks.ensure(seq_id, context - 1))], mode="eager")
        entries.append(SequenceStep([1], context - 1, blocks.ensure(seq_id, context)))
    return entries


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["mla", "llama"], default="mla")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    sizes = tuple(int(s) for s in args.sizes.split(","))
    model = build_model(args.model, getattr(torch, args.dtype))
    block_size = 16
    num_blocks = 2 + sum(sizes) * -(-args.context // block_size)
    config = GraphConfig(enabled=True, backend=args.backend, capture_sizes=sizes, max_batch_size=max(sizes))
    runner = GraphRunner(model, config, num_blocks=num_blocks, block_size=block_size,
                         max_model_len=args.context)
    runner.capture()
    blocks, rows = BlockManager(num_blocks, block_size), []
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'speed-up':>8}")
    for n in sizes:
        entries = decode_batch(runner, blocks, n, args.context)
        t = interleaved_medians({"eager": lambda: runner.execute(entries, mode="eager"),
                                 "graph": lambda: runner.execute(entries, mode="graph")}, rounds=args.rounds)
        rows.append({"batch": n, "eager_s": t["eager"], "graph_s": t["graph"], "speedup": t["eager"] / t["graph"]})
        print(f"{n:>5} {t['eager'] * 1e3:>9.3f} {t['graph'] * 1e3:>9.3f} {t['eager'] / t['graph']:>7.2f}x")
    result = {"benchmark": "decode_step", "model": args.model, "dtype": args.dtype, "context": args.context,
              "backend": args.backend, "conditions": conditions(), "capture": runner.stats.to_dict()["capture"],
              "rows": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
