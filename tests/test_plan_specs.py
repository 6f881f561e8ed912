import networkx as nx
import numpy as np
import pytest

from resihp.errors import InputError
from resihp.paths import TRACES
from resihp.plan.specs import ClusterSpec, ModelSpec, stage_memory_gb

CLUSTERS = TRACES / "clusters"
MODELS = TRACES / "models"


def small_cluster(**over):
    data = {
        "name": "t",
        "device": {"memory_gb": 80, "tflops": 400},
        "bandwidth": {"intra_node_gbs": 300, "inter_node_gbs": 40},
        "nodes": {"count": 2, "devices": 4},
    }
    data.update(over)
    return data


@pytest.mark.parametrize(
    "name,devices",
    [
        ("h100-8", 8),
        ("h100-64", 64),
        ("h100-256", 256),
        ("h100-1024", 1024),
        ("cpu-4", 4),
        ("h100-8-degraded", 8),
    ],
)
def test_example_clusters_load(name, devices):
    cluster = ClusterSpec.from_yaml(CLUSTERS / f"{name}.yaml")
    assert len(cluster) == devices
    assert sum(len(r) for r in cluster.node_ranks) == devices


def test_degraded_example_has_its_faults():
    cluster = ClusterSpec.from_yaml(CLUSTERS / "h100-8-degraded.yaml")
    assert cluster.devices[3].speed == 0.4
    assert not cluster.devices[6].alive
    assert cluster.rank_of("node0/6") == 6


@pytest.mark.parametrize("name", ["gpt-7b", "gpt-13b", "gpt-70b", "cpu-small"])
def test_example_models_load(name):
    model = ModelSpec.from_yaml(MODELS / f"{name}.yaml")
    assert model.microbatches * model.microbatch_tokens == model.global_batch_tokens


def test_model_sizes_are_their_class():
    params = {
        n: ModelSpec.from_yaml(MODELS / f"{n}.yaml") for n in ("gpt-7b", "gpt-13b", "gpt-70b")
    }
    total = {n: m.layers * m.params_per_layer + 2 * m.embedding_params for n, m in params.items()}
    assert 6e9 < total["gpt-7b"] < 8e9
    assert 12e9 < total["gpt-13b"] < 14e9
    assert 60e9 < total["gpt-70b"] < 75e9


def test_small_model_matches_runtime_config():
    from resihp.model.config import GPTConfig

    model = ModelSpec.from_yaml(MODELS / "cpu-small.yaml")
    cfg = GPTConfig()
    assert (model.layers, model.hidden, model.heads, model.ffn_hidden, model.vocab) == (
        cfg.layers,
        cfg.hidden,
        cfg.heads,
        cfg.ffn_hidden,
        cfg.vocab,
    )


def test_topology_graph_carries_bandwidths():
    cluster = ClusterSpec.from_dict(small_cluster())
    graph = cluster.topology()
    assert graph.nodes[5]["kind"] == "device"
    path = nx.shortest_path(graph, 0, 5)
    assert path == [0, "node0", "fabric", "node1", 5]
    assert cluster.bandwidth_gbs(0, 1) == 300 and cluster.bandwidth_gbs(0, 5) == 40


def test_with_speeds_by_rank_and_name():
    cluster = ClusterSpec.from_dict(small_cluster()).with_speeds({1: 0.5, "n1/2": 0.0})
    assert cluster.devices[1].speed == 0.5
    assert not cluster.devices[6].alive
    assert cluster.healthy().devices[6].speed == 1.0


def test_with_speeds_from_an_array_keeps_the_hardware():
    base = ClusterSpec.from_dict(small_cluster())
    speeds = np.ones(len(base))
    speeds[[1, 6]] = [0.5, 0.0]
    cluster = base.with_speeds(speeds)
    speeds[2] = 0.3  # the caller's array is copied
    assert [d.speed for d in cluster.devices] == [1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    assert cluster.speeds.tolist() == [d.speed for d in cluster.devices]
    assert cluster.degraded == {1, 6} and cluster.dead == {6}
    assert cluster.hardware_key is base.hardware_key
    assert cluster.devices == base.with_speeds({1: 0.5, "n1/2": 0.0}).devices
    healthy = cluster.healthy()
    assert healthy.devices == base.devices and not healthy.degraded
    with pytest.raises(InputError, match="speed of device 3 must be a number in"):
        base.with_speeds(np.array([1.0, 1.0, 1.0, np.nan, 1.0, 1.0, 1.0, 1.0]))
    with pytest.raises(InputError, match="expected 8 speeds"):
        base.with_speeds(np.ones(3))


@pytest.mark.parametrize(
    "over,match",
    [
        ({"nodes": []}, "field 'nodes' must be a non-empty list"),
        ({"nodes": [{"devices": 0}]}, r"nodes\[0\]: field 'devices' must be positive"),
        ({"device": {"memory_gb": 80}}, "field 'tflops' is missing"),
        ({"device": {"memory_gb": -1, "tflops": 1}}, "'memory_gb' must be a positive number"),
        ({"nodes": [{"devices": [{"speed": 1.5}]}]}, "'speed' must be <= 1.0"),
        ({"nodes": [{"name": "a", "devices": 1}, {"name": "a", "devices": 1}]}, "used twice"),
        ({"speeds": {"n9/0": 0.5}}, "unknown device 'n9/0'"),
        ({"speeds": {3: "slow"}}, "must be a number in"),
        ({"bandwidth": {"intra_node_gbs": 0}}, "intra_node_gbs' must be a positive"),
        # NaN passed every range check (a NaN speed planned that device as dead, an infinite memory
        # crashed the solver)
        (
            {"device": {"memory_gb": float("inf"), "tflops": 1}},
            "'memory_gb' must be a finite number, got inf",
        ),
        (
            {"nodes": [{"devices": [{"speed": float("nan")}]}]},
            "'speed' must be a finite number, got nan",
        ),
        (
            {"bandwidth": {"inter_node_gbs": float("nan")}},
            "'inter_node_gbs' must be a finite number",
        ),
        ({"memory_reserve_gb": 80}, "'memory_reserve_gb' must be below every device's memory_gb"),
        # a spec too large to plan is refused before anything is built (10**8 devices hung the
        # planner)
        ({"nodes": [{"devices": 10**8}]}, "more than 1,048,576 devices"),
        ({"nodes": {"count": 2**21, "devices": 1}}, "'count' must be <= 1048576"),
    ],
)
def test_bad_cluster_is_one_line_error(over, match):
    with pytest.raises(InputError, match=match) as err:
        ClusterSpec.from_dict(small_cluster(**over), where="c.yaml")
    assert "\n" not in str(err.value) and str(err.value).startswith("c.yaml")


def test_unreadable_and_non_mapping_yaml(tmp_path):
    with pytest.raises(InputError, match="cannot read cluster"):
        ClusterSpec.from_yaml(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(InputError, match="expected a YAML mapping"):
        ModelSpec.from_yaml(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("layers: [1,\n")
    with pytest.raises(InputError, match="not valid YAML"):
        ModelSpec.from_yaml(broken)


MODEL = {
    "layers": 4,
    "hidden": 256,
    "heads": 4,
    "ffn_hidden": 1024,
    "vocab": 4096,
    "max_seq_len": 2048,
    "global_batch_tokens": 65536,
    "microbatch_tokens": 2048,
}


@pytest.mark.parametrize(
    "over,match",
    [
        ({"layers": 0}, "'layers' must be a positive integer"),
        ({"hidden": 250}, "divisible by heads"),
        ({"global_batch_tokens": 1000}, "multiple of microbatch_tokens"),
        ({"microbatch_tokens": 1024, "global_batch_tokens": 65536}, ">= max_seq_len"),
        ({"schedule": "zigzag"}, "schedule' must be one of"),
        ({"tp": 3}, "tp must be a power of two"),
        ({"pp": 9}, "exceeds the number of layers"),
        ({"vocab": "big"}, "'vocab' must be an integer"),
        ({"mlp": "relu"}, "field 'mlp' must be one of gelu, swiglu"),
        (
            {"global_batch_tokens": 2048 * 2**17},
            "131,072 micro-batches a step, more than the 65,536",
        ),
    ],
)
def test_bad_model_is_one_line_error(over, match):
    with pytest.raises(InputError, match=match) as err:
        ModelSpec.from_dict({**MODEL, **over}, where="m.yaml")
    assert str(err.value).startswith("m.yaml")


def test_swiglu_model_round_trips_with_its_third_matrix():
    gelu = ModelSpec.from_dict(MODEL)
    swiglu = ModelSpec.from_dict({**MODEL, "mlp": "swiglu"})
    assert ModelSpec.from_dict(swiglu.to_dict()) == swiglu
    h, f = MODEL["hidden"], MODEL["ffn_hidden"]
    assert swiglu.params_per_layer - gelu.params_per_layer == h * f + f
    assert swiglu.shape().mlp_matrices == 3 and gelu.shape().mlp_matrices == 2


def test_missing_model_field_names_it():
    data = dict(MODEL)
    del data["vocab"]
    with pytest.raises(InputError, match="m.yaml: field 'vocab' is missing"):
        ModelSpec.from_dict(data, where="m.yaml")


def test_stage_memory_grows_with_layers_and_in_flight_and_shrinks_with_tp():
    model = ModelSpec.from_yaml(MODELS / "gpt-70b.yaml")
    base = stage_memory_gb(model, 10, 8, 4, False, False)
    assert stage_memory_gb(model, 11, 8, 4, False, False) > base
    assert stage_memory_gb(model, 10, 8, 5, False, False) > base
    assert stage_memory_gb(model, 10, 4, 4, False, False) == pytest.approx(2 * base)
    assert stage_memory_gb(model, 10, 8, 4, True, False) > base
    # 16 bytes per parameter: one layer's model state on one device with tp=8
    state = model.params_per_layer * 16 / 8 / 1e9
    act = stage_memory_gb(model, 1, 8, 1, False, False) - state
    assert act == pytest.approx(model.microbatch_tokens * 34 * model.hidden / 8 / 1e9)


def test_state_bytes_from_their_parts_and_layer_memory():
    from resihp.plan.specs import layer_memory_gb

    model = ModelSpec.from_yaml(MODELS / "gpt-70b.yaml")
    assert model.state_bytes_per_param == 16.0
    lean = ModelSpec.from_dict({**MODEL, "optimizer_bytes_per_param": 8}, where="m.yaml")
    assert lean.state_bytes_per_param == 12.0
    with pytest.raises(InputError, match="either state_bytes_per_param or its parts"):
        ModelSpec.from_dict(
            {**MODEL, "grad_bytes_per_param": 4, "state_bytes_per_param": 18}, where="m.yaml"
        )
    per = layer_memory_gb(model, tp=8)
    assert stage_memory_gb(model, 3, 8, 2, False, False) == pytest.approx(
        3 * per["state"] + 2 * 3 * per["activations_per_microbatch"]
    )
