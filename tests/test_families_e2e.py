"""CosyVoice 1 and 3 end to end on ONNX Runtime: build -> verify -> say (slow).

One engines build per family per session, from the golden tiny checkpoint plus the test tokenizer
and stand-in frontend models (``test_families.family_release``): the same engines are verified
against the golden reference (``trt-cosy verify --backend onnxruntime``) and speak through
``trt-cosy say`` (preset speakers, instruct, zero-shot, streaming) and the API.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import soundfile
from _support import GOLDEN, INSTRUCT, REF_TEXT, family_engines, family_release, reference_wavs
from click.testing import CliRunner

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig
from trt_cosy.cli import main
from trt_cosy.models.v1.request import V1Request
from trt_cosy.pipeline import Request
from trt_cosy.streaming import HopSchedule

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wavs(tmp_path_factory) -> dict[str, Path]:
    return reference_wavs(tmp_path_factory.mktemp("e2e-wavs"))


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[str, Path]:
    return {family: family_engines(tmp_path_factory, family) for family in ("v1", "v3")}


@pytest.fixture(scope="module")
def loaded(engines) -> dict[str, CosyVoice]:
    return {
        family: CosyVoice.load(path, config=EngineConfig(threads=1, normalizer="none"))
        for family, path in engines.items()
    }


def _invoke(*args: object):
    return CliRunner().invoke(main, [str(arg) for arg in args])


def _read(path: Path) -> tuple[np.ndarray, int]:
    audio, rate = soundfile.read(path, dtype="float32")
    assert audio.ndim == 1 and audio.size > 0 and np.isfinite(audio).all(), path
    assert float(np.abs(audio).max()) > 1e-3, f"silent output {path}"
    return audio, rate


@pytest.mark.parametrize("family", ["v1", "v3"])
def test_verify_onnxruntime_on_the_golden_set(engines, tmp_path_factory, family):
    release = family_release(tmp_path_factory, family)
    result = _invoke(
        "verify", "--model-dir", release, "--golden", GOLDEN[family] / "reference.npz",
        "--backend", "onnxruntime", "--engines", engines[family], "--threads", "1",
    )  # fmt: skip
    summary = re.search(r"summary: (\d+) ok, (\d+) failed, (\d+) skipped", result.output)
    assert result.exit_code == 0 and summary is not None, result.output
    ok, failed, skipped = (int(value) for value in summary.groups())
    assert failed == 0 and ok >= 40 and skipped == 1, result.output  # skipped: llm_sampled_tokens


def test_engines_carry_the_family_data(engines):
    v1, v3 = engines["v1"], engines["v3"]
    assert {"speakers.npz", "speech_tokenizer_v1.onnx", "tokenizer/multilingual.tiktoken"} <= {
        p.relative_to(v1).as_posix() for p in v1.rglob("*")
    }
    assert not (v1 / "flow_noise.npy").exists() and not (v1 / "hift_noise.npy").exists()
    noise = np.load(v3 / "hift_noise.npy", mmap_mode="r")
    assert noise.shape == (1, 60 * 24000, 9), noise.shape  # 60 s: the longest synthesis the limits allow
    assert (v3 / "speech_tokenizer_v3.onnx").is_file() and (v3 / "tokenizer" / "vocab.json").is_file()


# ----------------------------------------------------------------------------- CosyVoice 1


def test_v1_say_with_preset_speakers_and_instruct(engines, tmp_path):
    listed = _invoke("voices", "list", "--engines", engines["v1"], "--threads", "1")
    assert listed.exit_code == 0 and listed.output.split() == ["中文女", "英文男"], listed.output
    sft, instruct = tmp_path / "sft.wav", tmp_path / "instruct.wav"
    common = ("--engines", engines["v1"], "--threads", "1", "--seed", "3")
    result = _invoke("say", "Good morning.", "--speaker", "英文男", "-o", sft, *common)
    assert result.exit_code == 0, result.output
    result = _invoke(
        "say", "Good morning.", "--speaker", "英文男", "--instruct", INSTRUCT, "-o", instruct, *common
    )
    assert result.exit_code == 0, result.output
    (sft_audio, rate), (instruct_audio, _) = _read(sft), _read(instruct)
    assert rate == 22050
    # same seed, other LLM input (instruction, no speaker row): other tokens, other audio
    assert sft_audio.shape != instruct_audio.shape or np.abs(sft_audio - instruct_audio).max() > 1e-3
    bad = _invoke("say", "Hi.", "--speaker", "nobody", "-o", tmp_path / "bad.wav", *common)
    assert bad.exit_code == 2 and "this model has: 中文女, 英文男" in bad.output
    assert not (tmp_path / "bad.wav").exists()


def test_v1_say_zero_shot_streaming(engines, wavs, tmp_path):
    out = tmp_path / "zero_shot.wav"
    result = _invoke(
        "say", "Good morning.", "--engines", engines["v1"], "--ref", wavs["ref"], "--ref-text", REF_TEXT,
        "--stream", "--seed", "1", "--threads", "1", "-o", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert _read(out)[1] == 22050


def test_v1_audio_length_follows_the_tokens_and_seeds_repeat(loaded):
    tts = loaded["v1"]
    chunks = list(tts.synthesize("Good morning.", "中文女", seed=5))
    assert len(chunks) == 1 and chunks[0].is_last
    tokens = int(chunks[0].timings["tokens"])
    frames = int(tokens / 50 * 22050 / 256)  # the official length regulator
    assert chunks[0].samples.shape == (frames * 256,), (chunks[0].samples.shape, tokens)
    again = list(tts.synthesize("Good morning.", "中文女", seed=5))[0].samples
    np.testing.assert_array_equal(chunks[0].samples, again)


def test_v1_streaming_follows_the_official_hops(loaded, monkeypatch):
    """237 tokens stream as 120 / 120 / 37-token flow calls (hop 100, overlap 20), 100 / 100 / 37 new."""
    tts = loaded["v1"]
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 4096, 237)]
    monkeypatch.setattr(V1Request, "_decode", lambda self, index: iter(tokens))
    stream = list(tts.synthesize("Hi.", "中文女", seed=0, config=SynthesisConfig(stream=True)))
    assert [chunk.timings["tokens"] for chunk in stream] == [100.0, 100.0, 37.0]
    whole = list(tts.synthesize("Hi.", "中文女", seed=0))
    assert len(whole) == 1 and whole[0].samples.shape == (int(237 / 50 * 22050 / 256) * 256,)
    streamed = np.concatenate([chunk.samples for chunk in stream])
    # hop 100 tokens = 172 frames emitted, minus the held-back HiFT tail, as the official schedule
    assert [chunk.samples.shape[0] for chunk in stream[:2]] == [38912, 44032]
    assert abs(streamed.shape[0] - whole[0].samples.shape[0]) < 2 * 256 and np.isfinite(streamed).all()


# ----------------------------------------------------------------------------- CosyVoice3


def test_v3_say_zero_shot_instruct_and_stream(engines, wavs, tmp_path):
    common = ("--engines", engines["v3"], "--ref", wavs["ref"], "--threads", "1", "--seed", "2")
    for name, extra in (
        ("zero_shot", ("--ref-text", REF_TEXT)),
        ("instruct", ("--instruct", INSTRUCT)),
        ("stream", ("--ref-text", REF_TEXT, "--stream")),
    ):
        out = tmp_path / f"{name}.wav"
        result = _invoke("say", "Good morning to you.", "-o", out, *common, *extra)
        assert result.exit_code == 0, (name, result.output)
        assert _read(out)[1] == 24000
    listed = _invoke("voices", "list", "--engines", engines["v3"])
    assert listed.exit_code == 0 and listed.stdout == ""
    bad = _invoke("say", "Hi.", "--engines", engines["v3"], "--speaker", "中文女", "-o", tmp_path / "bad.wav")
    assert bad.exit_code == 2 and "no preset speakers" in bad.output


def test_v3_streaming_renders_every_token_once(loaded, wavs, monkeypatch):
    """80 tokens: the official v2/v3 hops (25 + prompt padding, then 50), 960 samples per token."""
    tts = loaded["v3"]
    voice = tts.voice_from_wav(wavs["ref"], REF_TEXT)
    tokens = [int(t) for t in np.random.default_rng(1).integers(3000, 6000, 80)]  # no silent ids
    monkeypatch.setattr(Request, "_decode", lambda self, index: iter(tokens))  # V3Request filters this
    stream = list(tts.synthesize("Hi.", voice, seed=0, config=SynthesisConfig(stream=True)))
    plans = HopSchedule(voice.speech_tokens.shape[0], True, 25, 3).plan_all(80)
    assert len(stream) == len(plans) >= 2
    assert sum(chunk.samples.shape[0] for chunk in stream) == 80 * 2 * 480
    whole = list(tts.synthesize("Hi.", voice, seed=0))
    assert len(whole) == 1 and whole[0].samples.shape == (80 * 2 * 480,)
    assert np.isfinite(np.concatenate([chunk.samples for chunk in stream])).all()
