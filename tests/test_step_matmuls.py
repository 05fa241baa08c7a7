"""The suite's matmul floor (``benchmarks.compute.StepMatmuls``): it must replay exactly the
products an eager decode step makes, minus the routed experts', with the step's own operands.

Oracle: the eager runner. The replayed LM head product must equal the step's logits bit for bit,
and every weight matrix the step multiplies (all but the embedding and the routed experts) must
be an operand of some replayed call.
"""

import pytest
import torch

from ascend_graph.engine.block_manager import BlockManager
from ascend_graph.config import GraphConfig
from ascend_graph.moe import RoutedExperts
from benchmarks.compute import StepMatmuls, _MatmulRecorder, onednn_linear, onednn_packs, pack_for_onednn
from benchmarks.models import decode_batch, make_runner
from runner_helpers import small_model


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_the_replay_is_the_step_s_products_except_the_routed_experts():
    model = small_model("mla_long_rows")
    model.select_backends(attention="reference")  # the floor records through it: the same logits
    runner = make_runner(model, GraphConfig(enabled=False), (4,), 16)
    entries = decode_batch(runner, BlockManager(runner.num_blocks, runner.block_size), 4, 16)
    logits = runner.execute(entries, mode="eager")  # the step rewrites the same slots each time
    floor = StepMatmuls(model, lambda: runner.execute(entries, mode="eager"))
    outs = floor()

    experts = storages(p for m in model.modules() if isinstance(m, RoutedExperts) for p in m.parameters())
    operands = storages(t for _, args, kwargs in floor.calls
                        for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
    weights = storages(p for name, p in model.named_parameters()
                       if p.dim() >= 2 and "embed_tokens" not in name and ".experts." not in name
                       and not name.endswith("kv_b_proj.weight"))  # read as its derived w_uk_t / w_uv
    weights |= storages(b for name, b in model.named_buffers() if name.endswith((".w_uk_t", ".w_uv")))
    assert floor.skipped > 0 and not operands & experts
    assert weights <= operands, "a weight matrix of the step is missing from the replay"
    assert torch.equal(outs[-1], logits)
    assert len(outs) == len(floor.calls) and all(isinstance(o, torch.Tensor) for o in outs)


def test_the_pre_packed_replay_computes_the_same_products():
    model = small_model("mla", dtype=torch.bfloat16)
    runner = make_runner(model, GraphConfig(enabled=False), (4,), 16)
    entries = decode_batch(runner, BlockManager(runner.num_blocks, runner.block_size), 4, 16)
    floor = StepMatmuls(model, lambda: runner.execute(entries, mode="eager"))
    packed = floor.packed()
    if packed is None:  # the suite then times no packed floor either
        assert not onednn_packs(torch.bfloat16), "oneDNN has bfloat16 on this CPU, yet the weights did not pack"
        pytest.skip("no bfloat16 oneDNN linear here (this torch lacks oneDNN, or the CPU lacks AVX-512 or AVX-NE-CONVERT)")
    plain, prepacked = floor(), packed()
    assert len(plain) == len(prepacked)
    for a, b in zip(plain, prepacked):
        torch.testing.assert_close(b, a, rtol=1.6e-2, atol=1e-2)


def test_the_compiled_forms_replay_runs_few_row_linears_in_rows_mm_with_the_same_products(monkeypatch):
    """``as_compiled``: the bfloat16 linears of 2 to ROWS_MM_MAX rows, and the float32 ones (the
    router's), run in ``rows_mm`` (as the compiled step runs them), the rest as recorded; each product within bf16 rounding of aten's."""
    from ascend_graph.compile.passes.decode_matmul import ROWS_MM_MAX
    from ascend_graph import kernels

    model = small_model("mla", dtype=torch.bfloat16)
    for batch in (4, 32, ROWS_MM_MAX + 1):  # 32: the wide form
        runner = make_runner(model, GraphConfig(enabled=False), (batch,), 16)
        entries = decode_batch(runner, BlockManager(runner.num_blocks, runner.block_size), batch, 16)
        floor = StepMatmuls(model, lambda: runner.execute(entries, mode="eager"))
        op, kernel_calls = torch.ops.ascend_graph.rows_mm, []
        monkeypatch.setattr(torch.ops.ascend_graph, "rows_mm", lambda *a: kernel_calls.append(a) or op(*a))
        compiled = floor.as_compiled()
        if not kernels.available() or batch > ROWS_MM_MAX:
            assert compiled is None
            continue
        plain, forms = floor(), compiled()
        linears = sum(c[0] is torch.ops.aten.linear.default for c in floor.calls)  # the router's: float32
        assert len(kernel_calls) == linears > 0 and len(forms) == len(plain)
        for a, b in zip(plain, forms):
            assert b.shape == a.shape and b.dtype == a.dtype
            torch.testing.assert_close(b, a, rtol=1.6e-2, atol=1e-2)
        monkeypatch.undo()


def test_the_compiled_forms_replay_runs_the_attention_products_in_the_kernel_with_the_same_products():
    """``as_compiled``: MLA decode's batched attention products that the pass hands the kernel
    (``batched_rows_form``; the limits lowered for this small model) run in ``expert_rows_mm`` or
    ``rows_bmm`` over the recorded gathered rows, each within bf16 rounding of aten's ``bmm``."""
    from ascend_graph.compile.passes.decode_matmul import batched_rows_form
    from ascend_graph import kernels

    model = small_model("mla", dtype=torch.bfloat16)
    runner = make_runner(model, GraphConfig(enabled=False), (4,), 16)
    entries = decode_batch(runner, BlockManager(runner.num_blocks, runner.block_size), 4, 16)
    floor = StepMatmuls(model, lambda: runner.execute(entries, mode="eager"))
    limits = dict(batched_rows_max=32, batched_min_elements=64)
    compiled = floor.as_compiled(**limits)
    forms = []
    for op, args, kwargs in floor.calls:  # the bmm inside each einsum of the step
        if op is torch.ops.aten.einsum.default:
            inner = _MatmulRecorder()
            with torch.inference_mode(), inner:
                op.decompose(*args, **kwargs)
            forms += [batched_rows_form(*a[:2], 32, 64) for f, a, _ in inner.calls if f is torch.ops.aten.bmm.default]
    if not kernels.available():
        assert compiled is None and floor.batched_in_kernel == 0
        return
    assert {"expert_rows_mm", "rows_bmm"} <= set(forms)  # the scores and the values
    assert floor.batched_in_kernel == sum(f is not None for f in forms)
    plain, replayed = floor(), compiled()
    for a, b in zip(plain, replayed):
        assert b.shape == a.shape and b.dtype == a.dtype
        torch.testing.assert_close(b, a, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_packs_says_whether_a_weight_of_that_dtype_packs(dtype):
    """The suite's MoE-forms part asks ``onednn_packs`` before it packs experts (on a Zen 3 oneDNN
    refuses bfloat16 weights): its answer is what packing one weight and multiplying by it does."""
    w, x = torch.randn(8, 16).to(dtype), torch.randn(2, 16).to(dtype)
    try:
        out = onednn_linear(x, pack_for_onednn(w, 2))
    except (AttributeError, RuntimeError):
        out = None
    assert onednn_packs(dtype) == (out is not None)
    if out is not None:
        torch.testing.assert_close(out.float(), x.float() @ w.float().T, rtol=1.6e-2, atol=1e-2)
