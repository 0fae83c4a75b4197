"""VoiceBuilder with the stand-in campplus / speech tokenizer, and the Voice file format."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import soundfile

from trt_cosy.builder.testmodel.standin_onnx import write_standin_campplus, write_standin_speech_tokenizer
from trt_cosy.config import MelConfig
from trt_cosy.errors import InputError
from trt_cosy.frontend.features import speaker_features
from trt_cosy.frontend.voice import VOICE_FORMAT_VERSION, Voice, VoiceBuilder
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner

FEATURES = Path(__file__).parent / "data" / "features"
NAMES = ["en_16k_mono", "en_44k1_stereo", "zh_16k_mono", "zh_22k05_stereo"]
# (max, 99th percentile) absolute error bounds from golden README §4.3.
TOLERANCE = {"campplus_input": (2e-2, 2e-3), "whisper_logmel": (2e-3, 2e-4), "mel24k": (2e-3, 2e-4)}


class Recorder:
    """A Runner that records every feed and forwards it (or answers with ``answer``)."""

    def __init__(self, inner=None, answer=None, names=(("input",), ("output",))):
        self.inner, self.answer, self.feeds = inner, answer, []
        self.name = inner.name if inner else "fake"
        self._names = (inner.input_names, inner.output_names) if inner else names

    @property
    def input_names(self):
        return self._names[0]

    @property
    def output_names(self):
        return self._names[1]

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.feeds.append({key: np.array(value) for key, value in feed.items()})
        return self.inner.infer(feed) if self.inner else {self.output_names[0]: self.answer}


@pytest.fixture(scope="module")
def standins(tmp_path_factory) -> tuple[OrtRunner, OrtRunner]:
    folder = tmp_path_factory.mktemp("standins")
    rng = np.random.default_rng(0)
    write_standin_campplus(folder / "campplus.onnx", rng)
    write_standin_speech_tokenizer(folder / "speech_tokenizer_v2.onnx", rng)
    return (
        OrtRunner.from_path(folder / "campplus.onnx", "campplus", threads=1),
        OrtRunner.from_path(folder / "speech_tokenizer_v2.onnx", "speech_tokenizer", threads=1),
    )


@pytest.fixture(scope="module")
def builder(standins) -> VoiceBuilder:
    return VoiceBuilder(*standins, MelConfig(), token_mel_ratio=2, model_id="test-model")


def _golden(name: str) -> dict[str, np.ndarray]:
    with np.load(FEATURES / f"{name}.npz") as data:
        return {key: data[key] for key in data.files if key != "meta_json"}


def assert_close(key: str, name: str, actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape, f"{name}/{key}: shape {actual.shape} != golden {expected.shape}"
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    max_error, p99_error = float(diff.max()), float(np.percentile(diff, 99))
    max_bound, p99_bound = TOLERANCE[key]
    assert max_error <= max_bound and p99_error <= p99_bound, (
        f"{name}/{key}: max error {max_error:.3g} (bound {max_bound:g}), p99 {p99_error:.3g} (bound {p99_bound:g})"
    )


@pytest.mark.parametrize("name", NAMES)
def test_builder_feeds_official_features(standins, name):
    campplus, tokenizer = Recorder(standins[0]), Recorder(standins[1])
    voice = VoiceBuilder(campplus, tokenizer, MelConfig()).from_wav(FEATURES / "audio" / f"{name}.wav")
    golden = _golden(name)
    (speaker_feed,) = campplus.feeds
    fed = speaker_feed["input"]  # fed: [1, T, 80]
    assert fed.dtype == np.float32
    assert_close("campplus_input", name, fed, (golden["fbank_raw"] - golden["fbank_mean"])[None])
    if "16k" in name:  # no resampling: the wav equals the golden wav16k, so the feed must be identical
        np.testing.assert_array_equal(fed, speaker_features(golden["wav16k"]))
    (token_feed,) = tokenizer.feeds
    assert_close("whisper_logmel", name, token_feed["feats"], golden["whisper_logmel"])
    np.testing.assert_array_equal(token_feed["feats_length"], golden["whisper_logmel_len"])
    assert token_feed["feats_length"].dtype == np.int32
    # Shapes: the stand-in tokenizer gives T // 4 tokens; alignment keeps min(frames // 2, n).
    n_tokens = min(golden["mel24k"].shape[1] // 2, golden["whisper_logmel"].shape[2] // 4)
    assert voice.speech_tokens.shape == (n_tokens,) and voice.speech_tokens.dtype == np.int32
    assert voice.prompt_mel.shape == (2 * n_tokens, 80) and voice.prompt_mel.dtype == np.float32
    assert voice.speaker_embedding.shape == (192,) and voice.speaker_embedding.dtype == np.float32
    assert 0 <= voice.speech_tokens.min() and voice.speech_tokens.max() < 6561
    assert_close("mel24k", name, voice.prompt_mel, golden["mel24k"][0, : 2 * n_tokens])
    assert voice.sample_rate == 24000 and voice.prompt_text_ids.shape == (0,)


@pytest.mark.parametrize("name", ["en_16k_mono", "zh_16k_mono"])
def test_alignment_matches_official(name):
    """The official frontend's trimming for n = T/4, T/2 + 3 and T/2 - 5 tokens (golden align_* keys)."""
    golden = _golden(name)
    campplus = Recorder(answer=np.zeros((1, 192), np.float32))
    cases = zip(golden["align_n_tokens_in"], golden["align_token_len"], golden["align_feat_len"], strict=True)
    for n_in, token_len, feat_len in cases:
        answer = np.arange(n_in, dtype=np.int64)[None]  # answer: [1, n]
        tokenizer = Recorder(answer=answer, names=(("feats", "feats_length"), ("indices",)))
        voice = VoiceBuilder(campplus, tokenizer, MelConfig()).from_wav(FEATURES / "audio" / f"{name}.wav")
        np.testing.assert_array_equal(voice.speech_tokens, np.arange(token_len))
        assert voice.prompt_mel.shape == (feat_len, 80), f"n={n_in}: {voice.prompt_mel.shape}"
        assert_close("mel24k", name, voice.prompt_mel, golden["mel24k"][0, :feat_len])


def test_same_file_same_voice(builder):
    path = FEATURES / "audio" / "zh_22k05_stereo.wav"
    first, second = builder.from_wav(path, [5, 6, 7], "你好"), builder.from_wav(path, [5, 6, 7], "你好")
    assert first == second
    assert first.model_id == "test-model" and first.prompt_text_ids.dtype == np.int32
    with pytest.raises(ValueError, match="read-only"):
        first.speech_tokens[0] = 1


def test_save_load_round_trip(builder, tmp_path):
    voice = builder.from_wav(FEATURES / "audio" / "en_16k_mono.wav", np.array([1, 2, 3]), "The quick fox.")
    path = voice.save(tmp_path / "fox.voice.npz")
    assert [entry.name for entry in tmp_path.iterdir()] == ["fox.voice.npz"], "temp file left behind"
    loaded = Voice.load(path)
    assert loaded == voice
    for key in ("prompt_text_ids", "speech_tokens", "prompt_mel", "speaker_embedding"):
        original, reread = getattr(voice, key), getattr(loaded, key)
        assert original.dtype == reread.dtype and original.tobytes() == reread.tobytes(), key
    assert (loaded.prompt_text, loaded.sample_rate, loaded.model_id) == (
        "The quick fox.",
        24000,
        "test-model",
    )
    voice.save(path)  # overwriting an existing voice works too
    assert Voice.load(path) == voice


def _voice_npz(path: Path, header: object) -> Path:
    arrays = {"prompt_text_ids": np.zeros(0, np.int32), "speech_tokens": np.zeros(2, np.int32)}
    arrays |= {"prompt_mel": np.zeros((4, 80), np.float32), "speaker_embedding": np.zeros(192, np.float32)}
    with path.open("wb") as stream:
        np.savez(stream, header=np.array(json.dumps(header)), **arrays)
    return path


def test_load_rejects_other_files(tmp_path):
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"\x00\x01 definitely not a zip" * 10)
    npy = tmp_path / "array.npy"
    np.save(npy, np.zeros(3))
    no_header = tmp_path / "plain.npz"
    np.savez(no_header, x=np.zeros(3))
    wrong_tag = _voice_npz(tmp_path / "tag.npz", {"format": "something-else", "version": 1})
    for path in (garbage, npy, no_header, wrong_tag):
        with pytest.raises(
            InputError, match="is not a trt-cosy voice file; make one with `trt-cosy voices save`"
        ):
            Voice.load(path)
    newer = _voice_npz(
        tmp_path / "newer.npz", {"format": "trt-cosy-voice", "version": VOICE_FORMAT_VERSION + 1}
    )
    with pytest.raises(InputError, match="Upgrade trt-cosy"):
        Voice.load(newer)
    with pytest.raises(InputError, match="does not exist"):
        Voice.load(tmp_path / "absent.npz")


@pytest.mark.parametrize(
    ("seconds", "amplitude", "message"),
    [(0.5, 0.3, "at least 1 s"), (31.0, 0.3, "at most 30 s"), (3.0, 0.0, "is silent")],
)
def test_rejects_bad_references(builder, tmp_path, seconds, amplitude, message):
    samples = int(seconds * 16000)
    wav = amplitude * np.sin(2 * np.pi * 220 * np.arange(samples) / 16000)  # wav: [N]
    path = tmp_path / "reference.wav"
    soundfile.write(path, wav.astype(np.float32), 16000, subtype="PCM_16")
    with pytest.raises(InputError, match=message):
        builder.from_wav(path)


def test_rejects_unreadable_audio(builder, tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("not audio")
    with pytest.raises(InputError, match="could not read"):
        builder.from_wav(path)
