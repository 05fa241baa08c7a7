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
