"""Voice conversion against the official code: ``CosyVoice.convert`` = official ``inference_vc``.

``inference_vc`` is ``frontend_vc`` (speech tokenizer on the source; target prompt tokens, prompt mel
and embedding, not trimmed to each other) followed by ``CosyVoiceModel.tts(source_speech_token=...)``.
Both halves have official golden data already (tests/data, made by the official code at commit ace7c47,
golden README):

* the model half: every ``reference.npz`` (CosyVoice 1, 2, 3) was made *through* the official
  ``tts(source_speech_token=...)`` — the VC entry point (``vc_job``) — streamed and not (§2.3, §7.5,
  §8.3).
  Here the same tokens go through ``convert`` (a source ``Voice`` carries them), with the golden
  prompt and the official random draws injected; the chunk plans must be the official ones and the
  audio within the golden waveform tolerance (1e-3).
* the frontend half: ``features/*.npz`` hold the official ``load_wav``, whisper log-mel (speech
  tokenizer input), Matcha prompt mel and kaldi fbank of real speech (§4). The source tokens of
  ``convert`` must be exactly the tokenizer's output on the official log-mel, the VC target prompt
  mel the official ``mel24k`` *whole* (no trimming in VC mode) within the feature tolerances.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from _convert_support import golden_run_voices, load_family, load_golden

from trt_cosy import SynthesisConfig, pipeline

pytest.importorskip("torch", reason="needs the [build] extra (torch) to build the tiny engines")

MEL_TOLERANCE = 2e-4  # golden README §3 / §7.6 / §8.4: flow mel
WAV_TOLERANCE = 1e-3  # golden README §3 / §7.6 / §8.4: waveforms
FEATURES = Path(__file__).parent / "data" / "features"
RUNS = {
    "v1": ("nonstream", "stream"),
    "v2": ("nonstream", "stream", "streampad"),
    "v3": ("nonstream", "stream", "streampad"),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return {family: load_family(tmp_path_factory, family) for family in ("v1", "v2", "v3")}


class _ReplayV1:
    """The official v1 draws of one golden run, chunk after chunk (``V1Draws``)."""

    def __init__(self, golden: dict, run: str):
        self.golden, self.run, self.chunk = golden, run, -1

    def flow_noise(self, frames: int) -> np.ndarray:  # called first in every chunk
        self.chunk += 1
        return self.golden[f"{self.run}_c{self.chunk}_flow_z"].astype(np.float32)

    def hift_phase(self) -> np.ndarray:
        return self.golden[f"{self.run}_c{self.chunk}_hift_rand_phase"].astype(np.float32)[:, :, 0]  # [1, 9]

    def hift_noise(self, samples: int) -> np.ndarray:
        noise = self.golden[f"{self.run}_c{self.chunk}_hift_sine_noise"].astype(np.float32)
        return noise.transpose(0, 2, 1)  # [1, S, 9]


def _convert_golden_run(tts, golden: dict, run: str, monkeypatch) -> tuple[np.ndarray, list, list]:
    """``convert`` on the golden run's tokens and prompt with the official draws; (wav [N], plans,
    flow mels [1, 80, F] of every chunk)."""
    source, target = golden_run_voices(golden, run, tts.sample_rate)
    flow = tts._stages.synthesizer.flow if tts.family == "v1" else tts._stages.flow
    token2mel, mels = type(flow).token2mel, []

    def recording_token2mel(self, *args, **kwargs):
        out = token2mel(self, *args, **kwargs)
        mels.append(out.mel)
        return out

    monkeypatch.setattr(type(flow), "token2mel", recording_token2mel)
    stream = run != "nonstream"
    request = tts._conversion(source, target, 0, SynthesisConfig(stream=stream), None)
    plans: list = []
    if tts.family == "v1":
        request.draws = _ReplayV1(golden, run)
    elif tts.family == "v2":  # the official HiFT draws of each chunk (v3's noise is fixed, in the engines)
        render = pipeline.render_chunk

        def injected(stages, voice, tokens, plan, cache, rng, ratio, flow_cache=None, **options):
            noise = golden[f"{run}_c{len(plans) - 1}_hift_sine_noise"].astype(np.float32)
            return render(stages, voice, tokens, plan, cache, noise, ratio, flow_cache=flow_cache, **options)

        monkeypatch.setattr(pipeline, "render_chunk", injected)
    original = request._render

    def recording(tokens, plan, state):
        plans.append(plan)
        return original(tokens, plan, state)

    request._render = recording
    chunks = list(request.chunks())
    assert [chunk.segment for chunk in chunks] == [0] * len(chunks) and chunks[-1].is_last
    return np.concatenate([chunk.samples for chunk in chunks]), plans, mels


@pytest.mark.parametrize(
    ("family", "run"), [(family, run) for family, runs in RUNS.items() for run in runs]
)
def test_convert_reproduces_the_official_vc_model_path(engines, family, run, monkeypatch):
    tts, golden = engines[family], load_golden(family)
    wav, plans, mels = _convert_golden_run(tts, golden, run, monkeypatch)
    official = golden["meta"][run]["chunks"]
    assert [plan.end - plan.offset if family == "v1" else plan.end for plan in plans] == [
        chunk["n_tokens_to_flow"] for chunk in official
    ]
    finals = [chunk.get("finalize", chunk.get("flow_finalize")) for chunk in official]
    assert [plan.final for plan in plans] == finals
    for index, mel in enumerate(mels):  # golden README §3: flow mel 2e-4
        official_mel = golden[f"{run}_c{index}_flow_mel"]
        assert mel.shape == official_mel.shape
        assert float(np.abs(mel - official_mel).max()) <= MEL_TOLERANCE, f"{family} {run} chunk {index} mel"
    assert len(mels) == len(official)
    theirs = golden[f"{run}_wav"][0]
    assert wav.shape == theirs.shape
    error = float(np.abs(wav - theirs).max())
    assert error <= WAV_TOLERANCE, f"{family} {run}: max |ours - official| = {error:.3g}"


def _features(name: str) -> dict[str, np.ndarray]:
    with np.load(FEATURES / f"{name}.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.mark.parametrize("name", ["en_44k1_stereo", "zh_22k05_stereo", "en_16k_mono"])
def test_source_tokens_are_the_tokenizer_on_the_official_log_mel(engines, name):
    """44.1 / 22.05 kHz stereo sources are mixed down and resampled as the official ``load_wav``."""
    tts = engines["v2"]
    target = tts.vc_voice_from_wav(FEATURES / "audio" / "zh_16k_mono.wav")
    request = tts._conversion(FEATURES / "audio" / f"{name}.wav", target, 0, None, None)
    ours = request._tokens_of(0)  # what the request's worker tokenises: [n]
    official = _official_tokens(tts, _features(name))
    np.testing.assert_array_equal(ours, official)
    assert ours.size > 0


def _official_tokens(tts, golden: dict) -> np.ndarray:
    """The speech tokenizer on the official whisper log-mel (what ``_extract_speech_token`` feeds it)."""
    tokenizer = tts.voice_builder.speech_tokenizer
    feats_name, length_name = tokenizer.input_names[:2]
    feed = {
        feats_name: golden["whisper_logmel"].astype(np.float32),  # [1, 128, T]
        length_name: golden["whisper_logmel_len"].astype(np.int32),  # [1]
    }
    return np.asarray(tokenizer.infer(feed)[tokenizer.output_names[0]]).reshape(-1)  # [n]


@pytest.mark.parametrize("name", ["zh_16k_mono", "en_44k1_stereo"])
def test_vc_target_prompt_is_the_official_frontend_vc(engines, name):
    """Tokens of the whole reference, the whole official ``mel24k`` (not trimmed to 2 frames per
    token as in zero-shot), the campplus embedding of the official fbank."""
    tts = engines["v2"]
    voice = tts.vc_voice_from_wav(FEATURES / "audio" / f"{name}.wav")
    golden = _features(name)
    mel = golden["mel24k"][0]  # [T, 80]
    assert voice.prompt_mel.shape == mel.shape
    error = np.abs(voice.prompt_mel - mel)
    assert error.max() <= 2e-3 and np.percentile(error, 99) <= 2e-4
    np.testing.assert_array_equal(voice.speech_tokens, _official_tokens(tts, golden))  # all: no trimming
    campplus = tts.voice_builder.campplus
    fbank = (golden["fbank_raw"] - golden["fbank_mean"]).astype(np.float32)[None]  # [1, T, 80]
    official = campplus.infer({campplus.input_names[0]: fbank})[campplus.output_names[0]]
    np.testing.assert_allclose(voice.speaker_embedding, np.asarray(official).reshape(-1), atol=1e-3)
