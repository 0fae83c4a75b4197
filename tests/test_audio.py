"""Audio loading, resampling and frontend features against the official goldens (golden README §4)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile

from trt_cosy.audio import load_audio, resample
from trt_cosy.config import MelConfig
from trt_cosy.errors import InputError
from trt_cosy.frontend.features import (
    align_prompt,
    flow_prompt_mel,
    kaldi_fbank,
    slaney_mel_filterbank,
    speaker_features,
    whisper_log_mel,
)

FEATURES = Path(__file__).parent / "data" / "features"
NAMES = ["en_16k_mono", "en_44k1_stereo", "zh_16k_mono", "zh_22k05_stereo"]

# (max, 99th percentile) absolute error bounds from golden README §4.3.
TOLERANCE = {
    "wav16k": (1e-5, 1e-5),
    "wav24k": (1e-5, 1e-5),
    "mel24k": (2e-3, 2e-4),
    "whisper_logmel": (2e-3, 2e-4),
    "fbank_raw": (2e-2, 2e-3),
    "fbank_mean": (2e-2, 2e-3),
    "campplus_input": (2e-2, 2e-3),
}


@pytest.fixture(scope="module", params=NAMES)
def golden(request) -> dict[str, np.ndarray]:
    with np.load(FEATURES / f"{request.param}.npz") as data:
        arrays = {key: data[key] for key in data.files if key != "meta_json"}
    arrays["name"] = request.param
    return arrays


def assert_close(key: str, name: str, actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape, f"{name}/{key}: shape {actual.shape} != golden {expected.shape}"
    assert actual.dtype == np.float32, f"{name}/{key}: dtype {actual.dtype}, want float32"
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    max_error, p99_error = float(diff.max()), float(np.percentile(diff, 99))
    max_bound, p99_bound = TOLERANCE[key]
    assert max_error <= max_bound and p99_error <= p99_bound, (
        f"{name}/{key}: max error {max_error:.3g} (bound {max_bound:g}), p99 {p99_error:.3g} (bound {p99_bound:g})"
    )


@pytest.mark.parametrize(("key", "rate"), [("wav16k", 16000), ("wav24k", 24000)])
def test_load_audio_matches_official_load_wav(golden, key, rate):
    wav = load_audio(FEATURES / "audio" / f"{golden['name']}.wav", rate)  # wav: [N]
    assert_close(key, golden["name"], wav[None], golden[key])


def test_flow_prompt_mel(golden):
    mel = flow_prompt_mel(golden["wav24k"], MelConfig())  # mel: [1, T, 80]
    assert_close("mel24k", golden["name"], mel, golden["mel24k"])
    assert mel.shape[1] == int(golden["mel24k_len"][0])


def test_whisper_log_mel(golden):
    log_mel = whisper_log_mel(golden["wav16k"], n_mels=128)  # log_mel: [1, 128, T]
    assert_close("whisper_logmel", golden["name"], log_mel, golden["whisper_logmel"])
    assert log_mel.shape[2] == int(golden["whisper_logmel_len"][0])


def test_kaldi_fbank_and_speaker_features(golden):
    name = golden["name"]
    fbank = kaldi_fbank(golden["wav16k"])  # fbank: [T, 80]
    assert_close("fbank_raw", name, fbank, golden["fbank_raw"])
    assert_close("fbank_mean", name, fbank.mean(axis=0, keepdims=True), golden["fbank_mean"])
    expected = (golden["fbank_raw"] - golden["fbank_mean"])[None]  # expected: [1, T, 80]
    assert_close("campplus_input", name, speaker_features(golden["wav16k"]), expected)


def test_align_prompt(golden):
    feat = golden["mel24k"]  # feat: [1, T, 80]
    rows = zip(golden["align_n_tokens_in"], golden["align_token_len"], golden["align_feat_len"], strict=True)
    for n_tokens, token_len, feat_len in rows:
        tokens = np.arange(n_tokens, dtype=np.int32)[None]  # tokens: [1, n]
        kept_tokens, kept_feat = align_prompt(tokens, feat, token_mel_ratio=2)
        assert kept_tokens.shape == (1, token_len), (
            f"n={n_tokens}: {kept_tokens.shape[1]} tokens, want {token_len}"
        )
        assert kept_feat.shape == (1, feat_len, 80), (
            f"n={n_tokens}: {kept_feat.shape[1]} frames, want {feat_len}"
        )
        np.testing.assert_array_equal(kept_tokens[0], np.arange(token_len))
        np.testing.assert_array_equal(kept_feat, feat[:, :feat_len])


def test_filterbanks_equal_official_constants():
    with np.load(FEATURES / "constants.npz") as constants:
        matcha = constants["matcha_mel_basis_24k_fmax8000"]
        whisper = constants["whisper_mel_filters_128"]
    ours = slaney_mel_filterbank(24000, 1920, 80, 0.0, 8000.0)
    assert np.abs(ours - matcha).max() <= 1e-7, f"matcha basis max error {np.abs(ours - matcha).max():.3g}"
    ours = slaney_mel_filterbank(16000, 400, 128)
    assert np.abs(ours - whisper).max() <= 1e-7, (
        f"whisper filters max error {np.abs(ours - whisper).max():.3g}"
    )
    # The cache key holds every parameter: a different fmin with the same fmax is a different basis.
    assert not np.array_equal(slaney_mel_filterbank(24000, 1920, 80, 50.0, 8000.0), matcha)


def test_resample_keeps_batch_axes_and_length():
    wav = np.random.default_rng(0).uniform(-0.5, 0.5, size=(2, 3, 1001)).astype(np.float32)
    out = resample(wav, 22050, 16000)  # out: [2, 3, ceil(1001 * 320 / 441)]
    assert out.shape == (2, 3, 727) and out.dtype == np.float32
    np.testing.assert_allclose(out[1, 2], resample(wav[1, 2], 22050, 16000), atol=0)


def test_non_audio_file_is_rejected(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("this is not a wav file\n")
    with pytest.raises(InputError, match="could not read"):
        load_audio(path, 16000)


def test_empty_files_are_rejected(tmp_path):
    zero_bytes = tmp_path / "zero.wav"
    zero_bytes.write_bytes(b"")
    with pytest.raises(InputError, match="could not read"):
        load_audio(zero_bytes, 16000)
    no_samples = tmp_path / "silent.wav"
    soundfile.write(no_samples, np.zeros(0, dtype=np.float32), 16000)
    with pytest.raises(InputError, match="no samples"):
        load_audio(no_samples, 16000)


def test_low_sample_rate_is_rejected(tmp_path):
    path = tmp_path / "phone.wav"
    soundfile.write(path, np.zeros(8000, dtype=np.float32), 8000)
    with pytest.raises(InputError, match="8000 Hz"):
        load_audio(path, 16000)


def test_missing_file_is_rejected(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_audio(tmp_path / "absent.wav", 16000)


def test_too_short_audio_is_rejected():
    with pytest.raises(InputError, match="at least"):
        flow_prompt_mel(np.zeros(100, dtype=np.float32), MelConfig())
