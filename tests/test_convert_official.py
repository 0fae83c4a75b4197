"""Voice conversion against the official ``inference_vc`` run end to end (tests/data/vc/<family>.npz,
made by tools/golden/make_vc_golden.py with the official code at commit ace7c47).

The same source and target wavs go through ``CosyVoice.convert`` with ``vc_voice_from_wav``; the official
run's random draws are regenerated from its log (v1 flow and HiFT noise, v2 HiFT noise; v3 has fixed
noise). CosyVoice 1 alone: the official ``frontend_vc`` loads the target at 24 kHz for the 22.05 kHz mel
settings (golden README §8.5 quirk 5) where trt-cosy resamples it to 22.05 kHz on purpose
(models/v1/family.py), so its prompt mel is checked and used as the official frontend computes it:
trt-cosy's mel on the 24 kHz samples. Source and prompt tokens must be identical, the prompt mel and
embedding within the feature tolerances, the chunk plan the official one, each chunk's flow mel
within 2e-4 and the audio within 1e-3 (golden README §3 / §7.6 / §8.4), streamed and not, and at
speed 0.5 and 2 (the official speed path: the mel stretched before the vocoder).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from _convert_support import load_family
from _official_golden import DATA, cut_wav, load_official_golden

from trt_cosy import SynthesisConfig, pipeline
from trt_cosy.audio import load_audio
from trt_cosy.frontend.features import flow_prompt_mel
from trt_cosy.verify.official_draws import OfficialDraws

pytest.importorskip("torch", reason="needs the [build] extra (torch) to build the tiny engines")

MEL_TOLERANCE = 2e-4  # golden README §3: flow mel
WAV_TOLERANCE = 1e-3  # golden README §3: waveforms
PROMPT_MEL_TOLERANCE = 2e-3  # golden README §4.3: mel24k, max
EMBEDDING_TOLERANCE = 1e-3  # test_convert_parity: campplus on the official fbank
FAMILIES = ("v1", "v2", "v3")
OFFICIAL_PROMPT_RATE = 24000  # official _extract_speech_feat, every family
RELEASE_DIRS = {"v1": "v1-tiny-release", "v2": "tiny-release", "v3": "v3-tiny-release"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Per family: (tts, golden, source wav, target voice)."""
    out, folder = {}, tmp_path_factory.mktemp("vc-official")
    for family in FAMILIES:
        tts = load_family(tmp_path_factory, family)
        golden = load_official_golden(DATA / "vc" / f"{family}.npz")
        source = cut_wav(golden["meta"]["source"], folder / f"source-{family}.wav")
        target = cut_wav(golden["meta"]["target"], folder / f"target-{family}.wav")
        voice = tts.vc_voice_from_wav(target)
        if family == "v1":  # the official quirk (module docstring): the mel of the 24 kHz samples
            mel = flow_prompt_mel(load_audio(target, OFFICIAL_PROMPT_RATE), tts.voice_builder.mel_config)
            voice = dataclasses.replace(voice, prompt_mel=mel[0])  # [T, 80]
        out[family] = (tts, golden, source, voice)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_same_standin_frontend_models_as_the_official_run(setup, tmp_path_factory, family):
    """Both sides ran the same stand-in campplus / speech tokenizer (else token equality means nothing)."""
    import hashlib

    release = tmp_path_factory.getbasetemp() / RELEASE_DIRS[family]
    for name, digest in setup[family][1]["meta"]["standins_sha256"].items():
        assert hashlib.sha256((release / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.parametrize("family", FAMILIES)
def test_frontend_vc(setup, family):
    tts, golden, source, target = setup[family]
    request = tts._conversion(source, target, 0, None, None)
    np.testing.assert_array_equal(request._tokens_of(0), golden["source_tokens"])
    np.testing.assert_array_equal(target.speech_tokens, golden["prompt_tokens"])
    stride = golden["meta"]["mel_stride"]
    assert target.prompt_mel.shape[0] == golden["meta"]["prompt_feat_frames"]
    error = float(np.abs(target.prompt_mel[::stride] - golden["prompt_feat"]).max())
    assert error <= PROMPT_MEL_TOLERANCE, f"prompt mel max |ours - official| = {error:.3g}"
    np.testing.assert_allclose(target.speaker_embedding, golden["embedding"], atol=EMBEDDING_TOLERANCE)


def _convert(tts, golden, source, target, run, monkeypatch):
    """``convert`` with the official run's draws: (wav [N], plans, flow mels [1, 80, F] per chunk)."""
    meta = golden["meta"][run]
    draws = OfficialDraws(golden["meta"]["draw_seed"], meta["draws"])
    flow = tts._stages.synthesizer.flow if tts.family == "v1" else tts._stages.flow
    token2mel, mels, plans = type(flow).token2mel, [], []

    def recording_token2mel(self, *args, **kwargs):
        out = token2mel(self, *args, **kwargs)
        mels.append(out.mel)
        return out

    monkeypatch.setattr(type(flow), "token2mel", recording_token2mel)
    config = SynthesisConfig(stream=meta["stream"], speed=meta["speed"])
    request = tts._conversion(source, target, 0, config, None)
    if tts.family == "v1":
        request.draws = draws
    elif tts.family == "v2":
        render = pipeline.render_chunk

        def injected(stages, voice, tokens, plan, cache, rng, ratio, flow_cache=None, **options):
            noise = draws.sine_noise(len(plans) - 1)
            return render(stages, voice, tokens, plan, cache, noise, ratio, flow_cache=flow_cache, **options)

        monkeypatch.setattr(pipeline, "render_chunk", injected)
    original = request._render

    def recording(tokens, plan, state):
        plans.append(plan)
        return original(tokens, plan, state)

    request._render = recording
    chunks = list(request.chunks())
    return np.concatenate([chunk.samples for chunk in chunks]), plans, mels


@pytest.mark.parametrize("run", ["nonstream", "stream", "speed0.5", "speed2"])
@pytest.mark.parametrize("family", FAMILIES)
def test_convert_matches_official_inference_vc(setup, family, run, monkeypatch):
    tts, golden, source, target = setup[family]
    meta, stride = golden["meta"][run], golden["meta"]["mel_stride"]
    wav, plans, mels = _convert(tts, golden, source, target, run, monkeypatch)
    calls = meta["calls"]
    if family == "v1":  # official v1 drops each chunk's hop: it is given the tokens from the offset on
        assert [plan.end - plan.offset for plan in plans] == [call["tokens"] for call in calls]
    else:
        assert [plan.end for plan in plans] == [call["tokens"] for call in calls]
        assert [plan.offset for plan in plans] == [call["token_offset"] for call in calls]
    assert [plan.final for plan in plans] == [call["finalize"] for call in calls]
    assert len(mels) == len(calls)
    assert [mel.shape[2] for mel in mels] == meta["flow_mel_frames"]
    for index, mel in enumerate(mels):
        official = golden.get(f"{run}_c{index}_flow_mel")
        if official is None:  # a speed run: its flow ran as the nonstream one's, stored there
            assert meta["speed"] != 1.0
            continue
        error = float(np.abs(mel[:, :, ::stride] - official).max())
        assert error <= MEL_TOLERANCE, f"{family} {run} chunk {index}: flow mel max diff {error:.3g}"
    assert wav.shape == (meta["samples"],)
    wav_stride, scale = meta["wav_stride"], golden["meta"]["wav_scale"]
    official = golden[f"{run}_wav"].astype(np.float32) * np.float32(scale)
    error = float(np.abs(wav[::wav_stride] - official).max())
    assert error <= WAV_TOLERANCE, f"{family} {run}: max |ours - official| = {error:.3g}"
