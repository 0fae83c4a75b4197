"""fp32 -> strongly typed fp16 ONNX: island rules on hand-made graphs (fast), then the golden tiny
graphs on ONNX Runtime against their fp32 export (slow: shares the session's tiny export), and the
``--onnx-only`` TensorRT preparation (fp16 graphs, profiles, tensorrt.json) without TensorRT."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import onnx
from onnx import TensorProto, helper, numpy_helper

from trt_cosy.builder.quantize.precision import (
    FP16,
    FP32,
    PrecisionPolicy,
    compare_fp16,
    convert_model_fp16,
    to_fp16_graph,
)
from trt_cosy.errors import MissingDependencyError, TrtCosyError
from trt_cosy.models.registry import read_release_config
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner

RNG = np.random.default_rng(0)


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _rmsnorm_attention() -> onnx.ModelProto:
    """x [1, T, 8] -> MatMul -> RMSNorm (Pow, ReduceMean, Add eps, Sqrt, Div) -> Softmax -> MatMul -> y."""
    weight = numpy_helper.from_array(RNG.standard_normal((8, 8)).astype(np.float32), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Pow", ["h", "two"], ["sq"], name="pow"),
        helper.make_node("ReduceMean", ["sq", "axes"], ["var"], name="mean", keepdims=1),
        helper.make_node("Add", ["var", "eps"], ["var_eps"], name="add_eps"),
        helper.make_node("Sqrt", ["var_eps"], ["rms"], name="sqrt"),
        helper.make_node("Div", ["h", "rms"], ["normed"], name="div"),
        helper.make_node("Softmax", ["normed"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "w"], ["y"], name="out"),
    ]
    inits = [
        weight,
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array([-1], np.int64), "axes"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
    ]
    io = (
        helper.make_tensor_value_info("x", FP32, [1, "T", 8]),
        helper.make_tensor_value_info("y", FP32, [1, "T", 8]),
    )
    return _model(nodes, [io[0]], [io[1]], inits)


def _node_precision(model: onnx.ModelProto, name: str) -> int:
    """The dtype a node computes in: the type of its (possibly renamed) first output."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    types = {
        v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.output)
    }
    node = next(n for n in model.graph.node if n.name == name)
    return types[node.output[0]]


def test_islands_stay_fp32_without_rounding_between_their_nodes(tmp_path):
    model, report = convert_model_fp16(_rmsnorm_attention())
    onnx.checker.check_model(model, full_check=True)
    assert _node_precision(model, "proj") == FP16 and _node_precision(model, "out") == FP16
    for name in ("pow", "mean", "add_eps", "sqrt", "softmax"):  # ops + growth: no fp16 hop inside the island
        assert _node_precision(model, name) == FP32, name
    assert [v.type.tensor_type.elem_type for v in (*model.graph.input, *model.graph.output)] == [FP32, FP32]
    assert report.reasons["growth"] == 2 and report.casts >= 3, report.summary()
    onnx.save(_rmsnorm_attention(), tmp_path / "g.onnx")
    to_fp16_graph(tmp_path / "g.onnx", tmp_path / "g16.onnx", PrecisionPolicy())
    feeds = [{"x": RNG.standard_normal((1, t, 8)).astype(np.float32)} for t in (1, 7, 300)]
    errors = compare_fp16(tmp_path / "g.onnx", tmp_path / "g16.onnx", feeds, threads=1)
    assert 0 < errors["y"] < 1e-2, errors  # fp16 did happen, and stayed close


def test_large_constants_are_clamped_and_shared_weights_copied():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="heavy"),  # fp16 user of w
        helper.make_node("Add", ["h", "bias"], ["masked"], name="mask"),  # -1e9 must not become -inf
        helper.make_node("Softmax", ["masked"], ["p"], name="softmax"),
        helper.make_node("MatMul", ["p", "w"], ["y"], name="final"),  # fp32: its module is an island
    ]
    nodes[3].metadata_props.add(key="pkg.torch.onnx.class_hierarchy", value="['M', 'pkg.Head', 'aten.mm']")
    inits = [
        numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"),
        numpy_helper.from_array(np.full((4,), -1e9, np.float32), "bias"),
    ]
    model = _model(
        nodes,
        [helper.make_tensor_value_info("x", FP32, [2, 4])],
        [helper.make_tensor_value_info("y", FP32, [2, 4])],
        inits,
    )
    policy = PrecisionPolicy(op_types=frozenset({"Softmax"}), modules=frozenset({"Head"}))
    converted, _ = convert_model_fp16(model, policy)
    weights = {t.name: numpy_helper.to_array(t) for t in converted.graph.initializer}
    assert weights["bias"].dtype == np.float16 and np.all(weights["bias"] == -65504.0)
    assert weights["w"].dtype == np.float32 and weights["w__fp16"].dtype == np.float16  # used by both kinds
    assert _node_precision(converted, "final") == FP32  # named by its torch module


def test_float_inputs_seed_fp32_index_math():
    """The flow time step t [2] times 1000 feeds sin/cos: computed in fp16 it would be off by ~0.5 rad."""
    nodes = [
        helper.make_node("Mul", ["t", "scale"], ["arg"], name="scale_t"),
        helper.make_node("Sin", ["arg"], ["emb"], name="sin"),
        helper.make_node("Conv", ["x", "kernel"], ["h"], name="conv"),  # heavy: fp16
        helper.make_node("Concat", ["x", "x"], ["xx"], name="concat", axis=1),  # inputs only: stays fp32
        helper.make_node("Mul", ["h", "emb"], ["y"], name="mix"),  # an fp16 input: fp16
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("t", FP32, [2]),
            helper.make_tensor_value_info("x", FP32, [1, 2, "F"]),
        ],
        [
            helper.make_tensor_value_info("y", FP32, [1, 2, "F"]),
            helper.make_tensor_value_info("xx", FP32, [1, 4, "F"]),
        ],
        [
            numpy_helper.from_array(np.array(1000.0, np.float32), "scale"),
            numpy_helper.from_array(np.ones((2, 2, 1), np.float32), "kernel"),
        ],
    )
    converted, _ = convert_model_fp16(model)
    precisions = {
        name: _node_precision(converted, name) for name in ("scale_t", "sin", "conv", "concat", "mix")
    }
    assert precisions == {"scale_t": FP32, "sin": FP32, "conv": FP16, "concat": FP32, "mix": FP16}, precisions


def test_subgraphs_are_refused():
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])], "b", [], [helper.make_tensor_value_info("z", FP32, [1])]
    )
    node = helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)
    model = _model(
        [node],
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", FP32, [1]),
        ],
        [helper.make_tensor_value_info("y", FP32, [1])],
    )
    with pytest.raises(TrtCosyError, match="subgraph"):
        convert_model_fp16(model)


# -- the golden tiny graphs (slow) ------------------------------------------------------------------

# Measured fp16-vs-fp32 errors (max |d| / max(1, max |fp32|)) on the golden inputs: llm 3.4e-4,
# flow_encoder 5.5e-4, flow_estimator 8.0e-4, flow_estimator_stream 9.2e-4, hift 1.1e-4 (see docs/tensorrt.md).
# Bounds are about 4x that.
BOUNDS = {
    "llm": 2e-3,
    "flow_encoder": 3e-3,
    "flow_estimator": 6e-3,
    "flow_estimator_stream": 6e-3,
    "flow_estimator_incremental": 6e-3,  # the estimator's weights and islands (TensorRT, issue 15 item 6)
    "hift": 1e-3,
}


@pytest.fixture(scope="module")
def tiny_fp16(tmp_path_factory, v2_tiny_dir) -> tuple[Path, Path]:
    from _support import shared_tiny_engines  # the session's one tiny export (tests/test_export.py)

    release, engines = shared_tiny_engines(tmp_path_factory, v2_tiny_dir)
    work = tmp_path_factory.mktemp("tiny-trt")
    for path in engines.iterdir():
        if path.is_file() and not path.name.endswith(".npy"):
            shutil.copy2(path, work / path.name)
    return release, work


def _golden_feeds(reference, config) -> dict[str, list[dict[str, np.ndarray]]]:
    qwen = config.llm.qwen
    empty = np.zeros((qwen.num_layers, 1, qwen.num_kv_heads, 0, qwen.head_dim), np.float32)
    tokens = np.concatenate([reference["in_prompt_speech_token"], reference["in_target_speech_token"]], 1)
    mu = reference["nonstream_c0_flow_mu"].transpose(0, 2, 1)  # [1, 80, F]
    frames = mu.shape[2]
    cond = np.zeros((2, 80, frames), np.float32)
    cond[0, :, :50] = reference["in_prompt_feat"][0, :50].T
    estimator = {
        "x": np.repeat(reference["flow_rand_noise"][:, :, :frames], 2, 0),
        "mask": np.ones((2, 1, frames), np.float32),
        "mu": np.concatenate([mu, 0 * mu]),
        "t": np.array([0.5, 0.5], np.float32),
        "spks": RNG.standard_normal((2, 80)).astype(np.float32),
        "cond": cond,
    }

    def hift(key: str) -> dict[str, np.ndarray]:
        return {
            "mel": reference[f"{key}_hift_mel"],
            "sine_noise": reference[f"{key}_hift_sine_noise"].astype(np.float32),
            "cache_source": reference[f"{key}_hift_cache_source"],
        }

    return {
        "llm": [{"inputs_embeds": reference["llm_tf_lm_input"], "past_keys": empty, "past_values": empty}],
        "flow_encoder": [
            {
                "tokens": tokens[:, :-3].astype(np.int64),
                "context": tokens[:, -3:].astype(np.int64),
                "context_valid": np.ones(1, np.float32),
                "streaming": np.zeros(1, np.float32),
                "embedding": reference["in_spk_embedding"],
            }
        ],
        "flow_estimator": [estimator],
        "flow_estimator_stream": [estimator],
        "hift": [hift("nonstream_c0"), hift("stream_c1")],
    }


@pytest.mark.slow
def test_fp16_graphs_track_fp32_on_golden_inputs(tiny_fp16, v2_reference):

    release, work = tiny_fp16
    feeds = _golden_feeds(v2_reference, read_release_config(release))
    measured = {}
    for name, graph_feeds in feeds.items():
        report = to_fp16_graph(work / f"{name}.onnx", work / f"{name}.golden16.onnx")
        assert report.has_metadata and report.fp16_nodes > report.fp32_nodes / 2, report.summary()
        errors = compare_fp16(work / f"{name}.onnx", work / f"{name}.golden16.onnx", graph_feeds, threads=2)
        measured[name] = max(errors.values())
        assert measured[name] < BOUNDS[name], f"{name}: fp16 vs fp32 max error {errors} > {BOUNDS[name]}"
    assert all(v > 0 for v in measured.values()), measured  # the graphs really run in fp16
    print("fp16 vs fp32 on golden inputs:", {k: f"{v:.2e}" for k, v in measured.items()})


@pytest.mark.slow
def test_onnx_only_writes_fp16_graphs_profiles_and_summary(tiny_fp16, tmp_path):
    from trt_cosy.builder.trt.plans import build_plans, prepare_trt_graphs
    from trt_cosy.runtime.manifest import hash_checkpoint
    from trt_cosy.runtime.profiles import read_profiles

    release, work = tiny_fp16
    config = read_release_config(release)
    summary = prepare_trt_graphs(work, config, hash_checkpoint(release), "fp16")
    assert json.loads((work / "tensorrt.json").read_text()) == summary
    assert set(read_profiles(work / "profiles.json")) == set(summary["graphs"])
    for name, entry in summary["graphs"].items():
        assert (work / entry["onnx"]).is_file() and entry["onnx"] == f"{name}.fp16.onnx"
        if "derived_from" not in entry:  # flow step graphs wrap an estimator measured on its own
            worst = max(entry["fp16_vs_fp32_max_error"].values())
            assert 0 < worst < BOUNDS[name], f"{name}: {entry['fp16_vs_fp32_max_error']}"
        runner = OrtRunner.from_path(work / entry["onnx"], name, threads=1, exported=True)
        assert set(runner.input_names) == set(read_profiles(work / "profiles.json")[name].input_names)
    with pytest.raises(MissingDependencyError, match=r"TensorRT plans need an NVIDIA GPU.*trt-cosy\[gpu\]"):
        build_plans(work)
