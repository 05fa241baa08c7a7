"""Generate with the engine in graph mode: the built-in small DeepSeek model, or a checkpoint.

Prompts prefill eagerly; decode steps run as captured graphs (one per capture size) on the same
tuple MLA caches; requests join and leave the running batch as they finish.

    python examples/generate.py                                   # built-in model, token-id prompts
    python examples/generate.py --model /path/to/DeepSeek-V2-Lite --prompt "The capital of France is"
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

from ascend_graph import GraphConfig  # noqa: E402
from ascend_graph.engine import Engine  # noqa: E402
from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM  # noqa: E402


def build_engine(args: argparse.Namespace) -> Engine:
    """Graph mode on (unless --no-graph), capture sizes from the flags."""
    sizes = tuple(int(s) for s in args.capture_sizes.split(","))
    config = GraphConfig(enabled=args.graph, backend=args.backend, capture_sizes=sizes, max_batch_size=max(sizes))
    if args.model == "small":
        model = DeepseekForCausalLM(DeepseekConfig.small(), seed=0).eval()
        return Engine(model, graph_config=config, max_model_len=args.max_model_len)
    return Engine.from_pretrained(args.model, graph_config=config, max_model_len=args.max_model_len)


def main(argv=None) -> list[list[int]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small", help="'small' (built-in, random weights) or a checkpoint directory")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (checkpoint with a tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--capture-sizes", default="1,2,4", help="decode batch sizes run as graphs (default: 1,2,4)")
    p.add_argument("--backend", default="auto", help="auto = Inductor on CPU/CUDA, torchair on NPU")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True)
    args = p.parse_args(argv)
    if args.model == "small":
        torch.set_num_threads(1)  # the tiny model runs fastest on one thread
    engine = build_engine(args)
    vocab = engine.model.config.vocab_size
    prompts = args.prompt or [[(5 * i + 7 * j) % vocab for j in range(n)] for i, n in enumerate((3, 11, 6))]
    engine.capture()
    tokens = engine.generate(prompts, args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                             show_progress=True)
    for prompt, out in zip(prompts, tokens):
        shown = engine.decode(out) if args.prompt else out
        print(f"{prompt!r}\n  -> {shown!r}")
    s = engine.stats
    print(f"graph steps {s['graph_steps']}, eager steps {s['eager_steps']}, recompiles {s['recompiles']}, "
          f"decode {s['decode_tokens_per_s']:.0f} tokens/s, decode batch sizes {s['decode_batch_sizes']}")
    return tokens


if __name__ == "__main__":
    main()
