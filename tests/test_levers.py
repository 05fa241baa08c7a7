"""The lever benchmark's selection by name: a name that is no lever is refused before anything is
built, and the suite's own plans name only levers that exist (a renamed lever once left the quick
suite silently timing the default alone)."""

import pytest

from benchmarks import levers
from benchmarks.__main__ import plan


def test_an_unknown_lever_name_is_refused_by_name_before_any_model_is_built(monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("a model was built for a refused selection")

    monkeypatch.setattr(levers, "build", no_build)
    with pytest.raises(ValueError, match=r"names: no lever called 'without single-row pass'; expected some of"):
        levers.measure(batches=(1,), names=["default", "without single-row pass"])


@pytest.mark.parametrize("quick", [True, False])
def test_the_suite_plans_name_only_existing_levers(quick):
    names = plan(quick)["levers"]
    levers.check_names(names)
    if names is not None:
        assert levers.NO_PASS in names and "default" in names


def test_backend_levers_run_on_a_copy_sharing_the_weights():
    """The ``GATHERED`` and ``MOE_GATHERED`` levers time other attention / MoE backends on a copy
    of the model whose tensors are the model's own (no second set of weights), leaving the model
    itself on the default here; ``ONE_ROW`` flips the pass's one-row choice."""
    import torch

    from ascend_graph.config import GraphConfig
    from ascend_graph import kernels
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM
    from benchmarks.models import with_backends

    other = not levers.one_row_in_kernel()
    chosen = levers.variants(GraphConfig(enabled=True, backend="inductor"), "unused")
    assert chosen[levers.ONE_ROW[other]].patches["post_grad_custom_post_pass"].one_row_kernel == (
        other and kernels.available())
    assert chosen[levers.GATHERED].backends == ("reference", None)
    assert chosen[levers.MOE_GATHERED].backends == (None, "gathered")
    model = DeepseekForCausalLM(DeepseekConfig.small(), dtype=torch.float32, seed=0)
    copy = with_backends(model, *chosen[levers.MOE_GATHERED].backends)
    assert copy.backends()["moe"] == "gathered"
    assert model.backends()["moe"] == ("cpu_kernel" if kernels.available() else "grouped_mm")
    own = {p.data_ptr() for p in model.parameters()}
    assert {p.data_ptr() for p in copy.parameters()} == own
