"""GraphConfig: defaults, capture sizes, validation, vllm-ascend's schema, environment override.

Oracles: capture sizes written out by hand; the vllm-ascend dict is the example from their
additional-config documentation (v0.11), with the mapping stated in ascend_graph/_vllm_ascend.py.
"""

import json

import pytest

from ascend_graph.config import GraphConfig, TorchairOptions

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
    assert cfg.fallback_on_compile_error and cfg.parity_interval == 0 and cfg.inductor_cpp_wrapper is None
    assert cfg.torchair == TorchairOptions()


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
    ({"inductor_cpp_wrapper": 2}, TypeError, "inductor_cpp_wrapper must be a bool"),
    ({"compile_cache_dir": ""}, TypeError, "compile_cache_dir must be a non-empty path"),
    ({"inductor_freezing_min_batch": 0}, ValueError, "inductor_freezing_min_batch must be >= 1"),
    ({"inductor_freezing_min_batch": 2.0}, TypeError, "inductor_freezing_min_batch must be an int"),
])
def test_bad_values_are_rejected_naming_the_key(kwargs, error, words):
    with pytest.raises(error) as info:
        GraphConfig(**kwargs)
    assert words in str(info.value)


def test_bad_torchair_mode_is_rejected_naming_the_key():
    with pytest.raises(ValueError, match="torchair.mode must be one of"):
        TorchairOptions(mode="fast")


def test_from_dict_rejects_unknown_keys_by_name():
    with pytest.raises(ValueError, match="unknown key 'max_batch' in the graph config; known keys: enabled"):
        GraphConfig.from_dict({"max_batch": 8})
    with pytest.raises(ValueError, match="unknown key 'frozen' in torchair; known keys: mode"):
        GraphConfig.from_dict({"torchair": {"frozen": True}})


def test_from_dict_type_errors_name_key_and_type():
    with pytest.raises(TypeError, match="max_batch_size must be an int, got str"):
        GraphConfig.from_dict({"max_batch_size": "8"})
    with pytest.raises(TypeError, match="torchair.use_cached_graph must be a bool"):
        GraphConfig.from_dict({"torchair": {"use_cached_graph": "true"}})


def test_to_dict_is_json_safe_and_round_trips():
    cfg = GraphConfig(enabled=True, backend="inductor", max_batch_size=8, capture_sizes=(1, 4),
                      compile_cache_dir="/tmp/x", torchair=TorchairOptions(mode="reduce-overhead"))
    assert GraphConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# --- vllm-ascend's torchair_graph_config -----------------------------------------------------


def test_vllm_ascend_docs_example_maps_onto_graph_config():
    with pytest.warns(UserWarning, match="ignored: multistream_overlap_shared_expert, refresh, weight_prefetch"):
        cfg = GraphConfig.from_dict({"additional_config": VLLM_ASCEND_EXAMPLE})
    assert cfg.enabled and cfg.capture_sizes == (1, 2, 4, 8)
    assert cfg.torchair.use_cached_graph
    # keys the example leaves out keep vllm-ascend's defaults
    assert cfg.torchair.enable_view_optimize and cfg.torchair.enable_frozen_parameter


def test_vllm_ascend_section_maps_mode_and_torchair_switches():
    section = {"enabled": 1, "mode": "reduce-overhead", "enable_view_optimize": False,
               "enable_frozen_parameter": False, "graph_batch_sizes": [16, 4]}
    cfg = GraphConfig.from_dict({"torchair_graph_config": section, "max_batch_size": 32})
    assert cfg.enabled is True
    assert cfg.torchair == TorchairOptions(mode="reduce-overhead", enable_frozen_parameter=False,
                                           enable_view_optimize=False)
    assert cfg.resolved_capture_sizes() == (4, 16, 32)


def test_vllm_ascend_batch_size_defaults():
    # no sizes: vllm-ascend captures [1, max_num_seqs]; graph_batch_sizes_init: our default sizes
    plain = GraphConfig.from_dict({"torchair_graph_config": {"enabled": True}, "max_batch_size": 16})
    init = GraphConfig.from_dict({"torchair_graph_config": {"enabled": True, "graph_batch_sizes_init": True},
                                  "max_batch_size": 16})
    assert plain.resolved_capture_sizes() == (1, 16)
    assert init.resolved_capture_sizes() == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("key, value", [
    ("use_cached_graph", True), ("graph_batch_sizes", [1, 2]), ("graph_batch_sizes_init", True),
    ("mode", "reduce-overhead"), ("enable_multistream_mla", True), ("enable_kv_nz", True),
])
def test_vllm_ascend_graph_only_keys_are_rejected_when_disabled(key, value):
    with pytest.raises(ValueError, match=f"torchair_graph_config.{key} is valid only when graph mode is enabled"):
        GraphConfig.from_dict({"torchair_graph_config": {"enabled": False, key: value}})


def test_vllm_ascend_non_graph_keys_are_accepted_when_disabled():
    cfg = GraphConfig.from_dict({"torchair_graph_config": {"enable_view_optimize": False, "graph_batch_sizes": []}})
    assert not cfg.enabled and cfg.torchair.enable_view_optimize is False


@pytest.mark.parametrize("key", ["enable_multistream_mla", "enable_multistream_moe", "enable_super_kernel",
                                 "enable_kv_nz", "use_cached_kv_cache_bytes"])
def test_vllm_ascend_unsupported_features_are_refused_when_requested(key):
    assert GraphConfig.from_dict({"torchair_graph_config": {"enabled": True, key: False}}).enabled
    with pytest.raises(ValueError, match=f"{key} is not supported by ascend_graph"):
        GraphConfig.from_dict({"torchair_graph_config": {"enabled": True, key: True}})


def test_vllm_ascend_unknown_and_mistyped_keys_are_rejected_by_name():
    with pytest.raises(ValueError, match="unknown key 'foo' in torchair_graph_config; known keys: enabled, mode"):
        GraphConfig.from_dict({"torchair_graph_config": {"enabled": True, "foo": 1}})
    with pytest.raises(TypeError, match="torchair_graph_config.graph_batch_sizes must be a list"):
        GraphConfig.from_dict({"torchair_graph_config": {"enabled": True, "graph_batch_sizes": 8}})
    with pytest.raises(ValueError, match="graph_batch_sizes_init is valid only when graph_batch_sizes is empty"):
        GraphConfig.from_dict({"torchair_graph_config": {"enabled": True, "graph_batch_sizes": [2],
                                                         "graph_batch_sizes_init": True}})


def test_same_setting_given_both_ways_must_agree():
    assert GraphConfig.from_dict({"enabled": True, "torchair_graph_config": {"enabled": True}}).enabled
    with pytest.raises(ValueError, match="enabled is set twice with different values"):
        GraphConfig.from_dict({"enabled": False, "torchair_graph_config": {"enabled": True}})


# --- environment -----------------------------------------------------------------------------


def test_env_overrides_base_with_json_then_flag():
    base = GraphConfig(max_batch_size=8)
    env = {"ASCEND_GRAPH_CONFIG": json.dumps({"enabled": True, "capture_sizes": [2]}),
           "ASCEND_GRAPH_BACKEND": "aot_eager"}
    cfg = GraphConfig.from_env(base, environ=env)
    assert (cfg.enabled, cfg.backend, cfg.resolved_capture_sizes()) == (True, "aot_eager", (2, 8))
    off = GraphConfig.from_env(base, environ={**env, "ASCEND_GRAPH_ENABLED": "0"})
    assert not off.enabled and off.capture_sizes == (2,)


def test_env_accepts_the_vllm_ascend_schema_and_leaves_base_when_unset():
    env = {"ASCEND_GRAPH_CONFIG": json.dumps({"torchair_graph_config": {"enabled": True, "mode": "reduce-overhead"}})}
    assert GraphConfig.from_env(environ=env).torchair.mode == "reduce-overhead"
    base = GraphConfig(enabled=True, max_batch_size=4)
    assert GraphConfig.from_env(base, environ={"ASCEND_GRAPH_ENABLED": ""}) == base


@pytest.mark.parametrize("env, error, words", [
    ({"ASCEND_GRAPH_ENABLED": "maybe"}, ValueError, "ASCEND_GRAPH_ENABLED must be"),
    ({"ASCEND_GRAPH_CONFIG": "{not json"}, ValueError, "ASCEND_GRAPH_CONFIG is not valid JSON"),
    ({"ASCEND_GRAPH_CONFIG": "[1, 2]"}, TypeError, "ASCEND_GRAPH_CONFIG must be a JSON object"),
    ({"ASCEND_GRAPH_BACKEND": "xla"}, ValueError, "ASCEND_GRAPH_BACKEND: backend must be one of"),
    ({"ASCEND_GRAPH_CONFIG": '{"max_batch_size": 0}'}, ValueError, "ASCEND_GRAPH_CONFIG: max_batch_size must be >= 1"),
])
def test_bad_env_values_are_rejected_naming_the_variable(env, error, words):
    with pytest.raises(error) as info:
        GraphConfig.from_env(environ=env)
    assert words in str(info.value)


def test_inductor_freezing_min_batch_reads_from_dict_and_round_trips():
    cfg = GraphConfig.from_dict({"enabled": True, "inductor_freezing_min_batch": 8})
    assert cfg.inductor_freezing_min_batch == 8 and GraphConfig().inductor_freezing_min_batch is None
    assert GraphConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(TypeError, match="inductor_freezing_min_batch must be an int"):
        GraphConfig.from_dict({"inductor_freezing_min_batch": "8"})
