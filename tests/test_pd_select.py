"""Choosing a transport: Mooncake counts as available only where its engine actually loads.

The import of ``mooncake.engine`` is made to fail the two ways a broken install fails (the
wheel missing: ``ImportError``; the wheel present but its shared library unable to load, e.g.
``libibverbs.so.1`` missing: ``OSError``); the oracle for the real outcome is a fresh python
importing it.
"""

import importlib
import subprocess
import sys

import pytest

from ascend_graph.pd import select


@pytest.fixture
def fresh_cache():
    select.mooncake_problem.cache_clear()
    yield
    select.mooncake_problem.cache_clear()


def _failing_import(monkeypatch, error: Exception) -> list:
    calls, real = [], importlib.import_module

    def fake(name, *args, **kwargs):
        if name == "mooncake.engine":
            calls.append(name)
            raise error
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", fake)
    return calls


@pytest.mark.parametrize("error", [OSError("libibverbs.so.1: cannot open shared object file"),
                                   ImportError("No module named 'mooncake'")])
def test_an_engine_that_does_not_load_is_unavailable_with_its_reason(monkeypatch, fresh_cache, error):
    calls = _failing_import(monkeypatch, error)
    assert not select.mooncake_available()
    problem = select.mooncake_problem()
    assert str(error) in problem and type(error).__name__ in problem and "libibverbs1" in problem
    assert select.resolve_transport("auto") == "gloo"
    with pytest.raises(ImportError, match=str(error).split(":")[0]):
        select.open_transport("mooncake", "destination")
    assert calls == ["mooncake.engine"]  # tried once: the outcome is cached


def test_availability_is_what_a_fresh_python_finds(fresh_cache):
    loads = subprocess.run([sys.executable, "-c", "import mooncake.engine"], capture_output=True,
                           timeout=120).returncode == 0
    assert select.mooncake_available() is loads
    assert select.resolve_transport("auto") == ("mooncake" if loads else "gloo")
