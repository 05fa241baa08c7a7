"""Backends: the "ascend_graph" entry point, the choice per device, Inductor options, torchair contract.

Oracles: eager results of the same function; torch's own registered backends; and, for torchair
(which cannot run here), fake ``torch_npu``/``torchair`` modules that record what the adapter
hands them. The contract tests check our side of torchair's public API, not torchair itself.
"""

import os
import subprocess
import sys
import textwrap
import types
import warnings

import pytest
import torch
from npu_fakes import install_fake_npu

from ascend_graph.compile import detect_platform, input_device, resolve_backend
from ascend_graph.compile.inductor import InductorBackend
from ascend_graph.compile.passes.decode_matmul import DecodeMatmulPass
from ascend_graph.config import GraphConfig, InductorOptions, TorchairOptions
from ascend_graph.integrations.vllm_ascend import graph_config


# --- the registered backend ------------------------------------------------------------------


def test_backend_works_by_name_through_the_entry_point_without_importing_the_package():
    code = textwrap.dedent("""
        import sys, torch
        def step(x, w, cache):
            cache.add_(1)
            return (x @ w).softmax(-1) * cache.sum()
        x, w = torch.randn(4, 16), torch.randn(16, 16)
        cache_eager, cache_graph = torch.zeros(3), torch.zeros(3)
        want = step(x, w, cache_eager)
        assert "ascend_graph" not in sys.modules
        got = torch.compile(step, backend="ascend_graph", fullgraph=True)(x, w, cache_graph)
        assert "ascend_graph" in sys.modules
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(cache_graph, cache_eager)
        print("ok")
    """)
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_torch_compile_options_reach_the_backend_as_dict_or_graph_config():
    fn = lambda x: torch.relu(x) + 1  # noqa: E731
    x = torch.randn(5)
    for options in ({"backend": "eager"}, GraphConfig(backend="aot_eager")):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(fn, backend="ascend_graph", options=options)(x), fn(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="backend='cudagraphs' needs a cuda device, got a cpu device"):
        torch.compile(fn, backend="ascend_graph", options={"backend": "cudagraphs"})(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown key 'bakend'"):
        torch.compile(fn, backend="ascend_graph", options={"bakend": "eager"})(x)


def test_input_device_prefers_the_accelerator_and_defaults_to_cpu():
    assert input_device([3, torch.zeros(1)]) == torch.device("cpu")
    assert input_device([]) == torch.device("cpu")
    assert input_device([torch.zeros(1), torch.zeros(1, device="meta")]) == torch.device("meta")


# --- choice per device -----------------------------------------------------------------------


def test_detect_platform_names_npu_cuda_cpu_and_rejects_others():
    assert detect_platform("npu:0") == "npu" and detect_platform("npu") == "npu"
    assert detect_platform(torch.device("cuda", 1)) == "cuda"
    assert detect_platform(torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="device 'mps' is not supported"):
        detect_platform("mps")


def test_cpu_auto_is_inductor_with_the_measured_cpp_wrapper_default_and_no_cudagraphs():
    backend = resolve_backend(GraphConfig(), torch.device("cpu"))
    assert isinstance(backend, InductorBackend)
    patches = dict(backend.config_patches)
    assert isinstance(patches.pop("post_grad_custom_post_pass"), DecodeMatmulPass)
    assert patches == {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, "triton.cudagraphs": False,
                       "cpp.vec_isa_ok": True}
    assert backend.cache_dir is None


def test_trusting_the_cpus_vector_flags_picks_the_isa_that_inductors_test_builds_pick():
    """``cpp.vec_isa_ok`` skips Inductor's test builds of its vector ISAs; the oracle is those
    builds themselves, run in a fresh process each (the choice is cached per process)."""
    code = textwrap.dedent("""
        import torch._inductor.config as c
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        with c.patch({"cpp.vec_isa_ok": %s}):
            isa = pick_vec_isa()
        print(repr((str(isa), isa.bit_width(), isa.build_arch_flags() if isa else "")))
    """)
    picked = []
    for trusted in ("True", "None"):
        proc = subprocess.run([sys.executable, "-c", code % trusted], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        picked.append(proc.stdout.strip().splitlines()[-1])
    assert picked[0] == picked[1]


def test_an_explicit_vec_isa_setting_of_torch_wins_and_other_devices_get_none():
    import torch._inductor.config as inductor_config

    # torch's own patch: pytest's monkeypatch (9.2) undoes a config-module attribute by deleting it
    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        assert "cpp.vec_isa_ok" not in resolve_backend(GraphConfig(), "cpu").config_patches
    with inductor_config.patch({"cpp.vec_isa_ok": None}):
        assert "cpp.vec_isa_ok" not in resolve_backend(GraphConfig(), "cuda").config_patches


def test_cpu_inductor_takes_configured_options_and_torch_compile_mode():
    cfg = GraphConfig(backend="inductor", inductor=InductorOptions(cpp_wrapper=False), compile_cache_dir="/tmp/ag-cache")
    backend = resolve_backend(cfg, "cpu", mode="max-autotune")
    assert backend.config_patches["cpp_wrapper"] is False and backend.cache_dir == "/tmp/ag-cache"
    assert "cpp_wrapper_build_separate" not in backend.config_patches  # nothing to build apart
    assert backend.config_patches["max_autotune"] is True
    assert backend.config_patches["triton.cudagraphs"] is False  # nothing to capture on CPU


class LayerNameLike:
    """A hoisted opaque value type, as vLLM's ``LayerName`` (registered below where torch has them)."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, LayerNameLike) and other.value == self.value

    def __hash__(self):
        return hash(self.value)

    def __fx_repr__(self):
        return f"LayerNameLike({self.value!r})", {"LayerNameLike": LayerNameLike}


def test_a_graph_taking_an_opaque_value_compiles_with_the_python_wrapper_and_matches_eager():
    """vLLM hands its attention ops a ``LayerName`` (a hoisted opaque value): Inductor's C++
    wrapper cannot pass one to an op, so such a graph falls back to the Python wrapper."""
    opaque = pytest.importorskip("torch._library.opaque_object")
    if not opaque.is_opaque_type(LayerNameLike):
        opaque.register_opaque_type(LayerNameLike, typ="value", hoist=True)
    scales = {"a": 2.0, "b": -3.0}

    @torch.library.custom_op("ascend_graph_test::scaled_by_name", mutates_args=())
    def scaled(x: torch.Tensor, name: LayerNameLike) -> torch.Tensor:
        return x * scales[name.value]

    scaled.register_fake(lambda x, name: torch.empty_like(x))

    def step(x, name):
        return torch.ops.ascend_graph_test.scaled_by_name(x.sin(), name) + 1

    assert resolve_backend(GraphConfig(), "cpu").config_patches["cpp_wrapper"]  # the default it must leave
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="ascend_graph", fullgraph=True)
    x = torch.randn(8)
    for name in ("a", "b"):
        torch.testing.assert_close(compiled(x, LayerNameLike(name)), step(x, LayerNameLike(name)))


def test_cuda_auto_is_inductor_with_cuda_graphs():
    backend = resolve_backend(GraphConfig(), torch.device("cuda"))
    assert isinstance(backend, InductorBackend)
    assert backend.config_patches == {"cpp_wrapper": False, "triton.cudagraphs": True}


def test_cuda_cpp_wrapper_request_warns_that_it_skips_cuda_graphs():
    with pytest.warns(UserWarning, match="skips CUDA graphs"):
        resolve_backend(GraphConfig(inductor=InductorOptions(cpp_wrapper=True)), "cuda")


@pytest.mark.parametrize("name", ["aot_eager", "eager"])
def test_debug_backends_are_torchs_own(name):
    assert resolve_backend(GraphConfig(backend=name), "cpu") is torch._dynamo.lookup_backend(name)
    with pytest.raises(ValueError, match="has no meaning"):
        resolve_backend(GraphConfig(backend=name), "cpu", mode="reduce-overhead")


def test_cudagraphs_backend_is_torchs_on_cuda_and_refused_elsewhere():
    assert resolve_backend(GraphConfig(backend="cudagraphs"), "cuda") is torch._dynamo.lookup_backend("cudagraphs")
    with pytest.raises(ValueError, match="backend='cudagraphs' needs a cuda device, got a cpu device"):
        resolve_backend(GraphConfig(backend="cudagraphs"), "cpu")


def test_torchair_backend_is_refused_off_npu():
    with pytest.raises(ValueError, match="backend='torchair' needs a npu device, got a cuda device"):
        resolve_backend(GraphConfig(backend="torchair"), "cuda")


def test_inductor_compile_cache_goes_to_the_configured_dir_and_env_is_restored(tmp_path):
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    cfg = GraphConfig(inductor=InductorOptions(cpp_wrapper=False), compile_cache_dir=str(tmp_path / "cache"))
    fn = lambda x: torch.sin(x) * 3 + 0.25  # noqa: E731
    x = torch.randn(7)
    compiled = torch.compile(fn, backend=resolve_backend(cfg, "cpu"), fullgraph=True)
    torch.testing.assert_close(compiled(x), fn(x))
    assert any((tmp_path / "cache").rglob("*.py")), "no compiled code was written to compile_cache_dir"
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before


# --- torchair contract (fake torch_npu / torchair) -------------------------------------------


@pytest.fixture
def fake_npu(monkeypatch):
    """Fake torch_npu + torchair in sys.modules (``npu_fakes``); returns what they record."""
    return install_fake_npu(monkeypatch)


def reduce_overhead_is_deprecated():
    """torch_npu 7.3.0 deprecates torchair's reduce-overhead mode for the npugraph_ex backend."""
    return pytest.warns(DeprecationWarning, match=r"'reduce-overhead' is deprecated \(torch_npu 7\.3\.0 and "
                                                  r"later\): use the npugraph_ex backend")


def test_torchair_contract_auto_on_npu_uses_vllm_ascend_defaults(fake_npu):
    assert resolve_backend(GraphConfig(), "npu:0") is fake_npu.ge_backend
    (config,) = fake_npu.calls["backend"]
    assert config.mode == "max-autotune"
    assert config.experimental_config.frozen_parameter is True
    assert config.experimental_config.enable_view_optimize is True
    assert config.experimental_config.tiling_schedule_optimize is True
    assert fake_npu.calls["set_compile_mode"] == [{"jit_compile": False}]


def test_torchair_contract_max_autotune_does_not_warn(fake_npu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_backend(GraphConfig(backend="torchair"), "npu")
    assert fake_npu.calls["backend"][0].mode == "max-autotune"


def test_torchair_contract_options_are_handed_over_as_configured(fake_npu):
    options = TorchairOptions(mode="reduce-overhead", enable_frozen_parameter=False,
                              enable_view_optimize=False, tiling_schedule_optimize=False)
    with reduce_overhead_is_deprecated():
        resolve_backend(GraphConfig(backend="torchair", torchair=options), "npu")
    (config,) = fake_npu.calls["backend"]
    assert config.mode == "reduce-overhead"
    assert (config.experimental_config.frozen_parameter, config.experimental_config.enable_view_optimize,
            config.experimental_config.tiling_schedule_optimize) == (False, False, False)


def test_torchair_contract_vllm_ascend_section_reaches_the_compiler_config(fake_npu):
    cfg = graph_config({"torchair_graph_config": {
        "enabled": True, "mode": "reduce-overhead", "enable_frozen_parameter": False}})
    with reduce_overhead_is_deprecated():
        resolve_backend(cfg, "npu")
    (config,) = fake_npu.calls["backend"]
    assert config.mode == "reduce-overhead" and config.experimental_config.frozen_parameter is False


def test_torchair_contract_torch_compile_mode_overrides_the_configured_mode(fake_npu):
    with reduce_overhead_is_deprecated():
        resolve_backend(GraphConfig(), "npu", mode="reduce-overhead")
    assert fake_npu.calls["backend"][0].mode == "reduce-overhead"
    with pytest.raises(ValueError, match="torchair.mode must be one of"):
        resolve_backend(GraphConfig(), "npu", mode="max-autotune-no-cudagraphs")


def test_torchair_contract_warns_of_a_default_option_torchair_lacks(fake_npu):
    fake_npu.torchair.experimental_options = {"frozen_parameter": False, "enable_view_optimize": False}
    with pytest.warns(RuntimeWarning, match=r"no experimental_config.tiling_schedule_optimize"):
        resolve_backend(GraphConfig(), "npu")
    assert not hasattr(fake_npu.calls["backend"][0].experimental_config, "tiling_schedule_optimize")


def test_torchair_contract_cached_graph_goes_through_cache_compile(fake_npu):
    from ascend_graph.compile.torchair import cache_compile

    cfg = GraphConfig(compile_cache_dir="/tmp/ag-torchair", torchair=TorchairOptions(use_cached_graph=True))
    linear = torch.nn.Linear(2, 2)
    x = torch.randn(3, 2)
    torch.testing.assert_close(cache_compile(linear.forward, cfg)(x), linear(x))  # the compiled method
    method = linear.forward
    ((func, kwargs),) = fake_npu.calls["cache_compile"]
    assert func == method
    assert kwargs["cache_dir"] == "/tmp/ag-torchair" and kwargs["ge_cache"] is False and kwargs["dynamic"] is True
    assert kwargs["config"].experimental_config.frozen_parameter is True


def test_torchair_contract_missing_torch_npu_gives_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    with pytest.raises(ImportError, match=r"torchair backend needs torch_npu .*CANN.*ascend-graph\[npu\]"):
        resolve_backend(GraphConfig(), "npu")


def test_torchair_contract_torch_npu_without_torchair_gives_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setitem(sys.modules, "torchair", None)
    with pytest.raises(ImportError, match="torch_npu is installed but torchair is not importable"):
        resolve_backend(GraphConfig(backend="torchair"), "npu")
