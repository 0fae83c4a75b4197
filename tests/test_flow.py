"""CosyVoice2 flow: torch reference modules + numpy CFM stage against the golden tiny reference."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs the [build] extra (torch)")

import torch

from trt_cosy.builder.modules.flow import EstimatorGraph, FlowEncoderGraph, load_flow
from trt_cosy.builder.modules.flow_encoder import rel_position_table
from trt_cosy.builder.noise import official_flow_noise
from trt_cosy.builder.torch_runner import TorchRunner
from trt_cosy.errors import InputError
from trt_cosy.models.registry import read_release_config
from trt_cosy.runtime.graphs import FLOW_ENCODER, FLOW_ESTIMATOR, FLOW_ESTIMATOR_STREAM, GraphSpec
from trt_cosy.stages.flow import FlowStage, cosine_t_span

MU_TOL = 1e-4  # golden README §3: *_flow_mu
MEL_TOL = 2e-4  # golden README §3: *_flow_mel

CHUNKS = [
    ("nonstream", 0),
    ("stream", 0),
    ("stream", 1),
    ("stream", 2),
    ("streampad", 0),
    ("streampad", 1),
]


@pytest.fixture(scope="module")
def flow_config(v2_tiny_dir):
    return read_release_config(v2_tiny_dir).flow


@pytest.fixture(scope="module")
def flow(v2_tiny_dir, flow_config):
    return load_flow(v2_tiny_dir, flow_config)


@pytest.fixture(scope="module")
def meta(v2_reference):
    return json.loads(str(v2_reference["meta_json"]))


def _torch_stage(flow, flow_config, noise) -> FlowStage:
    return FlowStage(
        TorchRunner(FLOW_ENCODER, FlowEncoderGraph(flow)),
        TorchRunner(FLOW_ESTIMATOR, EstimatorGraph(flow, streaming=False)),
        TorchRunner(FLOW_ESTIMATOR_STREAM, EstimatorGraph(flow, streaming=True)),
        noise,
        flow_config,
    )


def _run_chunk(stage: FlowStage, ref: Mapping[str, np.ndarray], meta: dict, scenario: str, index: int):
    info = meta[scenario]
    chunk = info["chunks"][index]
    prefix = f"{scenario}_c{index}_"
    out = stage.token2mel(
        ref[prefix + "flow_tokens"],
        ref["in_prompt_speech_token"][:, : info["prompt_tokens"]],
        ref["in_prompt_feat"][:, : info["prompt_feat_frames"]],
        ref["in_spk_embedding"],
        streaming=chunk["flow_streaming"],
        finalize=chunk["flow_finalize"],
    )
    return out, prefix


def _assert_chunk(out, ref: Mapping[str, np.ndarray], prefix: str) -> None:
    golden_mu = ref[prefix + "flow_mu"].transpose(0, 2, 1)  # golden layout [1, T, 80]
    golden_mel = ref[prefix + "flow_mel"]
    assert out.mu.shape == golden_mu.shape, (out.mu.shape, golden_mu.shape)
    assert out.mel.shape == golden_mel.shape, (out.mel.shape, golden_mel.shape)
    mu_err = float(np.abs(out.mu - golden_mu).max())
    mel_err = float(np.abs(out.mel - golden_mel).max())
    assert mu_err <= MU_TOL, f"{prefix}flow_mu max abs error {mu_err:.3g} > {MU_TOL}"
    assert mel_err <= MEL_TOL, f"{prefix}flow_mel max abs error {mel_err:.3g} > {MEL_TOL}"


@pytest.mark.parametrize(("scenario", "index"), CHUNKS)
def test_token2mel_matches_golden(flow, flow_config, v2_reference, meta, scenario, index):
    stage = _torch_stage(flow, flow_config, v2_reference["flow_rand_noise"])
    out, prefix = _run_chunk(stage, v2_reference, meta, scenario, index)
    _assert_chunk(out, v2_reference, prefix)


def test_official_noise_is_golden_prefix(v2_reference):
    golden = v2_reference["flow_rand_noise"]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    noise = official_flow_noise(golden.shape[2])
    assert torch.equal(torch.get_rng_state(), before), "official_flow_noise must restore the global RNG"
    assert noise.shape == golden.shape and noise.dtype == np.float32
    err = float(np.abs(noise - golden).max())
    assert err == 0.0, f"flow_rand_noise max abs error {err:.3g} (must be exact)"


def _official_rel_table(length: int, d_model: int, max_len: int = 5000) -> torch.Tensor:
    """The ESPnet table built as the official class does (fixed max_len, centre slice)."""
    position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    positive = torch.zeros(max_len, d_model)
    negative = torch.zeros(max_len, d_model)
    positive[:, 0::2], positive[:, 1::2] = torch.sin(position * div), torch.cos(position * div)
    negative[:, 0::2], negative[:, 1::2] = torch.sin(-1 * position * div), torch.cos(-1 * position * div)
    table = torch.cat([torch.flip(positive, [0]), negative[1:]], dim=0).unsqueeze(0)
    center = table.shape[1] // 2
    return table[:, center - length + 1 : center + length]


@pytest.mark.parametrize("length", [1, 7, 210])
def test_rel_position_table_equals_official(length):
    ours = rel_position_table(length, 64)
    official = _official_rel_table(length, 64)
    assert ours.shape == official.shape == (1, 2 * length - 1, 64)
    err = float((ours - official).abs().max())
    assert err <= 1e-6, f"relative position table max abs error {err:.3g}"


def test_cosine_t_span_matches_torch():
    t_span = torch.linspace(0, 1, 11, dtype=torch.float32)
    official = (1 - torch.cos(t_span * 0.5 * torch.pi)).numpy()
    ours = cosine_t_span(10)
    assert ours.dtype == np.float32
    # Exact for the 10 official steps: a 1-ulp t error shows up as ~1e-5 in the mel (1000·t embedding).
    err = float(np.abs(ours - official).max())
    assert err == 0.0, f"t_span max abs error {err:.3g}"


def test_token2mel_rejects_bad_input(flow, flow_config, v2_reference):
    stage = _torch_stage(flow, flow_config, v2_reference["flow_rand_noise"])
    prompt = v2_reference["in_prompt_speech_token"]
    feat = v2_reference["in_prompt_feat"]
    emb = v2_reference["in_spk_embedding"]
    with pytest.raises(InputError, match="vocabulary"):
        stage.token2mel(np.array([[1, 6561]]), prompt, feat, emb, streaming=False, finalize=True)
    with pytest.raises(InputError, match="noise"):
        stage.token2mel(np.ones((1, 100), np.int64), prompt, feat, emb, streaming=False, finalize=True)
    with pytest.raises(InputError, match="too few"):
        stage.token2mel(
            np.ones((1, 2), np.int64), prompt[:, :0], feat[:, :0], emb, streaming=True, finalize=False
        )


# --------------------------------------------------------------------------------------------
# ONNX export (dynamo) + ONNX Runtime parity. Exporting three graphs takes ~20-30 s on 2 cores.


class _OrtRunner:
    """Minimal test-local ONNX Runtime runner following a graph contract."""

    def __init__(self, spec: GraphSpec, path: Path):
        import onnxruntime as ort

        self.name = spec.name
        self.spec = spec
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.spec.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.spec.output_names

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = self.session.run(list(self.output_names), {name: feed[name] for name in self.input_names})
        return dict(zip(self.output_names, outputs, strict=True))


def _encoder_inputs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6561, (1, n), generator=gen)
    context = torch.randint(0, 6561, (1, 3), generator=gen)
    return tokens, context, torch.ones(1), torch.ones(1), torch.randn(1, 192, generator=gen)


def _estimator_inputs(frames: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x, mu, cond = (torch.randn(2, 80, frames, generator=gen) for _ in range(3))
    return (
        x,
        torch.ones(2, 1, frames),
        mu,
        torch.rand(2, generator=gen),
        torch.randn(2, 80, generator=gen),
        cond,
    )


def _export(module: torch.nn.Module, spec: GraphSpec, args, dynamic, path: Path) -> Path:
    program = torch.onnx.export(
        module.eval(),
        args,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        dynamic_shapes=dynamic,
        dynamo=True,
        opset_version=18,  # the official estimator export's opset
        verbose=False,
    )
    program.save(str(path))
    return path


@pytest.fixture(scope="module")
def onnx_runners(flow, tmp_path_factory):
    out = tmp_path_factory.mktemp("flow_onnx")
    tokens = torch.export.Dim("N", min=2, max=1500)
    frames = torch.export.Dim("F", min=4, max=3000)
    est_dynamic = ({2: frames}, {2: frames}, {2: frames}, None, None, {2: frames})
    paths = {
        FLOW_ENCODER: _export(
            FlowEncoderGraph(flow),
            FLOW_ENCODER,
            _encoder_inputs(30, 0),
            ({1: tokens}, None, None, None, None),
            out / "flow_encoder.onnx",
        ),
        FLOW_ESTIMATOR: _export(
            EstimatorGraph(flow, False),
            FLOW_ESTIMATOR,
            _estimator_inputs(120, 0),
            est_dynamic,
            out / "est.onnx",
        ),
        FLOW_ESTIMATOR_STREAM: _export(
            EstimatorGraph(flow, True),
            FLOW_ESTIMATOR_STREAM,
            _estimator_inputs(120, 0),
            est_dynamic,
            out / "est_stream.onnx",
        ),
    }
    return {spec.name: _OrtRunner(spec, path) for spec, path in paths.items()}


def _compare_runner(ort_runner, torch_runner, inputs, tol: float, label: str) -> None:
    feed = {name: value.numpy() for name, value in zip(torch_runner.input_names, inputs, strict=True)}
    want = torch_runner.infer(feed)
    got = ort_runner.infer(feed)
    for name in torch_runner.output_names:
        assert got[name].shape == want[name].shape, (label, name, got[name].shape, want[name].shape)
        err = float(np.abs(got[name] - want[name]).max())
        assert err <= tol, f"{label} {name}: ORT vs torch max abs error {err:.3g} > {tol}"


@pytest.mark.slow
def test_onnx_encoder_matches_torch(flow, onnx_runners):
    reference = TorchRunner(FLOW_ENCODER, FlowEncoderGraph(flow))
    for n, streaming, valid in ((7, 0.0, 0.0), (61, 1.0, 1.0)):
        tokens, context, _, _, embedding = _encoder_inputs(n, n)
        inputs = (tokens, context, torch.tensor([valid]), torch.tensor([streaming]), embedding)
        _compare_runner(onnx_runners[FLOW_ENCODER.name], reference, inputs, 1e-5, f"encoder N={n}")


@pytest.mark.slow
@pytest.mark.parametrize("spec", [FLOW_ESTIMATOR, FLOW_ESTIMATOR_STREAM], ids=lambda s: s.name)
def test_onnx_estimator_matches_torch(flow, onnx_runners, spec):
    reference = TorchRunner(spec, EstimatorGraph(flow, streaming=spec is FLOW_ESTIMATOR_STREAM))
    for frames in (37, 130):
        inputs = _estimator_inputs(frames, frames)
        _compare_runner(onnx_runners[spec.name], reference, inputs, 1e-4, f"{spec.name} F={frames}")


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "index"), [("stream", 1), ("stream", 2)])
def test_onnx_token2mel_matches_golden(flow_config, onnx_runners, v2_reference, meta, scenario, index):
    stage = FlowStage(
        onnx_runners[FLOW_ENCODER.name],
        onnx_runners[FLOW_ESTIMATOR.name],
        onnx_runners[FLOW_ESTIMATOR_STREAM.name],
        v2_reference["flow_rand_noise"],
        flow_config,
    )
    out, prefix = _run_chunk(stage, v2_reference, meta, scenario, index)
    _assert_chunk(out, v2_reference, prefix)
