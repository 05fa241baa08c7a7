"""Graph mode on a CUDA device: Inductor with CUDA graphs (the ``auto`` backend there) and torch's
``cudagraphs`` backend, over the same tuple caches as the eager runner.

Oracles: the eager path of the same runner on the same caches (``compare_step``), an engine with
graph mode off, and torch's profiler, which sees whether a graph step replays a CUDA graph
(``cudaGraphLaunch``) or launches its kernels one by one. These tests need a CUDA device: on a
machine without one (CI) they are skipped, and README's "What has run where" says where and
when they last ran.
"""

from __future__ import annotations

import pytest
import torch
from runner_helpers import Schedule, make_runner, prefilled, small_model
from torch._dynamo.utils import counters

from ascend_graph.config import GraphConfig
from ascend_graph.engine import Engine
from ascend_graph.runner.parity import compare_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SIZES = (1, 4)
DEVICE = "cuda"


def cuda_runner(kind: str, dtype: torch.dtype, backend: str = "auto"):
    model = small_model(kind, dtype).to(DEVICE)
    config = GraphConfig(enabled=True, backend=backend, capture_sizes=SIZES, max_batch_size=max(SIZES))
    return model, make_runner(model, config)


def api_calls(fn) -> dict[str, int]:
    """How often each CUDA runtime/driver call ran during ``fn()`` (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.key: e.count for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))}


def launches(calls: dict[str, int]) -> int:
    """Kernels launched one by one (runtime or driver API)."""
    return sum(n for name, n in calls.items() if "LaunchKernel" in name)


def graph_launches(calls: dict[str, int]) -> int:
    return sum(n for name, n in calls.items() if "GraphLaunch" in name)


@pytest.mark.parametrize("kind", ["llama", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_equals_eager_for_every_size_and_between(kind, dtype):
    """Sizes 1 and 4, batches 1-4 (2 and 3 padded): logits, written blocks and every other block."""
    counters.clear()
    model, runner = cuda_runner(kind, dtype)
    sched = Schedule()
    prefilled(runner, sched, 4, model.config.vocab_size)
    for n in (1, 2, 3, 4):
        report = compare_step(runner, sched.decode_entries()[:n])
        assert report.ok and report.untouched_ok, report.summary()
    assert runner.stats.recompiles == 0 and runner.graph_sizes == SIZES
    # Inductor counts every graph it leaves out of CUDA graphs (mutated non-static inputs, CPU
    # tensors, ...): the caches are written in place as static inputs, so there are none.
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_cuda_graph_step_replays_one_graph_instead_of_launching_kernels():
    """A warm graph step launches the recorded graph, not the step's kernels one by one; the
    eager step of the same batch launches hundreds."""
    model, runner = cuda_runner("mla", torch.bfloat16)
    sched = Schedule()
    prefilled(runner, sched, 3, model.config.vocab_size)
    entries = sched.decode_entries()
    for _ in range(2):  # capture, then a warm replay
        runner.execute(entries, mode="graph")
    graph = api_calls(lambda: runner.execute(entries, mode="graph"))
    eager = api_calls(lambda: runner.execute(entries, mode="eager"))
    print("graph step:", graph, "\neager step:", eager)
    assert graph_launches(graph) == 1, graph
    assert graph_launches(eager) == 0, eager
    # left outside the graph: the padding row's fill of each of the 5 static buffers, and the
    # logits' copy out
    assert launches(graph) <= 8 and 50 <= launches(eager), (launches(graph), launches(eager))


def test_cuda_graph_steps_allocate_nothing_per_step():
    """Twenty graph steps leave the allocator where the first left it (the caches are static)."""
    model, runner = cuda_runner("mla", torch.bfloat16)
    sched = Schedule()
    prefilled(runner, sched, 4, model.config.vocab_size)
    ids = [0, 1, 2, 3]
    entries = sched.decode_entries()
    sched.advance(ids, entries, runner.execute(entries, mode="graph"))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(20):
        entries = sched.decode_entries()
        sched.advance(ids, entries, runner.execute(entries, mode="graph"))
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert runner.stats.graph_steps == 21 and runner.stats.recompiles == 0


def test_torch_cudagraphs_backend_equals_eager():
    model, runner = cuda_runner("mla", torch.bfloat16, backend="cudagraphs")
    sched = Schedule()
    prefilled(runner, sched, 4, model.config.vocab_size)
    for n in (1, 3, 4):
        report = compare_step(runner, sched.decode_entries()[:n])
        assert report.ok and report.untouched_ok, report.summary()


def test_cuda_engine_greedy_tokens_equal_eager():
    """Continuous batching with graph decode steps generates what the eager engine generates
    (float32: in bfloat16 a near-tie may flip a token; the runner tests cover bfloat16 per step)."""
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM

    model = DeepseekForCausalLM(DeepseekConfig.small(), device=DEVICE, seed=0).eval()
    prompts = [[(7 * i + 3 * j) % 256 for j in range(2 + 3 * i)] for i in range(6)]
    budgets = [5, 12, 3, 9, 7, 4]
    kw = dict(block_size=4, max_model_len=64, max_num_seqs=4)
    graph = Engine(model, graph_config=GraphConfig(enabled=True, capture_sizes=SIZES, max_batch_size=4), **kw)
    eager = Engine(model, graph_config=GraphConfig(enabled=False), **kw)
    checked, reports = graph.generate_checked(prompts, budgets)
    assert reports and all(r.ok for r in reports), [r.summary() for r in reports if not r.ok]
    tokens = graph.generate(prompts, budgets)
    assert tokens == checked == eager.generate(prompts, budgets)
    assert graph.stats["graph_steps"] > 0


def test_compiled_moe_reads_each_expert_once_without_gathering_their_weights():
    """One V2-Lite MoE layer's routed experts (64 of 17.3 MB, 6 per token) at 64 tokens, compiled:
    the same sum as the eager form, and no temporary near the 6.6 GB of gathered weights that
    the gathered forms would need (the ``grouped_mm`` MoE backend: ``torch._grouped_mm``)."""
    from types import SimpleNamespace

    from ascend_graph.moe import RoutedExperts, select_moe_backend

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    v2_lite = SimpleNamespace(n_routed_experts=64, hidden_size=2048, moe_intermediate_size=1408)  # V2-Lite's experts
    experts = RoutedExperts(v2_lite, torch.bfloat16, DEVICE)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    x = torch.randn(64, 2048, device=DEVICE, generator=gen).to(torch.bfloat16)
    weights = torch.rand(64, 6, device=DEVICE, generator=gen)
    ids = torch.rand(64, 64, device=DEVICE, generator=gen).argsort(dim=1)[:, :6]
    backend = select_moe_backend(x.device, torch.bfloat16)
    assert backend.name == "grouped_mm", torch.cuda.get_device_capability()
    decode = lambda x, w, ids: backend.decode(experts, x, w, ids)  # noqa: E731
    compiled = torch.compile(decode, backend="inductor", fullgraph=True, dynamic=False)
    with torch.no_grad():
        compiled(x, weights, ids)  # compile
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = compiled(x, weights, ids)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        want = experts.grouped(x, weights, ids)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB of temporaries"
