"""GraphConfig: defaults, capture sizes, validation, old keys, vllm-ascend's schema, environment, CLI.

Oracles: capture sizes written out by hand; the vllm-ascend dict is the example from their
additional-config documentation (v0.11), with the mapping stated in
ascend_graph/integrations/vllm_ascend.py.
"""

import dataclasses
import json

import pytest

from ascend_graph.cli import build_parser
from ascend_graph.cli.commands import graph_config as cli_graph_config
from ascend_graph.config import GraphConfig, InductorOptions, NpugraphExOptions, TorchairOptions
from ascend_graph.config_sources import from_env
from ascend_graph.integrations.vllm_ascend import graph_config

# vllm-ascend docs, "Additional Configuration" example (their Python literal, as JSON).
VLLM_ASCEND_EXAMPLE = {
    "torchair_graph_config": {
        "enabled": True,
        "use_cached_graph": True,
        "graph_batch_sizes": [1, 2, 4, 8],
        "graph_batch_sizes_init": False,
        "enable_kv_nz": False,
    },
    "weight_prefetch_config": {"enabled": True, "prefetch_ratio": {"attn": {"qkv": 1.0, "o": 1.0}}},
    "multistream_overlap_shared_expert": True,
    "refresh": False,
}


# --- defaults and capture sizes --------------------------------------------------------------


def test_defaults_are_eager_with_auto_backend():
    cfg = GraphConfig()
    assert (cfg.enabled, cfg.backend, cfg.max_batch_size, cfg.on_recompile) == (False, "auto", 64, "error")
    assert cfg.fallback_on_compile_error and cfg.parity_interval == 0 and cfg.compile_cache_dir is None
    assert cfg.torchair == TorchairOptions() and cfg.inductor == InductorOptions()
    assert (cfg.inductor.cpp_wrapper, cfg.inductor.freezing_min_batch, cfg.inductor.aot) == (None, None, False)


def test_graph_config_has_eight_top_level_fields_and_one_options_section_per_backend():
    names = [f.name for f in dataclasses.fields(GraphConfig)]
    assert names == ["enabled", "backend", "max_batch_size", "capture_sizes", "fallback_on_compile_error",
                     "on_recompile", "compile_cache_dir", "parity_interval", "inductor", "torchair", "npugraph_ex"]
    assert [f.name for f in dataclasses.fields(InductorOptions)] == [
        "cpp_wrapper", "freezing_min_batch", "aot", "dynamic_batch", "precompile"]


@pytest.mark.parametrize("max_batch_size, sizes", [
    (48, (1, 2, 4, 8, 16, 32, 48)),
    (64, (1, 2, 4, 8, 16, 32, 64)),
    (1, (1,)),
    (3, (1, 2, 3)),
])
def test_default_capture_sizes_are_powers_of_two_plus_max(max_batch_size, sizes):
    assert GraphConfig(max_batch_size=max_batch_size).resolved_capture_sizes() == sizes


def test_explicit_capture_sizes_are_sorted_and_always_include_max():
    cfg = GraphConfig(max_batch_size=16, capture_sizes=[8, 1, 3])
    assert cfg.capture_sizes == (1, 3, 8)
    assert cfg.resolved_capture_sizes() == (1, 3, 8, 16)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        GraphConfig().enabled = True


# --- bad values name the key -----------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, words", [
    ({"capture_sizes": [2, 2]}, ValueError, "repeat"),
    ({"capture_sizes": [0, 4]}, ValueError, "capture_sizes[0] must be >= 1"),
    ({"capture_sizes": [1, 2.5]}, TypeError, "capture_sizes[1] must be an int"),
    ({"capture_sizes": []}, ValueError, "capture_sizes must not be empty"),
    ({"capture_sizes": [128], "max_batch_size": 64}, ValueError, "exceed max_batch_size=64"),
    ({"max_batch_size": 0}, ValueError, "max_batch_size must be >= 1"),
    ({"max_batch_size": True}, TypeError, "max_batch_size must be an int"),
    ({"backend": "tvm"}, ValueError, "backend must be one of"),
    ({"on_recompile": "ignore"}, ValueError, "on_recompile must be one of"),
    ({"parity_interval": -1}, ValueError, "parity_interval must be >= 0"),
    ({"enabled": "yes"}, TypeError, "enabled must be a bool"),
    ({"compile_cache_dir": ""}, TypeError, "compile_cache_dir must be a non-empty path"),
    ({"compile_cache_dir": 3}, TypeError, "compile_cache_dir must be a non-empty path"),
    ({"torchair": {"mode": "max-autotune"}}, TypeError, "torchair must be a TorchairOptions, got dict"),
    ({"inductor": None}, TypeError, "inductor must be an InductorOptions, got NoneType"),
])
def test_bad_values_are_rejected_naming_the_key(kwargs, error, words):
    with pytest.raises(error) as info:
        GraphConfig(**kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("options, kwargs, error, words", [
    (TorchairOptions, {"mode": "fast"}, ValueError, "torchair.mode must be one of 'max-autotune', 'reduce-overhead'"),
    (TorchairOptions, {"use_cached_graph": "no"}, TypeError, "torchair.use_cached_graph must be a bool"),
    (InductorOptions, {"cpp_wrapper": 2}, TypeError, "inductor.cpp_wrapper must be a bool"),
    (InductorOptions, {"freezing_min_batch": 0}, ValueError, "inductor.freezing_min_batch must be >= 1"),
    (InductorOptions, {"freezing_min_batch": 2.0}, TypeError, "inductor.freezing_min_batch must be an int"),
    (InductorOptions, {"aot": None}, TypeError, "inductor.aot must be a bool"),
    (NpugraphExOptions, {"capture_limit": 0}, ValueError, "npugraph_ex.capture_limit must be >= 1"),
    (NpugraphExOptions, {"capture_limit": "64"}, TypeError, "npugraph_ex.capture_limit must be an int"),
    (NpugraphExOptions, {"capture_limit": True}, TypeError, "npugraph_ex.capture_limit must be an int"),
    (NpugraphExOptions, {"clone_input": "no"}, TypeError, "npugraph_ex.clone_input must be a bool"),
    (InductorOptions, {"aot": True, "freezing_min_batch": 2}, ValueError,
     "inductor.aot=True cannot be combined with inductor.freezing_min_batch"),
])
def test_bad_backend_options_are_rejected_naming_the_dotted_key(options, kwargs, error, words):
    with pytest.raises(error) as info:
        options(**kwargs)
    assert words in str(info.value)


def test_bool_fields_take_0_and_1_and_paths_take_pathlike(tmp_path):
    cfg = GraphConfig(enabled=1, compile_cache_dir=tmp_path, inductor=InductorOptions(cpp_wrapper=0))
    assert cfg.enabled is True and cfg.inductor.cpp_wrapper is False
    assert cfg.compile_cache_dir == str(tmp_path)


# --- old flat Inductor keys ------------------------------------------------------------------


@pytest.mark.parametrize("old, new", [("inductor_cpp_wrapper", "inductor.cpp_wrapper"),
                                      ("inductor_freezing_min_batch", "inductor.freezing_min_batch"),
                                      ("aot_inductor", "inductor.aot")])
def test_old_flat_inductor_keys_raise_naming_their_new_place(old, new):
    value = 2 if old == "inductor_freezing_min_batch" else True
    message = f"'{old}' moved to '{new}'"
    with pytest.raises(TypeError, match=message):
        GraphConfig(**{old: value})
    with pytest.raises(TypeError, match=message):
        dataclasses.replace(GraphConfig(), **{old: value})
    with pytest.raises(ValueError, match=message):
        GraphConfig.from_dict({old: value})
    with pytest.raises(ValueError, match=message):
        graph_config({old: value, "torchair_graph_config": {"enabled": True}})
    with pytest.raises(ValueError, match=f"ASCEND_GRAPH_CONFIG: {message}"):
        from_env(environ={"ASCEND_GRAPH_CONFIG": json.dumps({old: value})})


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError, match="unknown key 'max_batch' in the graph config; known keys: enabled"):
        GraphConfig.from_dict({"max_batch": 8})
    with pytest.raises(ValueError, match="unknown key 'frozen' in torchair; known keys: mode"):
        GraphConfig.from_dict({"torchair": {"frozen": True}})
    with pytest.raises(ValueError, match="unknown key 'force_recapture' in npugraph_ex; known keys: capture_limit, "
                                         "clone_input, frozen_parameter, force_eager, use_graph_pool$"):
        GraphConfig.from_dict({"backend": "npugraph_ex", "npugraph_ex": {"force_recapture": True}})


def test_npugraph_ex_options_read_from_a_dict_change_only_the_keys_given():
    cfg = GraphConfig.from_dict({"backend": "npugraph_ex", "npugraph_ex": {"capture_limit": 8, "force_eager": 1}})
    assert cfg.backend == "npugraph_ex"
    assert cfg.npugraph_ex == NpugraphExOptions(capture_limit=8, clone_input=False, frozen_parameter=True,
                                                force_eager=True, use_graph_pool=False)
    assert GraphConfig.from_dict(cfg.to_dict()) == cfg


def test_from_dict_type_errors_name_key_and_type():
    with pytest.raises(TypeError, match="max_batch_size must be an int, got str"):
        GraphConfig.from_dict({"max_batch_size": "8"})
    with pytest.raises(TypeError, match="torchair.use_cached_graph must be a bool"):
        GraphConfig.from_dict({"torchair": {"use_cached_graph": "true"}})


def test_to_dict_is_json_safe_and_round_trips():
    cfg = GraphConfig(enabled=True, backend="inductor", max_batch_size=8, capture_sizes=(1, 4),
                      compile_cache_dir="/tmp/x", torchair=TorchairOptions(mode="reduce-overhead"),
                      inductor=InductorOptions(cpp_wrapper=False, freezing_min_batch=4))
    d = cfg.to_dict()
    assert d["inductor"] == {"cpp_wrapper": False, "freezing_min_batch": 4, "aot": False, "dynamic_batch": None,
                             "precompile": None}
    assert d["torchair"]["mode"] == "reduce-overhead" and d["capture_sizes"] == [1, 4]
    assert GraphConfig.from_dict(json.loads(json.dumps(d))) == cfg


def test_from_dict_nested_options_change_only_the_keys_given():
    base = GraphConfig(inductor=InductorOptions(cpp_wrapper=False), torchair=TorchairOptions(use_cached_graph=True))
    cfg = GraphConfig.from_dict({"inductor": {"aot": True}, "torchair": {"mode": "reduce-overhead"}}, base=base)
    assert cfg.inductor == InductorOptions(cpp_wrapper=False, aot=True)
    assert cfg.torchair == TorchairOptions(mode="reduce-overhead", use_cached_graph=True)
    with pytest.raises(ValueError, match="unknown key 'cpp' in inductor; known keys: cpp_wrapper, freezing_min"):
        GraphConfig.from_dict({"inductor": {"cpp": True}})
    with pytest.raises(TypeError, match="inductor must be a dict of cpp_wrapper, freezing_min_batch, aot, "
                                        "dynamic_batch, precompile, got list"):
        GraphConfig.from_dict({"inductor": [True]})
    with pytest.raises(TypeError, match="inductor.freezing_min_batch must be an int"):
        GraphConfig.from_dict({"inductor": {"freezing_min_batch": "8"}})


@pytest.mark.parametrize("d", [{"torchair_graph_config": {"enabled": True}},
                               {"additional_config": {"torchair_graph_config": {"enabled": True}}}])
def test_from_dict_refuses_vllm_ascend_sections_naming_the_entry_point(d):
    with pytest.raises(ValueError, match="vllm-ascend's schema.*ascend_graph.integrations.vllm_ascend.graph_config"):
        GraphConfig.from_dict(d)


# --- vllm-ascend's torchair_graph_config -----------------------------------------------------


def test_vllm_ascend_docs_example_maps_onto_graph_config():
    with pytest.warns(UserWarning, match="ignored: multistream_overlap_shared_expert, refresh, weight_prefetch"):
        cfg = graph_config({"additional_config": VLLM_ASCEND_EXAMPLE})
    assert cfg.enabled and cfg.capture_sizes == (1, 2, 4, 8)
    assert cfg.torchair.use_cached_graph
    # keys the example leaves out keep vllm-ascend's defaults
    assert cfg.torchair.enable_view_optimize and cfg.torchair.enable_frozen_parameter


def test_vllm_ascend_section_maps_mode_and_torchair_switches():
    section = {"enabled": 1, "mode": "reduce-overhead", "enable_view_optimize": False,
               "enable_frozen_parameter": False, "graph_batch_sizes": [16, 4]}
    cfg = graph_config({"torchair_graph_config": section, "max_batch_size": 32})
    assert cfg.enabled is True
    assert cfg.torchair == TorchairOptions(mode="reduce-overhead", enable_frozen_parameter=False,
                                           enable_view_optimize=False)
    assert cfg.resolved_capture_sizes() == (4, 16, 32)


def test_vllm_ascend_batch_size_defaults():
    # no sizes: vllm-ascend captures [1, max_num_seqs]; graph_batch_sizes_init: our default sizes
    plain = graph_config({"torchair_graph_config": {"enabled": True}, "max_batch_size": 16})
    init = graph_config({"torchair_graph_config": {"enabled": True, "graph_batch_sizes_init": True},
                                  "max_batch_size": 16})
    assert plain.resolved_capture_sizes() == (1, 16)
    assert init.resolved_capture_sizes() == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("key, value", [
    ("use_cached_graph", True), ("graph_batch_sizes", [1, 2]), ("graph_batch_sizes_init", True),
    ("mode", "reduce-overhead"), ("enable_multistream_mla", True), ("enable_kv_nz", True),
])
def test_vllm_ascend_graph_only_keys_are_rejected_when_disabled(key, value):
    with pytest.raises(ValueError, match=f"torchair_graph_config.{key} is valid only when graph mode is enabled"):
        graph_config({"torchair_graph_config": {"enabled": False, key: value}})


def test_vllm_ascend_non_graph_keys_are_accepted_when_disabled():
    cfg = graph_config({"torchair_graph_config": {"enable_view_optimize": False, "graph_batch_sizes": []}})
    assert not cfg.enabled and cfg.torchair.enable_view_optimize is False


@pytest.mark.parametrize("key", ["enable_multistream_mla", "enable_multistream_moe", "enable_super_kernel",
                                 "enable_kv_nz", "use_cached_kv_cache_bytes"])
def test_vllm_ascend_unsupported_features_are_refused_when_requested(key):
    assert graph_config({"torchair_graph_config": {"enabled": True, key: False}}).enabled
    with pytest.raises(ValueError, match=f"{key} is not supported by ascend_graph"):
        graph_config({"torchair_graph_config": {"enabled": True, key: True}})


def test_vllm_ascend_unknown_and_mistyped_keys_are_rejected_by_name():
    with pytest.raises(ValueError, match="unknown key 'foo' in torchair_graph_config; known keys: enabled, mode"):
        graph_config({"torchair_graph_config": {"enabled": True, "foo": 1}})
    with pytest.raises(TypeError, match="torchair_graph_config.graph_batch_sizes must be a list"):
        graph_config({"torchair_graph_config": {"enabled": True, "graph_batch_sizes": 8}})
    with pytest.raises(ValueError, match="graph_batch_sizes_init is valid only when graph_batch_sizes is empty"):
        graph_config({"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [2],
                                                         "graph_batch_sizes_init": True}})


def test_same_setting_given_both_ways_must_agree():
    assert graph_config({"enabled": True, "torchair_graph_config": {"enabled": True}}).enabled
    with pytest.raises(ValueError, match="enabled is set twice with different values"):
        graph_config({"enabled": False, "torchair_graph_config": {"enabled": True}})
    with pytest.raises(ValueError, match="torchair.use_cached_graph is set twice with different values"):
        graph_config({"torchair": {"use_cached_graph": False},
                      "torchair_graph_config": {"enabled": True, "use_cached_graph": True}})


def test_vllm_ascend_entry_point_takes_our_own_keys_over_base():
    base = GraphConfig(max_batch_size=16)
    own = {"enabled": True, "capture_sizes": [2, 8], "inductor": {"cpp_wrapper": False}}
    assert graph_config(own, base=base) == GraphConfig.from_dict(own, base=base)
    cfg = graph_config({**own, "torchair_graph_config": {"enabled": True, "graph_batch_sizes": [8, 2]}}, base=base)
    assert cfg.resolved_capture_sizes() == (2, 8, 16) and cfg.inductor.cpp_wrapper is False
    with pytest.raises(ValueError, match="given both at the top level and inside additional_config"):
        graph_config({"torchair_graph_config": {}, "additional_config": {"torchair_graph_config": {}}})
    with pytest.raises(TypeError, match="the graph config must be a dict"):
        graph_config([("enabled", True)])


# --- environment -----------------------------------------------------------------------------


def test_env_overrides_base_with_json_then_flag():
    base = GraphConfig(max_batch_size=8)
    env = {"ASCEND_GRAPH_CONFIG": json.dumps({"enabled": True, "capture_sizes": [2]}),
           "ASCEND_GRAPH_BACKEND": "aot_eager"}
    cfg = from_env(base, environ=env)
    assert (cfg.enabled, cfg.backend, cfg.resolved_capture_sizes()) == (True, "aot_eager", (2, 8))
    off = from_env(base, environ={**env, "ASCEND_GRAPH_ENABLED": "0"})
    assert not off.enabled and off.capture_sizes == (2,)


def test_env_accepts_the_vllm_ascend_schema_and_leaves_base_when_unset():
    env = {"ASCEND_GRAPH_CONFIG": json.dumps({"torchair_graph_config": {"enabled": True, "mode": "reduce-overhead"}})}
    assert from_env(environ=env).torchair.mode == "reduce-overhead"
    base = GraphConfig(enabled=True, max_batch_size=4)
    assert from_env(base, environ={"ASCEND_GRAPH_ENABLED": ""}) == base


@pytest.mark.parametrize("env, error, words", [
    ({"ASCEND_GRAPH_ENABLED": "maybe"}, ValueError, "ASCEND_GRAPH_ENABLED must be"),
    ({"ASCEND_GRAPH_CONFIG": "{not json"}, ValueError, "ASCEND_GRAPH_CONFIG is not valid JSON"),
    ({"ASCEND_GRAPH_CONFIG": "[1, 2]"}, TypeError, "ASCEND_GRAPH_CONFIG must be a JSON object"),
    ({"ASCEND_GRAPH_BACKEND": "xla"}, ValueError, "ASCEND_GRAPH_BACKEND: backend must be one of"),
    ({"ASCEND_GRAPH_CONFIG": '{"max_batch_size": 0}'}, ValueError, "ASCEND_GRAPH_CONFIG: max_batch_size must be >= 1"),
])
def test_bad_env_values_are_rejected_naming_the_variable(env, error, words):
    with pytest.raises(error) as info:
        from_env(environ=env)
    assert words in str(info.value)


def test_env_json_reads_nested_inductor_options_and_additional_config():
    env = {"ASCEND_GRAPH_CONFIG": json.dumps({"inductor": {"freezing_min_batch": 8}})}
    assert from_env(environ=env).inductor == InductorOptions(freezing_min_batch=8)
    env = {"ASCEND_GRAPH_CONFIG": json.dumps({"additional_config": {"torchair_graph_config": {
        "enabled": True, "graph_batch_sizes": [4]}}}), "ASCEND_GRAPH_ENABLED": "off"}
    cfg = from_env(GraphConfig(max_batch_size=8), environ=env)
    assert not cfg.enabled and cfg.capture_sizes == (4,)


# --- the CLI's --graph-config ----------------------------------------------------------------


def cli_config(*flags: str, graph: bool = True) -> GraphConfig:
    return cli_graph_config(build_parser().parse_args(["demo", *flags]), graph)


def test_cli_graph_config_reads_both_schemas_over_the_flags(tmp_path):
    cfg = cli_config("--capture-sizes", "1,8", "--graph-config", json.dumps({
        "inductor": {"cpp_wrapper": False}, "torchair_graph_config": {"enabled": True, "mode": "reduce-overhead"}}))
    assert cfg.enabled and cfg.resolved_capture_sizes() == (1, 8) and cfg.max_batch_size == 8
    assert cfg.inductor.cpp_wrapper is False and cfg.torchair.mode == "reduce-overhead"
    path = tmp_path / "graph.json"
    path.write_text(json.dumps({"additional_config": {"torchair_graph_config": {"enabled": True,
                                                                                "graph_batch_sizes": [2]}}}))
    cfg = cli_config("--capture-sizes", "1,4", "--backend", "aot_eager", "--graph-config", str(path), graph=False)
    assert not cfg.enabled and cfg.backend == "aot_eager" and cfg.resolved_capture_sizes() == (2, 4)
    assert cli_config("--aot-inductor").inductor.aot


def test_cli_graph_config_errors_are_bad_requests_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--graph-config: 'aot_inductor' moved to 'inductor.aot'"):
        cli_config("--graph-config", '{"aot_inductor": true}')
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="--graph-config must be a JSON object"):
        cli_config("--graph-config", str(tmp_path / "list.json"))
    with pytest.raises(FileNotFoundError):
        cli_config("--graph-config", "/nonexistent/graph.json")


def test_engine_without_a_graph_config_reads_the_environment(monkeypatch):
    from ascend_graph.engine import Engine
    from ascend_graph.models import DeepseekConfig, DeepseekForCausalLM

    section = {"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [2]}}
    monkeypatch.setenv("ASCEND_GRAPH_CONFIG", json.dumps({**section, "max_batch_size": 4, "backend": "aot_eager"}))
    monkeypatch.setenv("ASCEND_GRAPH_ENABLED", "0")
    model = DeepseekForCausalLM(DeepseekConfig.small(), seed=0).eval()
    engine = Engine(model, block_size=4, max_model_len=32)
    assert engine.graph_config == GraphConfig(backend="aot_eager", max_batch_size=4, capture_sizes=(2,))
