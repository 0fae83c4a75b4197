"""TensorRT shape profiles as plain data: they match the graph contracts, pick the right bucket,
refuse inputs beyond the largest one, round-trip through JSON and become TensorRT profiles late."""

from __future__ import annotations

import pytest

from trt_cosy.config import ModelConfig
from trt_cosy.errors import EngineMismatchError, InputError
from trt_cosy.models.registry import read_release_config, trt_graphs, trt_profiles
from trt_cosy.runtime import graphs
from trt_cosy.runtime.profiles import (
    GraphProfiles,
    ProfileLimits,
    ShapeProfile,
    read_profiles,
    select_profile,
    write_profiles,
)


@pytest.fixture(scope="module")
def config(v2_tiny_dir) -> ModelConfig:
    return read_release_config(v2_tiny_dir)


@pytest.fixture(scope="module")
def profiles(config):
    return trt_profiles(config)


def _names(graph: GraphProfiles) -> list[str]:
    return [p.name for p in graph.profiles]


def test_every_graph_has_profiles_matching_its_contract(profiles):
    specs = trt_graphs("v2")
    assert set(profiles) == set(specs) == {*graphs.GRAPHS, "flow_step", "flow_step_stream"}
    for name, graph in profiles.items():
        graph.check_spec(specs[name])  # input names, ranks, static dims (batch 2 for CFG)
    step = profiles["flow_step"].profiles[0].shapes
    assert step["x"][2] == (1, 80, 1000) and step["t"] == step["dt"] == ((1,),) * 3  # x at batch 1
    estimator = profiles["flow_estimator"].profiles[0].shapes
    assert estimator["x"][2] == (2, 80, 1000) and estimator["t"] == ((2,),) * 3


def test_check_spec_catches_a_renamed_input(profiles):
    renamed = graphs.GraphSpec("hift", (graphs.TensorSpec("mels", "float32", (1, 80, "F")),), ())
    with pytest.raises(ValueError, match="profiles of 'hift' name"):
        profiles["hift"].check_spec(renamed)


def _llm(config, new: int, past: int) -> dict[str, tuple[int, ...]]:
    qwen = config.llm.qwen
    cache = (qwen.num_layers, 1, qwen.num_kv_heads, past, qwen.head_dim)
    return {"inputs_embeds": (1, new, qwen.hidden_size), "past_keys": cache, "past_values": cache}


def test_llm_prefill_and_kv_length_buckets(config, profiles):
    llm = profiles["llm"]
    assert _names(llm) == ["prefill", "decode_512", "decode_2048", "decode_4096"]
    assert llm.profiles[select_profile(llm, _llm(config, 51, 0))].name == "prefill"
    assert llm.profiles[select_profile(llm, _llm(config, 1, 100))].name == "decode_512"
    assert llm.profiles[select_profile(llm, _llm(config, 1, 1000))].name == "decode_2048"
    assert llm.profiles[select_profile(llm, _llm(config, 1, 4096))].name == "decode_4096"
    with pytest.raises(InputError, match=r"past_keys.*4097.*largest TensorRT profile.*shorter"):
        select_profile(llm, _llm(config, 1, 4097))
    with pytest.raises(InputError, match="inputs_embeds"):
        select_profile(llm, _llm(config, 1025, 0))


def _hift(frames: int, cached: int) -> dict[str, tuple[int, ...]]:
    return {"mel": (1, 80, frames), "sine_noise": (1, 480 * frames, 9), "cache_source": (1, 1, cached)}


def test_flow_and_hift_pick_streaming_then_long_buckets(profiles):
    hift = profiles["hift"]
    assert hift.profiles[hift.select(_hift(58, 3840))].name == "stream"  # a streaming chunk with its cache
    assert hift.profiles[hift.select(_hift(1200, 0))].name == "long"
    with pytest.raises(InputError, match=r"mel.*3001"):
        hift.select(_hift(3001, 0))
    estimator = profiles["flow_estimator_stream"]

    def frames(count: int) -> dict[str, tuple[int, ...]]:
        wide = (2, 80, count)
        return {"x": wide, "mask": (2, 1, count), "mu": wide, "t": (2,), "spks": (2, 80), "cond": wide}

    assert [estimator.profiles[estimator.select(frames(f))].name for f in (100, 1000, 1001, 2000, 2001, 3000)] == [
        "stream",
        "stream",
        "stream_mid",  # issue 29 item 5: a growing streaming segment leaves "stream" for kernels tuned near it
        "stream_mid",
        "long",
        "long",
    ]
    assert estimator.profiles[1].shapes["x"] == ((2, 80, 1), (2, 80, 1250), (2, 80, 2000))
    plain = profiles["flow_estimator"]  # whole utterances: no middle bucket
    assert [p.name for p in plain.profiles] == ["stream", "long"]
    assert [p.name for p in profiles["flow_step_stream"].profiles] == ["stream", "stream_mid", "long"]
    with pytest.raises(InputError, match="flow_estimator_stream"):
        estimator.select({**frames(100), "x": (1, 80, 100)})  # batch 1: CFG needs the pair


def test_limits_change_the_buckets(config):
    small = trt_profiles(
        config, ProfileLimits(max_tokens=100, stream_tokens=40, max_context=300, decode_buckets=(128,))
    )
    assert small["flow_encoder"].max_shapes()["tokens"] == (1, 100)
    assert _names(small["llm"]) == ["prefill", "decode_128", "decode_300"]


def test_max_shapes_is_the_elementwise_maximum(profiles):
    assert profiles["hift"].max_shapes() == {
        "mel": (1, 80, 3000),
        "sine_noise": (1, 1440000, 9),
        "cache_source": (1, 1, 3840),
    }


def test_profiles_round_trip_through_json(tmp_path, profiles):
    path = write_profiles(profiles, tmp_path / "profiles.json")
    assert read_profiles(path) == profiles
    path.write_text("{not json", encoding="utf-8")
    with pytest.raises(EngineMismatchError, match="trt-cosy build --backend tensorrt"):
        read_profiles(path)


def test_shape_profile_validation():
    with pytest.raises(ValueError, match="min <= opt <= max"):
        ShapeProfile("bad", {"x": ((1, 8), (1, 4), (1, 16))})
    with pytest.raises(ValueError, match="ranks differ"):
        ShapeProfile("bad", {"x": ((1,), (1, 4), (1, 16))})
    with pytest.raises(ValueError, match="same inputs"):
        GraphProfiles(
            "g", (ShapeProfile("a", {"x": ((1,), (1,), (1,))}), ShapeProfile("b", {"y": ((1,), (1,), (1,))}))
        )


class _FakeTrtProfile:
    def __init__(self):
        self.calls = []

    def set_shape(self, name, low, opt, high):
        self.calls.append((name, low, opt, high))


class _FakeBuilder:
    def create_optimization_profile(self):
        return _FakeTrtProfile()


def test_to_trt_sets_every_input_on_a_builder_profile(profiles):
    trt_profile = profiles["hift"].profiles[0].to_trt(_FakeBuilder())
    assert [c[0] for c in trt_profile.calls] == ["mel", "sine_noise", "cache_source"]
    assert trt_profile.calls[0] == ("mel", (1, 80, 1), (1, 80, 58), (1, 80, 512))
