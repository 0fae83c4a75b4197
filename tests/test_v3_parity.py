"""CosyVoice3 (Fun-CosyVoice3-0.5B family): torch reference + numpy stages vs the golden tiny set.

Golden README §8: the official ``CosyVoice3LM`` / ``CausalMaskedDiffWithDiT`` / ``CausalHiFTGenerator``
outputs on ``tests/data/cosyvoice3-tiny``; tolerances of §8.4. The fixed noise buffers
(``flow_rand_noise``, the uniform ``hift_sine_waves``) are injected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs the [build] extra (torch)")

from trt_cosy.builder.torch_runner import TorchRunner
from trt_cosy.errors import InputError
from trt_cosy.models.v3 import graphs as graphs_v3
from trt_cosy.models.v3.config import V3ModelConfig, v3_config_from_release_dir
from trt_cosy.models.v3.export.causal_hift import CausalHiFTGraph
from trt_cosy.models.v3.export.reference import load_torch_model_v3
from trt_cosy.models.v3.stages import (
    V3VocoderCache,
    V3VocoderStage,
    cached_step_outputs,
    filter_silent_tokens,
)
from trt_cosy.runtime.backends.base import Runner
from trt_cosy.stages.flow import FlowOutput, FlowStage
from trt_cosy.stages.llm import LLMStage
from trt_cosy.stages.sampling import greedy_sample

V3_TINY = Path(__file__).parent / "data" / "cosyvoice3-tiny"

# Golden README §8.4 (max abs).
TOL_LLM = 1e-4
TOL_FLOW_H = 1e-4
TOL_MEL = 2e-4
TOL_F0 = 1e-2
TOL_SOURCE = 2e-3
TOL_WAV = 1e-3
SCENARIOS = ("nonstream", "stream", "streampad")
CHUNKS = [("nonstream", 0), ("stream", 0), ("stream", 1), ("stream", 2), ("streampad", 0), ("streampad", 1)]


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(V3_TINY / "reference.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def meta(ref) -> dict:
    return json.loads(str(ref["meta_json"]))


@pytest.fixture(scope="module")
def model():
    return load_torch_model_v3(V3_TINY, hift_noise_seconds=4)


def _err(ours: np.ndarray, golden: np.ndarray, key: str) -> float:
    ours, golden = np.asarray(ours), np.asarray(golden)
    assert ours.shape == golden.shape, f"{key}: shape {ours.shape} != golden {golden.shape}"
    return float(np.abs(ours.astype(np.float64) - golden.astype(np.float64)).max())


def _check(ours: np.ndarray, ref: Mapping[str, np.ndarray], key: str, tol: float) -> None:
    err = _err(ours, ref[key], key)
    assert err <= tol, f"{key}: max abs error {err:.3g} > {tol:g}"


def _ids(ref: Mapping[str, np.ndarray], key: str) -> np.ndarray:
    return ref[key].reshape(-1).astype(np.int64)


# ---------------------------------------------------------------------------------------- config


def test_config_v3_numbers():
    config = v3_config_from_release_dir(V3_TINY)
    assert isinstance(config, V3ModelConfig) and config.family == "v3"
    assert config.llm.speech_vocab_size == 6761 and config.llm.stop_tokens == tuple(range(6561, 6761))
    assert (config.sos_token, config.real_eos_token, config.task_token) == (6561, 6562, 6563)
    assert config.llm.eos_token == 6561  # the id the official ignore_eos masks (see models.v3.stages)
    dit = config.flow.estimator
    assert (dit.dim, dit.depth, dit.heads, dit.dim_head, dit.in_channels) == (64, 2, 4, 16, 320)
    assert config.flow.encoder.channels == 64 and config.flow.encoder.pre_lookahead_len == 3
    assert config.hift.conv_pre_look_right == 4 and config.hift.samples_per_frame == 480
    assert config.mel.fmax is None  # v3 feat_extractor: fmax null


# ------------------------------------------------------------------------------------------- LLM


def _llm_stage(model, runner: Runner | None = None) -> LLMStage:
    return LLMStage(runner or model.runners[graphs_v3.LLM.name], model.llm_tables, model.config.llm)


def test_llm_teacher_forced(model, ref):
    stage = _llm_stage(model)
    text, prompt_text = _ids(ref, "in_text"), _ids(ref, "in_prompt_text")
    prompt_speech, target = _ids(ref, "in_prompt_speech_token"), _ids(ref, "in_target_speech_token")
    prefix = 1 + prompt_text.size + text.size + 1 + prompt_speech.size  # 47
    forced = ref["llm_tf_lm_input"].shape[1] - prefix  # 12
    lm_input = stage.build_inputs(text, prompt_text, np.concatenate([prompt_speech, target[:forced]]))
    assert _err(lm_input, ref["llm_tf_lm_input"], "llm_tf_lm_input") == 0.0
    logits, hidden = stage.teacher_forced(lm_input)  # [1, L, V], [1, L, D]
    _check(hidden, ref, "llm_tf_hidden", TOL_LLM)
    _check(logits[:, prefix - 1 :], ref, "llm_tf_logits", TOL_LLM)  # rows predicting the targets
    qwen = model.config.llm.qwen
    logp, step_hidden = cached_step_outputs(
        model.runners[graphs_v3.LLM.name],
        model.llm_tables["speech_embedding"],
        lm_input[:, :prefix],
        target[:forced],
        (qwen.num_layers, 1, qwen.num_kv_heads, 0, qwen.head_dim),
    )
    _check(logp, ref, "llm_tf_cached_logp", TOL_LLM)
    _check(step_hidden, ref, "llm_tf_cached_hidden", TOL_LLM)


class _Recorder:
    """A runner wrapper that keeps the last-position logits of every call."""

    def __init__(self, inner: Runner):
        self.inner, self.name, self.rows = inner, inner.name, []
        self.input_names, self.output_names = inner.input_names, inner.output_names

    def infer(self, feed):
        out = self.inner.infer(feed)
        self.rows.append(out["logits"][0, -1].copy())
        return out


def test_llm_greedy(model, ref):
    recorder = _Recorder(model.runners[graphs_v3.LLM.name])
    stage = _llm_stage(model, recorder)
    steps = ref["llm_greedy_tokens"].size
    tokens = list(
        stage.generate(
            _ids(ref, "in_text"),
            _ids(ref, "in_prompt_text"),
            _ids(ref, "in_prompt_speech_token"),
            greedy_sample,
            max_new_tokens=steps,
        )
    )
    assert stage.length_limits(ref["in_text"].size) == (24, 240)
    assert tokens == ref["llm_greedy_tokens"].tolist(), f"greedy tokens {tokens}"
    _check(np.stack(recorder.rows[:steps]), ref, "llm_greedy_logits", TOL_LLM)


# ------------------------------------------------------------------------------------------ flow


@pytest.fixture(scope="module")
def flow_outputs(model, ref, meta) -> dict[str, FlowOutput]:
    """Our flow on every golden chunk (computed once: the end-to-end test reuses the mels)."""
    runners = model.runners
    stage = FlowStage(
        runners[graphs_v3.FLOW_ENCODER_V3.name],
        runners[graphs_v3.FLOW_ESTIMATOR.name],
        runners[graphs_v3.FLOW_ESTIMATOR_STREAM.name],
        ref["flow_rand_noise"],
        model.config.flow,
    )
    outputs = {}
    for scenario, index in CHUNKS:
        info = meta[scenario]
        chunk = info["chunks"][index]
        prefix = f"{scenario}_c{index}_"
        outputs[prefix] = stage.token2mel(
            ref[prefix + "flow_tokens"],
            ref["in_prompt_speech_token"][:, : info["prompt_tokens"]],
            ref["in_prompt_feat"][:, : info["prompt_feat_frames"]],
            ref["in_spk_embedding"],
            streaming=chunk["flow_streaming"],
            finalize=chunk["flow_finalize"],
        )
    return outputs


@pytest.mark.parametrize(("scenario", "index"), CHUNKS)
def test_flow_chunk(flow_outputs, ref, scenario, index):
    prefix = f"{scenario}_c{index}_"
    out = flow_outputs[prefix]
    mu = out.mu.transpose(0, 2, 1)  # [1, T, 80], the golden layout
    _check(mu[:, ::2], ref, prefix + "flow_h", TOL_FLOW_H)  # mu = h repeated ×2
    _check(mu, ref, prefix + "flow_mu", TOL_FLOW_H)
    _check(out.mel, ref, prefix + "flow_mel", TOL_MEL)


# ------------------------------------------------------------------------------------------ HiFT


def _vocoder(model, ref) -> V3VocoderStage:
    noise = ref["hift_sine_waves"].astype(np.float32)  # stored float16: exactly the values used
    runners = model.runners
    return V3VocoderStage(
        runners[graphs_v3.HIFT_V3.name], runners[graphs_v3.HIFT_V3_STREAM.name], noise, model.config.hift
    )


def test_hift_synth(model, ref):
    out = _vocoder(model, ref).vocode(ref["in_hift_synth_mel"], final=True)
    for name, tol in (("f0", TOL_F0), ("source", TOL_SOURCE), ("wav", TOL_WAV)):
        _check(out[name], ref, f"hift_synth_{name}", tol)


@pytest.mark.parametrize(("scenario", "index"), CHUNKS)
def test_hift_chunk(model, ref, meta, scenario, index):
    """The official ``hift.inference(hift_mel, finalize)`` on the golden whole-so-far mel."""
    prefix = f"{scenario}_c{index}_"
    final = meta[scenario]["chunks"][index]["hift_finalize"]
    out = _vocoder(model, ref).vocode(ref[prefix + "hift_mel"], final=final)
    _check(out["f0"], ref, prefix + "hift_f0", TOL_F0)
    if prefix + "hift_wav" in ref:
        _check(out["wav"], ref, prefix + "hift_wav", TOL_WAV)
    else:  # non-streaming: its hift_wav is the scenario's wav (README §8.4, not stored)
        _check(out["wav"], ref, f"{scenario}_wav", TOL_WAV)
    if prefix + "hift_source" in ref:
        _check(out["source"], ref, prefix + "hift_source", TOL_SOURCE)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_streaming_end_to_end(model, ref, meta, flow_outputs, scenario):
    """Our flow mels through the v3 vocoder bookkeeping: whole mel re-vocoded, samples after the offset."""
    vocoder = _vocoder(model, ref)
    cache = V3VocoderCache()
    pieces = []
    ratio = model.config.token_mel_ratio
    for index, chunk in enumerate(meta[scenario]["chunks"]):
        prefix = f"{scenario}_c{index}_"
        mel = flow_outputs[prefix].mel[:, :, ratio * chunk["token_offset"] :]  # [1, 80, new frames]
        pieces.append(vocoder.render(mel, cache, final=chunk["hift_finalize"]))
        _check(cache.mel, ref, prefix + "hift_mel", TOL_MEL)
        assert pieces[-1].shape[1] == chunk["out_samples"], f"{prefix}: {pieces[-1].shape[1]} samples emitted"
    _check(np.concatenate(pieces, axis=1), ref, f"{scenario}_wav", TOL_WAV)


def test_hift_f0_float64_option(model, ref):
    """The official float64 f0 predictor, as an option of the reference (``f0_float64=True``)."""
    hift = model.runners[graphs_v3.HIFT_V3_STREAM.name].module.hift
    runner = TorchRunner(graphs_v3.HIFT_V3_STREAM, CausalHiFTGraph(hift, finalize=False, f0_float64=True))
    vocoder = _vocoder(model, ref)
    vocoder.stream_runner = runner
    out = vocoder.vocode(ref["stream_c1_hift_mel"], final=False)
    _check(out["f0"], ref, "stream_c1_hift_f0", TOL_F0)
    _check(out["wav"], ref, "stream_c1_hift_wav", TOL_WAV)


def test_official_hift_noise_is_golden(model, ref):
    """The regenerated SineGen2 buffer equals the official one bit for bit (golden: float16-rounded)."""
    golden = ref["hift_sine_waves"]
    ours = model.hift_noise
    assert ours.dtype == np.float32 and ours.shape == (1, 4 * 24000, 9)
    head = ours[:, : golden.shape[1]]
    assert np.array_equal(head.astype(np.float16), golden), "hift_sine_waves differ from the official buffer"
    assert float(head.min()) >= 0.0 and float(head.max()) < 1.0  # uniform, not Gaussian


# ------------------------------------------------------------------------------------ host logic


def test_filter_silent_tokens():
    tokens = [5, 1, 2, 28, 29, 55, 248, 494, 7, 1, 1, 1, 1, 1, 1, 1, 9]
    assert list(filter_silent_tokens(tokens)) == [5, 1, 2, 28, 29, 55, 7, 1, 1, 1, 1, 1, 9]


def test_vocoder_stage_rejects_bad_calls(model, ref):
    vocoder = _vocoder(model, ref)
    mel = ref["in_hift_synth_mel"]
    with pytest.raises(InputError, match="V3VocoderCache"):
        vocoder.render(mel, None, final=False)
    with pytest.raises(InputError, match="F>=9"):
        vocoder.vocode(mel[:, :, :8], final=False)
    long_mel = np.zeros((1, 80, 200), np.float32)  # 96000 samples > the 76800-sample golden buffer
    with pytest.raises(InputError, match="noise buffer"):
        vocoder.vocode(long_mel, final=True)


def test_one_shot_render_equals_vocode(model, ref):
    vocoder = _vocoder(model, ref)
    mel = ref["in_hift_synth_mel"]
    np.testing.assert_array_equal(vocoder.render(mel), vocoder.vocode(mel, final=True)["wav"])


# ------------------------------------------------------------------------------------ ONNX export


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        graphs_v3.FLOW_ESTIMATOR.name,
        graphs_v3.FLOW_ESTIMATOR_STREAM.name,
        graphs_v3.HIFT_V3.name,
        graphs_v3.HIFT_V3_STREAM.name,
        graphs_v3.FLOW_ENCODER_V3.name,
    ],
)
def test_v3_graph_exports_to_onnx(model, tmp_path, name):
    """Dynamo export + ONNX Runtime vs torch at the sample length and two more (``export_graph`` raises)."""
    from trt_cosy.builder.export import export_graph
    from trt_cosy.models.v3.export.export import V3_TOLERANCES, v3_graph_export_plan

    plan = v3_graph_export_plan(name, model.config)
    assert len(plan.parity) >= 2
    result = export_graph(
        graphs_v3.GRAPHS_V3[name],
        model.runners[name].module,
        plan.sample,
        tmp_path / f"{name}.onnx",
        plan.dynamic_shapes,
        parity_inputs=plan.parity,
        tolerance=V3_TOLERANCES[name],
    )
    worst = max(result.max_errors.values())
    assert worst <= V3_TOLERANCES[name], f"{name}: ORT vs torch max scaled error {worst:.3g}"
