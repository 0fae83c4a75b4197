"""The device-side Euler loop's pieces: the (t, dt) schedule and the flow-step graph surgery.

Fast: the schedule against ``solve_euler``; the step graph around a hand-made estimator (fp32 and
fp16 I/O) on ONNX Runtime against the host loop. Slow: the step graph around the exported tiny
CosyVoice2 estimators (fp32 and fp16) on golden chunks, against the host loop and the golden mel.
``DeviceEulerLoop`` itself is tested in tests/test_euler_loop.py (both use tests/_flow_step_support.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest
from _flow_step_support import CFG_RATE, MELS, _host_solve, _inputs, _NumpyEstimator, _scaled_error
from _support import require_build_extra

from trt_cosy.config import ModelConfig
from trt_cosy.errors import TrtCosyError
from trt_cosy.models.registry import read_release_config
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.backends.tensorrt.euler import guidance_feed, step_schedule
from trt_cosy.runtime.graphs import FLOW_ESTIMATOR, FLOW_ESTIMATOR_STREAM, FLOW_STEP
from trt_cosy.stages.flow import cosine_t_span, solve_euler

STEP_TOL = 1e-5  # device loop vs host loop, relative to max(1, |x|): float32 rounding only
MEL_TOL = 2e-4  # golden README §3: *_flow_mel
FP16_TOL = 6e-3  # tests/test_precision.py BOUNDS for the estimator (fp16 vs fp32)


# -- the schedule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 10])
def test_step_schedule_is_solve_eulers_sequence(steps):
    """cfg 0, x0 = 0 and a one-hot velocity at the step index leave x[0, 0, k] = 0 + dt_k * 1 exactly."""

    def one_hot(x, mask, mu, t, spks, cond):
        velocity = np.zeros_like(x)  # [2, 80, F]
        velocity[:, 0, len(estimator.feeds) - 1] = 1.0
        return velocity

    estimator = _NumpyEstimator(one_hot)
    frames = steps + 1
    zeros = np.zeros((1, MELS, frames), np.float32)
    x = solve_euler(
        estimator, zeros, np.ones((1, 1, frames), np.float32), zeros[:, :, 0], zeros, zeros, steps, 0.0
    )
    schedule = step_schedule(cosine_t_span(steps))
    assert schedule.shape == (steps, 2) and schedule.dtype == np.float32
    recorded_t = np.array([feed["t"][0] for feed in estimator.feeds], np.float32)
    assert np.array_equal(schedule[:, 0], recorded_t), (schedule[:, 0], recorded_t)
    assert np.array_equal(schedule[:, 1], x[0, 0, :steps]), (schedule[:, 1], x[0, 0, :steps])
    assert float(schedule[-1].sum()) == pytest.approx(1.0, abs=1e-6)


# -- the step graph around a hand-made estimator ------------------------------------------------------


def _toy_estimator(fp16_io: bool = False):
    """``_velocity`` as an ONNX graph; ``fp16_io`` declares x and estimator_out float16."""
    from onnx import TensorProto, helper, numpy_helper  # build-time only: the GPU host may lack onnx

    io_type = TensorProto.FLOAT16 if fp16_io else TensorProto.FLOAT
    node = helper.make_node
    nodes = [
        node("Cast", ["x"], ["x32"], to=TensorProto.FLOAT),
        node("Mul", ["half", "x32"], ["scaled"]),
        node("Add", ["scaled", "mu"], ["a"]),
        node("Sub", ["a", "cond"], ["b"]),
        node("Unsqueeze", ["spks", "axis2"], ["spks3"]),  # [2, 80, 1]
        node("Add", ["b", "spks3"], ["inner"]),
        node("Tanh", ["inner"], ["squashed"]),
        node("Mul", ["squashed", "mask"], ["masked"]),
        node("Unsqueeze", ["t", "axes12"], ["t3"]),  # [2, 1, 1]
        node("Add", ["masked", "t3"], ["out32"]),
        node("Cast", ["out32"], ["estimator_out"], to=io_type),
    ]
    wide = [2, MELS, "F"]
    inputs = [
        helper.make_tensor_value_info("x", io_type, wide),
        helper.make_tensor_value_info("mask", TensorProto.FLOAT, [2, 1, "F"]),
        helper.make_tensor_value_info("mu", TensorProto.FLOAT, wide),
        helper.make_tensor_value_info("t", TensorProto.FLOAT, [2]),
        helper.make_tensor_value_info("spks", TensorProto.FLOAT, [2, MELS]),
        helper.make_tensor_value_info("cond", TensorProto.FLOAT, wide),
    ]
    constants = [
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array([2], np.int64), "axis2"),
        numpy_helper.from_array(np.array([1, 2], np.int64), "axes12"),
    ]
    output = helper.make_tensor_value_info("estimator_out", io_type, wide)
    graph = helper.make_graph(nodes, "toy_estimator", inputs, [output], constants)
    # IR 10 (what the dynamo exporter writes): an older onnxruntime refuses the newest onnx's IR version
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def _ort_steps(step_path: Path, inputs: Mapping[str, np.ndarray], steps: int) -> np.ndarray:
    """The step graph run n times on ONNX Runtime, fed the schedule."""
    runner = OrtRunner.from_path(step_path, "flow_step", threads=1)
    feed = guidance_feed(inputs["noise"], inputs["mu"], inputs["mask"], inputs["spks"], inputs["cond"])
    x = feed["x"]  # [1, 80, F]
    for t, dt in step_schedule(cosine_t_span(steps)):
        x = runner.infer({**feed, "x": x, "t": np.array([t]), "dt": np.array([dt])})["x_next"]
    return x


@pytest.mark.parametrize("fp16_io", [False, True])
def test_step_graph_matches_host_loop_on_a_toy_estimator(tmp_path, fp16_io):
    onnx = pytest.importorskip("onnx")
    from trt_cosy.builder.flow_step import ESTIMATOR_PREFIX, wrap_estimator_step, write_flow_step

    model = _toy_estimator(fp16_io)
    wrapped = wrap_estimator_step(model, CFG_RATE)
    onnx.checker.check_model(wrapped, full_check=True)
    io = {v.name: v.type.tensor_type for v in (*wrapped.graph.input, *wrapped.graph.output)}
    assert tuple(v.name for v in wrapped.graph.input) == FLOW_STEP.input_names
    assert tuple(v.name for v in wrapped.graph.output) == FLOW_STEP.output_names
    assert all(value.elem_type == onnx.TensorProto.FLOAT for value in io.values())
    dims = {name: [d.dim_param or d.dim_value for d in value.shape.dim] for name, value in io.items()}
    assert dims["x"] == [1, MELS, "F"] and dims["x_next"] == [1, MELS, "F"] and dims["dt"] == [1], dims
    inner = [n for n in wrapped.graph.node if not n.name.startswith("flow_step/")]
    assert len(inner) == len(model.graph.node) and all(
        n.output[0].startswith(ESTIMATOR_PREFIX) for n in inner
    )
    assert list(wrapped.opset_import) == list(model.opset_import)
    casts = sum(n.op_type == "Cast" and n.name.startswith("flow_step/") for n in wrapped.graph.node)
    assert casts == (2 if fp16_io else 0), casts  # x in, estimator_out back to float32

    onnx.save(model, tmp_path / "estimator.onnx")
    write_flow_step(tmp_path / "estimator.onnx", tmp_path / "step.onnx", CFG_RATE)
    inputs = _inputs(37)
    expected = _host_solve(OrtRunner.from_path(tmp_path / "estimator.onnx", "e", threads=1), inputs, 10)
    error = _scaled_error(_ort_steps(tmp_path / "step.onnx", inputs, 10), expected)
    print(f"toy estimator (fp16 I/O {fp16_io}): step graph vs host loop max error {error:.3e}")
    assert error <= STEP_TOL, f"step graph vs solve_euler: max error {error:.3e} > {STEP_TOL}"


def test_wrap_refuses_a_graph_that_is_not_an_estimator():
    pytest.importorskip("onnx")
    from trt_cosy.builder.flow_step import wrap_estimator_step

    model = _toy_estimator()
    model.graph.output[0].name = "velocity"
    with pytest.raises(TrtCosyError, match="not an estimator graph"):
        wrap_estimator_step(model, CFG_RATE)


# -- the exported tiny CosyVoice2 estimators (slow) ------------------------------------------------------


@pytest.fixture(scope="module")
def model_config(v2_tiny_dir) -> ModelConfig:
    return read_release_config(v2_tiny_dir)


@pytest.fixture(scope="module")
def flow(v2_tiny_dir, model_config):
    require_build_extra()
    from trt_cosy.builder.modules.flow import load_flow

    return load_flow(v2_tiny_dir, model_config.flow)


@pytest.fixture(scope="module")
def estimator_dir(tmp_path_factory, flow, model_config) -> Path:
    """The two fp32 estimator graphs: the session's tiny engines when tests/test_export.py built them,
    else exported here (two dynamo exports, no other graph)."""
    from trt_cosy.builder.export import export_graph, graph_export_plan
    from trt_cosy.builder.modules.flow import EstimatorGraph
    from trt_cosy.runtime.manifest import MANIFEST_NAME

    shared = tmp_path_factory.getbasetemp() / "tiny-engines"
    if (shared / MANIFEST_NAME).is_file():
        return shared
    out = tmp_path_factory.mktemp("flow-step-estimators")
    for spec, streaming in ((FLOW_ESTIMATOR, False), (FLOW_ESTIMATOR_STREAM, True)):
        plan = graph_export_plan(spec.name, model_config)
        module = EstimatorGraph(flow, streaming=streaming)
        export_graph(spec, module, plan.sample, out / f"{spec.name}.onnx", plan.dynamic_shapes)
    return out


class _FirstFeed:
    """Wraps an estimator runner and keeps the first feed (the solve's mu, spks, cond, noise)."""

    def __init__(self, runner):
        self.runner, self.name, self.feed = runner, runner.name, None
        self.input_names, self.output_names = runner.input_names, runner.output_names

    def infer(self, feed):
        if self.feed is None:
            self.feed = {k: np.array(v, copy=True) for k, v in feed.items()}
        return self.runner.infer(feed)


def _golden_solve(flow, config, reference, estimators, scenario: str, index: int):
    """token2mel of a golden chunk through the torch encoder and ``estimators``: (mel, first feed, P)."""
    from trt_cosy.builder.modules.flow import FlowEncoderGraph
    from trt_cosy.builder.torch_runner import TorchRunner
    from trt_cosy.runtime.graphs import FLOW_ENCODER
    from trt_cosy.stages.flow import FlowStage

    info = json.loads(str(reference["meta_json"]))[scenario]
    chunk, prefix = info["chunks"][index], f"{scenario}_c{index}_"
    recorders = [_FirstFeed(runner) for runner in estimators]
    encoder = TorchRunner(FLOW_ENCODER, FlowEncoderGraph(flow))
    stage = FlowStage(encoder, *recorders, reference["flow_rand_noise"], config.flow)
    out = stage.token2mel(
        reference[prefix + "flow_tokens"],
        reference["in_prompt_speech_token"][:, : info["prompt_tokens"]],
        reference["in_prompt_feat"][:, : info["prompt_feat_frames"]],
        reference["in_spk_embedding"],
        streaming=chunk["flow_streaming"],
        finalize=chunk["flow_finalize"],
    )
    feed = next(r.feed for r in recorders if r.feed is not None)
    return out.mel, feed, info["prompt_feat_frames"]


def _step_inputs(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Undo the CFG pair of a recorded estimator feed (row 0) into ``_inputs``' layout."""
    return {
        "noise": feed["x"][:1],
        "mu": feed["mu"][:1],
        "mask": feed["mask"][:1],
        "spks": feed["spks"][:1],
        "cond": feed["cond"][:1],
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("graph", "scenario", "index"),
    [("flow_estimator", "nonstream", 0), ("flow_estimator_stream", "stream", 1)],
)
def test_tiny_step_graph_matches_host_loop_and_golden(
    tmp_path, estimator_dir, flow, model_config, v2_reference, graph, scenario, index
):
    from trt_cosy.builder.flow_step import write_flow_step
    from trt_cosy.builder.quantize.precision import to_fp16_graph

    cfm = model_config.flow.cfm
    fp32 = estimator_dir / f"{graph}.onnx"
    fp16 = tmp_path / f"{graph}.fp16.onnx"
    to_fp16_graph(fp32, fp16, graph=graph)
    errors = {}
    for precision, path in (("fp32", fp32), ("fp16", fp16)):
        ort = OrtRunner.from_path(path, graph, threads=2)
        mel, feed, prompt = _golden_solve(flow, model_config, v2_reference, (ort, ort), scenario, index)
        step_path = write_flow_step(path, tmp_path / f"{graph}.{precision}.step.onnx", cfm.inference_cfg_rate)
        got = _ort_steps(step_path, _step_inputs(feed), cfm.n_timesteps)[:, :, prompt:]  # [1, 80, F - P]
        errors[f"{precision} vs host"] = _scaled_error(got, mel)
        golden = v2_reference[f"{scenario}_c{index}_flow_mel"]
        # fp32: the golden README's absolute bound; fp16: test_precision's scaled estimator bound
        errors[f"{precision} vs golden"] = (
            float(np.abs(got - golden).max()) if precision == "fp32" else _scaled_error(got, golden)
        )
    print(f"{graph} on {scenario}_c{index}:", {k: f"{v:.3e}" for k, v in errors.items()})
    assert errors["fp32 vs host"] <= STEP_TOL and errors["fp16 vs host"] <= STEP_TOL, errors
    assert errors["fp32 vs golden"] <= MEL_TOL, errors
    assert errors["fp16 vs golden"] <= FP16_TOL, errors
