"""HiFT vocoder: torch reference module and numpy streaming stage vs the official golden outputs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs the [build] extra (torch)")

import torch
import torch.nn.functional as F
from torch import nn

from trt_cosy.builder.checkpoint import fold_weight_norm
from trt_cosy.builder.modules.hift import HiFTGenerator, HiFTGraph, load_hift
from trt_cosy.builder.modules.hift_source import ConvISTFT, ConvSTFT, periodic_hann, upsample_linear
from trt_cosy.builder.torch_runner import TorchRunner
from trt_cosy.errors import InputError
from trt_cosy.models.registry import read_release_config
from trt_cosy.runtime.graphs import HIFT
from trt_cosy.stages.vocoder import VocoderCache, VocoderStage, fade_in_out, sine_noise

# Golden README §3 tolerances (max abs).
TOL_F0 = 1e-2
TOL_SOURCE = 2e-3
TOL_WAV = 1e-3
TOL_MEL = 2e-4
CHUNKS = ["nonstream_c0", "stream_c0", "stream_c1", "stream_c2", "streampad_c0", "streampad_c1"]
SCENARIOS = ["nonstream", "stream", "streampad"]


@pytest.fixture(scope="module")
def hift(v2_tiny_dir) -> HiFTGenerator:
    config = read_release_config(v2_tiny_dir)
    return load_hift(v2_tiny_dir, config.hift)


def _noise(ref: dict[str, np.ndarray], key: str) -> np.ndarray:
    return ref[key].astype(np.float32)  # stored float16: exactly the values the official code used


def _run(hift: HiFTGenerator, mel: np.ndarray, noise: np.ndarray, cache: np.ndarray) -> dict[str, np.ndarray]:
    with torch.inference_mode():
        wav, source, f0 = hift(torch.from_numpy(mel), torch.from_numpy(noise), torch.from_numpy(cache))
    return {"wav": wav.numpy(), "source": source.numpy(), "f0": f0.numpy()}


def _max_err(actual: np.ndarray, expected: np.ndarray) -> float:
    assert actual.shape == expected.shape, f"shape {actual.shape} != golden {expected.shape}"
    return float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max())


def _check(outputs: dict[str, np.ndarray], ref: dict[str, np.ndarray], prefix: str) -> None:
    for name, tol in (("f0", TOL_F0), ("source", TOL_SOURCE), ("wav", TOL_WAV)):
        err = _max_err(outputs[name], ref[f"{prefix}_{name}"])
        assert err <= tol, f"{prefix}_{name}: max abs error {err:.3g} > {tol:g}"


def test_hift_synth(hift, v2_reference):
    ref = v2_reference
    outputs = _run(
        hift, ref["in_hift_synth_mel"], _noise(ref, "hift_synth_sine_noise"), np.zeros((1, 1, 0), np.float32)
    )
    _check(outputs, ref, "hift_synth")


@pytest.mark.parametrize("chunk", CHUNKS)
def test_hift_chunk(hift, v2_reference, chunk):
    ref = v2_reference
    prefix = f"{chunk}_hift"
    outputs = _run(
        hift, ref[f"{prefix}_mel"], _noise(ref, f"{prefix}_sine_noise"), ref[f"{prefix}_cache_source"]
    )
    _check(outputs, ref, prefix)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_vocoder_stage_streaming(hift, v2_reference, v2_tiny_dir, scenario):
    """Golden hift_mel chunks through VocoderStage's cache logic reproduce the official audio."""
    ref = v2_reference
    config = read_release_config(v2_tiny_dir).hift
    stage = VocoderStage(TorchRunner(HIFT, HiFTGraph(hift)), config)
    n_chunks = json.loads(str(ref["meta_json"]))[scenario]["n_chunks"]
    cache = VocoderCache()
    pieces = []
    for index in range(n_chunks):
        prefix = f"{scenario}_c{index}"
        golden_mel = ref[f"{prefix}_hift_mel"]  # golden_mel: [1, 80, F] (cached frames included)
        if not cache.empty:
            mel_err = _max_err(cache.mel, golden_mel[:, :, : cache.mel.shape[2]])
            assert mel_err <= TOL_MEL, f"{prefix} cached mel: max abs error {mel_err:.3g}"
            src_err = _max_err(cache.source, ref[f"{prefix}_hift_cache_source"])
            assert src_err <= TOL_SOURCE, f"{prefix}_hift_cache_source: max abs error {src_err:.3g}"
            golden_mel = golden_mel[:, :, cache.mel.shape[2] :]
        final = index == n_chunks - 1
        out = stage.render(golden_mel, _noise(ref, f"{prefix}_hift_sine_noise"), cache, final=final)
        err = _max_err(out, ref[f"{prefix}_out_speech"])
        assert err <= TOL_WAV, f"{prefix}_out_speech: max abs error {err:.3g} > {TOL_WAV:g}"
        pieces.append(out)
    err = _max_err(np.concatenate(pieces, axis=1), ref[f"{scenario}_wav"])
    assert err <= TOL_WAV, f"{scenario}_wav: max abs error {err:.3g} > {TOL_WAV:g}"


def test_vocoder_stage_rng_and_errors(hift, v2_tiny_dir):
    config = read_release_config(v2_tiny_dir).hift
    stage = VocoderStage(TorchRunner(HIFT, HiFTGraph(hift)), config)
    mel = np.full((1, 80, 20), -5.0, dtype=np.float32)
    cache = VocoderCache()
    first = stage.render(mel, np.random.default_rng(0), cache, final=False)
    assert first.shape == (1, 20 * 480 - 3840) and first.dtype == np.float32
    assert (
        cache.mel.shape == (1, 80, 8)
        and cache.source.shape == (1, 1, 3840)
        and cache.speech.shape == (1, 3840)
    )
    last = stage.render(mel, np.random.default_rng(1), cache, final=True)
    assert last.shape == (1, 28 * 480)
    with pytest.raises(InputError):
        stage.render(mel, np.random.default_rng(0), None, final=False)
    with pytest.raises(InputError):
        stage.render(mel, np.zeros((1, 480, 9), np.float32))
    noise = sine_noise(np.random.default_rng(3), 960, config.nb_harmonics)
    assert noise.shape == (1, 960, 9) and noise.dtype == np.float32
    np.testing.assert_array_equal(noise, sine_noise(np.random.default_rng(3), 960, config.nb_harmonics))


def test_fade_in_out_float64_window():
    rng = np.random.default_rng(0)
    new, old = rng.standard_normal((2, 1, 20)).astype(np.float32)
    window = np.hamming(8)
    faded = fade_in_out(new, old, window)
    expected = (new[:, :4].astype(np.float64) * window[:4] + old[:, -4:] * window[4:]).astype(np.float32)
    np.testing.assert_array_equal(faded[:, :4], expected)
    np.testing.assert_array_equal(faded[:, 4:], new[:, 4:])


@pytest.mark.parametrize("conv_cls", [nn.Conv1d, nn.ConvTranspose1d])
def test_fold_weight_norm_equivalence(conv_cls):
    torch.manual_seed(0)
    normed = torch.nn.utils.parametrizations.weight_norm(conv_cls(6, 5, 3, padding=1))
    with torch.no_grad():
        normed.parametrizations.weight.original0.mul_(
            torch.rand_like(normed.parametrizations.weight.original0) + 0.5
        )
    state = {f"conv.{k}": v for k, v in normed.state_dict().items()}
    assert "conv.parametrizations.weight.original0" in state
    plain = conv_cls(6, 5, 3, padding=1)
    folded = fold_weight_norm(state)
    assert sorted(folded) == ["conv.bias", "conv.weight"]
    plain.load_state_dict({k.removeprefix("conv."): v for k, v in folded.items()})
    x = torch.randn(2, 6, 17)
    with torch.no_grad():
        err = (plain(x) - normed(x)).abs().max().item()
    assert err <= 1e-6, f"folded conv differs from the weight-normed one by {err:.3g}"


def test_upsample_linear_matches_interpolate():
    torch.manual_seed(0)
    x = torch.cumsum(torch.rand(1, 9, 40), dim=-1) * 2 * math.pi * 480  # phase-like, growing values
    expected = F.interpolate(x, scale_factor=480, mode="linear")
    actual = upsample_linear(x, 480)
    # torch fuses a multiply-add (FMA) that plain float32 ops cannot: allow a few ulps of |x|.
    err = (actual - expected).abs().max().item()
    assert err <= 8 * torch.finfo(torch.float32).eps * x.abs().max().item(), f"max abs error {err:.3g}"


def test_frame_phase_equals_official_sample_rate_path(hift):
    """rad at sample rate + random phase at sample 0 + 1/480 linear down-sampling == frame-rate rad."""
    torch.manual_seed(0)
    source = hift.m_source
    f0 = torch.rand(1, 30) * 400  # f0: [1, F]
    f0_up = f0.repeat_interleave(480, dim=1).unsqueeze(-1)  # f0_up: [1, 480F, 1]
    rad = (f0_up * source.harmonic_numbers / source.sampling_rate) % 1  # rad: [1, 480F, 9]
    rad[:, 0, 1:] += torch.rand(8)  # the official random initial phase (fundamental excluded)
    down = F.interpolate(rad.transpose(1, 2), scale_factor=1 / 480, mode="linear").transpose(1, 2)
    official = torch.cumsum(down, dim=1) * 2 * math.pi  # official: [1, F, 9]
    assert torch.equal(source.frame_phase(f0), official)


def test_conv_stft_istft_match_torch():
    torch.manual_seed(0)
    n_fft, hop = 16, 4
    window = torch.from_numpy(periodic_hann(n_fft).astype(np.float32))
    signal = torch.randn(1, 1, 480 * 5)
    spec = torch.view_as_real(torch.stft(signal[:, 0], n_fft, hop, n_fft, window=window, return_complex=True))
    expected = torch.cat([spec[..., 0], spec[..., 1]], dim=1)  # expected: [1, 18, 601]
    actual = ConvSTFT(n_fft, hop)(signal)
    assert (actual - expected).abs().max().item() <= 1e-5
    real, imag = torch.randn(2, 1, 9, 601)
    expected_wav = torch.istft(torch.complex(real, imag), n_fft, hop, n_fft, window=window)
    actual_wav = ConvISTFT(n_fft, hop)(real, imag)
    assert actual_wav.shape == expected_wav.shape
    assert (actual_wav - expected_wav).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_onnx_export_two_lengths(hift, v2_reference, tmp_path):
    """torch.onnx.export(dynamo=True) with dynamic F and S; ORT matches torch and the golden."""
    ort = pytest.importorskip("onnxruntime")
    frames = torch.export.Dim("F", min=1, max=6000)
    cached = torch.export.Dim("S", min=0, max=6000 * 480)
    example = (torch.randn(1, 80, 20), torch.randn(1, 9600, 9), torch.randn(1, 1, 3840))
    program = torch.onnx.export(
        HiFTGraph(hift).eval(),
        example,
        dynamo=True,
        input_names=list(HIFT.input_names),
        output_names=list(HIFT.output_names),
        dynamic_shapes={"mel": {2: frames}, "sine_noise": {1: 480 * frames}, "cache_source": {2: cached}},
    )
    path = tmp_path / "hift.onnx"
    program.save(str(path))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    ref = v2_reference
    for prefix in ("nonstream_c0_hift", "stream_c1_hift"):  # F 50 without cache, F 108 with S 3840
        feed = {
            "mel": ref[f"{prefix}_mel"],
            "sine_noise": _noise(ref, f"{prefix}_sine_noise"),
            "cache_source": ref[f"{prefix}_cache_source"],
        }
        outputs = dict(zip(HIFT.output_names, session.run(None, feed), strict=True))
        torch_outputs = _run(hift, feed["mel"], feed["sine_noise"], feed["cache_source"])
        for name, tol in (("f0", TOL_F0), ("source", TOL_SOURCE), ("wav", TOL_WAV)):
            err = _max_err(outputs[name], torch_outputs[name])
            assert err <= tol, f"{prefix}_{name}: ORT vs torch max abs error {err:.3g}"
        _check(outputs, ref, prefix)
