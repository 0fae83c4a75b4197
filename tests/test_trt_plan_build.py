"""build_plan / build_plans over a fake tensorrt module that fails the way the real one does.

``IBuilderConfig::addOptimizationProfile`` returns -1 for a profile it rejects (``NvInfer.h``), the
Python ``IOptimizationProfile.set_shape`` raises ``RuntimeError`` for inconsistent shapes
(``pyCore.cpp``), and TensorRT drops network inputs that nothing uses from the built plan. Each must
stop the build before a plan is written: a plan the runtime refuses would otherwise be rebuilt and
refused forever. No GPU, no TensorRT.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from trt_cosy.builder.trt import plans as trt_build
from trt_cosy.errors import InputError, TrtCosyError
from trt_cosy.runtime.backends.tensorrt.runner import PlanRecord
from trt_cosy.runtime.profiles import GraphProfiles, ShapeProfile, write_profiles

PROFILES = GraphProfiles(
    "toy",
    (
        ShapeProfile("short", {"x": ((1, 1, 4), (1, 8, 4), (1, 16, 4))}),
        ShapeProfile("long", {"x": ((1, 1, 4), (1, 64, 4), (1, 128, 4))}),
    ),
)


class _Profile:
    def __init__(self):
        self.shapes = {}

    def set_shape(self, name, low, opt, high):
        ok = len(low) == len(opt) == len(high) and all(
            a <= b <= c for a, b, c in zip(low, opt, high, strict=True)
        )
        if not ok:
            raise RuntimeError("Shape provided for min is inconsistent with other shapes.")
        if 0 in tuple(opt):  # pessimistic: TensorRT tunes at opt; a zero-volume opt is refused here
            raise RuntimeError("Shape provided for opt has a zero dimension.")
        self.shapes[name] = (tuple(low), tuple(opt), tuple(high))


def fake_tensorrt(graph: dict) -> SimpleNamespace:
    """A tensorrt module; ``graph``: {"inputs": [...], "unused": [...], "rank": {name: rank}}."""
    made = {"builders": [], "runtimes": [], "loggers": [], "configs": []}

    class ILogger:
        Severity = SimpleNamespace(INTERNAL_ERROR=0, ERROR=1, WARNING=2, INFO=3, VERBOSE=4)

        def __init__(self):
            made["loggers"].append(self)

    class Network:
        inputs: list[str] = []

        @property
        def num_inputs(self):
            return len(self.inputs)

        def get_input(self, index):
            return SimpleNamespace(name=self.inputs[index])

    class Parser:
        num_errors = 0

        def __init__(self, network, logger):
            self.network, self.logger = network, logger

        def parse_from_file(self, path):
            self.network.inputs = list(json.loads(Path(path).read_text())["inputs"])
            return True

    class Config:
        def __init__(self):
            self.profiles = []
            made["configs"].append(self)

        def add_optimization_profile(self, profile):
            ranks = graph.get("rank", {})
            for name, (low, _, _) in profile.shapes.items():
                if name not in graph["inputs"] or len(low) != ranks.get(name, len(low)):
                    return -1  # NvInfer.h: "-1 if the input is not valid"
            self.profiles.append(profile)
            return len(self.profiles) - 1

        def set_memory_pool_limit(self, pool, size):
            pass

        def create_timing_cache(self, data):
            return SimpleNamespace(serialize=lambda: b"cache")

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache
            return True

        def get_timing_cache(self):
            return self.cache

    class Builder:
        def __init__(self, logger):
            self.logger = logger
            made["builders"].append(self)

        def create_network(self, flags):
            return Network()

        def create_optimization_profile(self):
            return _Profile()

        def create_builder_config(self):
            return Config()

        def build_serialized_network(self, network, config):
            kept = [n for n in network.inputs if n not in graph.get("unused", ())]  # unused: dropped
            return json.dumps({"inputs": kept, "profiles": len(config.profiles)}).encode()

    class Engine:
        def __init__(self, data):
            plan = json.loads(bytes(data))
            self.names, self.num_optimization_profiles = [*plan["inputs"], "y"], plan["profiles"]
            self.num_io_tensors = len(self.names)

        def get_tensor_name(self, index):
            return self.names[index]

        def get_tensor_mode(self, name):
            return "out" if name == "y" else "in"

    class Runtime:
        def __init__(self, logger):
            self.logger = logger
            made["runtimes"].append(self)

        def deserialize_cuda_engine(self, data):
            return Engine(data)

    return SimpleNamespace(
        ILogger=ILogger,
        Builder=Builder,
        OnnxParser=Parser,
        Runtime=Runtime,
        NetworkDefinitionCreationFlag=SimpleNamespace(STRONGLY_TYPED=0),
        MemoryPoolType=SimpleNamespace(WORKSPACE=0),
        TensorIOMode=SimpleNamespace(INPUT="in", OUTPUT="out"),
        made=made,
    )


def _graph_file(tmp_path: Path, inputs: list[str]) -> Path:
    path = tmp_path / "toy.onnx"  # the fake parser reads the input names from it
    path.write_text(json.dumps({"inputs": inputs}))
    return path


def test_profiles_are_added_once_per_slot_in_order(tmp_path):
    trt = fake_tensorrt({"inputs": ["x"]})
    plan = trt_build.build_plan(
        _graph_file(tmp_path, ["x"]), tmp_path / "toy.plan", PROFILES, tmp_path / "t.cache", slots=3, trt=trt
    )
    (config,) = trt.made["configs"]
    highs = [p.shapes["x"][2][1] for p in config.profiles]
    assert highs == [16, 128] * 3, highs  # slot k: profiles 2k ("short"), 2k + 1 ("long")
    assert json.loads(plan.read_bytes())["profiles"] == 6


def test_a_rejected_profile_stops_the_build_before_a_plan_is_written(tmp_path):
    """Issue 19 item 5: add_optimization_profile returns -1; the old build wrote the plan anyway."""
    trt = fake_tensorrt({"inputs": ["x"], "rank": {"x": 2}})  # the graph's x is [1, T]: rank 3 is invalid
    with pytest.raises(TrtCosyError, match=r"rejected profile 'short'.*returned -1"):
        trt_build.build_plan(_graph_file(tmp_path, ["x"]), tmp_path / "toy.plan", PROFILES, trt=trt)
    assert not (tmp_path / "toy.plan").exists()


def test_inconsistent_profile_shapes_are_the_projects_error(tmp_path):
    class Broken(ShapeProfile):
        def __post_init__(self):  # skip the dataclass check: a profile TensorRT must refuse
            pass

    bad = GraphProfiles("toy", (Broken("bad", {"x": ((1, 9, 4), (1, 8, 4), (1, 16, 4))}),))
    trt = fake_tensorrt({"inputs": ["x"]})
    with pytest.raises(TrtCosyError, match="rejects profile 'bad'.*inconsistent"):
        trt_build.build_plan(_graph_file(tmp_path, ["x"]), tmp_path / "toy.plan", bad, trt=trt)


def test_inputs_the_plan_dropped_stop_the_build(tmp_path):
    """Issue 19 item 5: TensorRT drops unused inputs; the runtime would refuse that plan forever."""
    profiles = GraphProfiles(
        "toy", tuple(ShapeProfile(p.name, {**p.shapes, "flag": ((1,),) * 3}) for p in PROFILES.profiles)
    )
    trt = fake_tensorrt({"inputs": ["x", "flag"], "unused": ["flag"]})
    with pytest.raises(TrtCosyError, match=r"built plan has inputs \['x'\].*missing \['flag'\].*drops"):
        trt_build.build_plan(_graph_file(tmp_path, ["x", "flag"]), tmp_path / "toy.plan", profiles, trt=trt)
    assert not (tmp_path / "toy.plan").exists()


def test_network_inputs_the_profiles_do_not_name_stop_the_build(tmp_path):
    trt = fake_tensorrt({"inputs": ["x", "extra"]})
    with pytest.raises(
        TrtCosyError, match=r"parsed network has inputs \['extra', 'x'\].*unnamed \['extra'\]"
    ):
        trt_build.build_plan(_graph_file(tmp_path, ["x", "extra"]), tmp_path / "toy.plan", PROFILES, trt=trt)


def test_every_builder_and_runtime_shares_one_logger(tmp_path):
    """Issue 19 item 6: one logger for the process (TensorRT keeps the first one it is given)."""
    trt = fake_tensorrt({"inputs": ["x"]})
    for name in ("a", "b"):
        trt_build.build_plan(_graph_file(tmp_path, ["x"]), tmp_path / f"{name}.plan", PROFILES, trt=trt)
    loggers = {id(b.logger) for b in trt.made["builders"]} | {id(r.logger) for r in trt.made["runtimes"]}
    assert len(trt.made["loggers"]) == 1 and len(loggers) == 1 and len(trt.made["runtimes"]) == 1


def test_build_plans_records_slots_and_rebuilds_when_they_change(tmp_path, monkeypatch):
    trt = fake_tensorrt({"inputs": ["x"]})
    system = {"gpu": "Fake GPU", "compute_capability": "9.0", "tensorrt": "10.12.0"}
    monkeypatch.setattr(trt_build, "load_tensorrt", lambda: trt)
    monkeypatch.setattr(trt_build, "current_system", lambda trt: system)
    _graph_file(tmp_path, ["x"])
    write_profiles({"toy": PROFILES}, tmp_path / "profiles.json")
    summary = {
        "graphs": {"toy": {"onnx": "toy.onnx", "onnx_sha256": "aa"}},
        "precision": "fp16",
        "checkpoint": "cc",
        "profiles": "profiles.json",
    }
    (tmp_path / trt_build.TRT_SUMMARY_NAME).write_text(json.dumps(summary))
    messages: list[str] = []
    records = trt_build.build_plans(tmp_path, slots=2, progress=messages.append)
    assert records["toy"].slots == 2
    stored = PlanRecord.from_dict(json.loads((tmp_path / "plans" / "toy.json").read_text()))
    assert stored.slots == 2 and json.loads((tmp_path / "plans" / "toy.plan").read_bytes())["profiles"] == 4
    trt_build.build_plans(tmp_path, slots=2, progress=messages.append)
    assert "kept" in messages[-1], messages
    trt_build.build_plans(tmp_path, slots=1, progress=messages.append)
    assert any("built for 2 slot(s), 1 wanted" in m for m in messages), messages


def test_a_profile_with_an_empty_opt_shape_stops_the_build(tmp_path):
    """Issue 29 item 7: tactics are tuned at opt; an opt with a zero dimension is refused before TensorRT."""
    empty = GraphProfiles("toy", (ShapeProfile("prefill", {"x": ((1, 0, 4), (1, 0, 4), (1, 16, 4))}),))
    trt = fake_tensorrt({"inputs": ["x"]})
    with pytest.raises(TrtCosyError, match=r"profile 'prefill' has an empty opt shape for \['x'\]"):
        trt_build.build_plan(_graph_file(tmp_path, ["x"]), tmp_path / "toy.plan", empty, trt=trt)
    assert not (tmp_path / "toy.plan").exists() and trt.made["configs"][0].profiles == []


@pytest.mark.parametrize("release", ["cosyvoice1-tiny", "cosyvoice2-tiny", "cosyvoice3-tiny"])
def test_every_default_profile_has_a_non_empty_opt(release):
    """Issue 29 item 7: the LLM prefill past length, the incremental estimator's long P and the HiFT
    long cache had opt 0. Every profile TensorRT gets (llm_decode and the incremental estimator too)."""
    from trt_cosy.models.registry import read_release_config, trt_profiles
    from trt_cosy.runtime.incremental_profiles import incremental_profiles
    from trt_cosy.runtime.profiles import llm_decode_profiles

    config = read_release_config(Path(__file__).parent / "data" / release)
    graphs = trt_profiles(config)
    if config.family != "v1":
        graphs["llm_decode"] = llm_decode_profiles(config)
    if config.family == "v2":
        graphs["flow_estimator_incremental"] = incremental_profiles(config)
    empty = {f"{g}/{p.name}": p.empty_opt() for g, graph in graphs.items() for p in graph.profiles}
    assert not {k: v for k, v in empty.items() if v}, empty
    for graph in graphs.values():  # and the fake builder (refusing zero opt dims) accepts them all
        for profile in graph.profiles:
            profile.to_trt(SimpleNamespace(create_optimization_profile=_Profile))


# -- each new plan against the fp32 graph (issue 29 item 8) -------------------------------------------


class _PlanRunner:
    """What ``_plan_runner`` gives: ``infer`` answers the fp32 outputs, changed by ``damage``."""

    def __init__(self, damage):
        self.damage, self.freed = damage, False

    def infer(self, feed):
        if feed["x"].shape[1] > 128:  # the real runner refuses a feed beyond its profiles so
            raise InputError("beyond the largest TensorRT profile")
        return {"y": self.damage(2.0 * np.asarray(feed["x"], np.float32))}

    def free(self):
        self.freed = True


def _prepared(tmp_path: Path, with_feeds: bool = True) -> None:
    _graph_file(tmp_path, ["x"])
    write_profiles({"toy": PROFILES}, tmp_path / "profiles.json")
    summary = {"graphs": {"toy": {"onnx": "toy.onnx", "onnx_sha256": "aa"}}, "precision": "fp16",
               "checkpoint": "cc", "profiles": "profiles.json"}  # fmt: skip
    (tmp_path / trt_build.TRT_SUMMARY_NAME).write_text(json.dumps(summary))
    if with_feeds:  # as write_parity_feeds stores them: two feeds (one beyond every profile) and y = 2x
        (tmp_path / "parity").mkdir()
        x, wide = np.linspace(-3, 3, 40, dtype=np.float32).reshape(1, 10, 4), np.ones((1, 200, 4), np.float32)
        np.savez(tmp_path / "parity" / "toy.npz", **{"0/in/x": x, "0/out/y": 2 * x, "1/in/x": wide, "1/out/y": 2 * wide})


def _build(tmp_path, monkeypatch, damage):
    trt = fake_tensorrt({"inputs": ["x"]})
    system = {"gpu": "Fake GPU", "compute_capability": "9.0", "tensorrt": "10.12.0"}
    monkeypatch.setattr(trt_build, "load_tensorrt", lambda: trt)
    monkeypatch.setattr(trt_build, "current_system", lambda trt: system)
    made = []

    def runner(path, name, profiles):
        assert path.is_file() and name == "toy"
        made.append(_PlanRunner(damage))
        return made[-1]

    monkeypatch.setattr(trt_build, "_plan_runner", runner)
    messages: list[str] = []
    return messages, made, lambda: trt_build.build_plans(tmp_path, progress=messages.append)


def test_a_new_plan_is_checked_against_the_fp32_outputs_and_recorded(tmp_path, monkeypatch):
    _prepared(tmp_path)
    messages, made, build = _build(tmp_path, monkeypatch, lambda y: y + np.float32(1e-3))
    build()
    parity = json.loads((tmp_path / "plans" / "parity.json").read_text())
    assert parity["toy"]["feeds"] == 1 and parity["toy"]["skipped"] == 1, parity  # 200 frames: no profile
    assert parity["toy"]["max_error"]["y"] == pytest.approx(1e-3 / 6.0, rel=1e-3)  # scaled by max |y| = 6
    assert parity["toy"]["tolerance"] == 1e-2 and made[0].freed
    assert any("plan vs fp32 ONNX on 1 feed(s): y 1.67e-04" in m for m in messages), messages


@pytest.mark.parametrize(
    ("damage", "match"),
    [(lambda y: np.where(y > 5, np.nan, y), "NaN/inf"), (lambda y: 1.1 * y, r"differs.*'y': 0.1.*tolerance 0.01")],
)
def test_a_plan_with_nan_or_beyond_the_tolerance_fails_the_build_and_is_removed(tmp_path, monkeypatch, damage, match):
    _prepared(tmp_path)
    _, made, build = _build(tmp_path, monkeypatch, damage)
    with pytest.raises(TrtCosyError, match=match):
        build()
    plans = tmp_path / "plans"
    assert not (plans / "toy.plan").exists() and not (plans / "toy.json").exists()  # rebuilt next time
    assert "toy" not in json.loads((plans / "parity.json").read_text()) and made[0].freed


def test_a_plan_prepared_without_feeds_is_recorded_as_unchecked(tmp_path, monkeypatch):
    _prepared(tmp_path, with_feeds=False)
    messages, made, build = _build(tmp_path, monkeypatch, lambda y: y)
    build()
    assert json.loads((tmp_path / "plans" / "parity.json").read_text())["toy"] == {"feeds": 0, "skipped": "no parity feeds"}
    assert not made and any("plan not checked" in m for m in messages)
