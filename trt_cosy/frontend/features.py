"""Frontend features from a prompt waveform, torch-free (docs/cosyvoice-spec §2.5–2.8).

- ``speaker_features``: Kaldi fbank minus its time mean, the campplus input (§2.5).
- ``whisper_log_mel``: openai-whisper's ``log_mel_spectrogram``, the speech-tokenizer input (§2.6).
- ``flow_prompt_mel``: Matcha's ``mel_spectrogram``, the flow's prompt mel (§2.7).
- ``align_prompt``: the CosyVoice2 prompt token/mel length alignment (§2.8).

The STFTs and mel products run in float64 (numpy ``rfft``) and return float32. The official float32 torch
results differ from an exact computation by float32 rounding only, and float64 keeps our side of that
difference negligible (golden README §4.3). Filterbanks and windows are built once per parameter set and
cached (all parameters in the key); the cached arrays are read-only.
"""

from __future__ import annotations

import functools
import logging
from typing import Final

import numpy as np

from ..config import MelConfig
from ..errors import InputError, require

__all__ = [
    "slaney_mel_filterbank",
    "periodic_hann_window",
    "kaldi_fbank",
    "speaker_features",
    "whisper_log_mel",
    "flow_prompt_mel",
    "align_prompt",
]

_LOGGER = logging.getLogger(__name__)

SPEAKER_SAMPLE_RATE: Final = 16000  # campplus and the speech tokenizer take 16 kHz audio
_KALDI_NUM_MEL_BINS: Final = 80
_WHISPER_N_FFT: Final = 400
_WHISPER_HOP: Final = 160
_WHISPER_LOG_FLOOR: Final = 1e-10
_WHISPER_DYNAMIC_RANGE: Final = 8.0  # log10 units kept below the global maximum
_MATCHA_MAGNITUDE_EPS: Final = 1e-9  # added under the square root of |X|^2
_MATCHA_LOG_FLOOR: Final = 1e-5


# --- filterbanks and windows -----------------------------------------------------------------------------


def _hz_to_slaney_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa ``htk=False``): linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear_step = 200.0 / 3  # Hz per mel below 1 kHz
    log_start_mel = 1000.0 / linear_step
    log_step = np.log(6.4) / 27.0
    mel = hz / linear_step
    above = hz >= 1000.0
    return np.where(above, log_start_mel + np.log(np.maximum(hz, 1e-12) / 1000.0) / log_step, mel)


def _slaney_mel_to_hz(mel: np.ndarray) -> np.ndarray:
    linear_step = 200.0 / 3
    log_start_mel = 1000.0 / linear_step
    log_step = np.log(6.4) / 27.0
    return np.where(
        mel >= log_start_mel, 1000.0 * np.exp(log_step * (mel - log_start_mel)), mel * linear_step
    )


@functools.lru_cache(maxsize=8)
def slaney_mel_filterbank(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> np.ndarray:
    """``librosa.filters.mel(sr, n_fft, n_mels, fmin, fmax)`` (slaney scale, slaney area norm, float32).

    Returns:
        Read-only float32 [n_mels, n_fft // 2 + 1]; ``fmax=None`` means ``sample_rate / 2``.
    """
    fmax = sample_rate / 2.0 if fmax is None else float(fmax)
    fft_freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)  # fft_freqs: [F]
    mel_edges = np.linspace(_hz_to_slaney_mel(fmin), _hz_to_slaney_mel(fmax), n_mels + 2)
    edge_hz = _slaney_mel_to_hz(mel_edges)  # edge_hz: [n_mels + 2]
    edge_gaps = np.diff(edge_hz)  # edge_gaps: [n_mels + 1]
    ramps = edge_hz[:, None] - fft_freqs[None, :]  # ramps: [n_mels + 2, F]
    rising = -ramps[:-2] / edge_gaps[:-1, None]  # rising: [n_mels, F]
    falling = ramps[2:] / edge_gaps[1:, None]  # falling: [n_mels, F]
    # librosa stores the triangles in float32 before the (float64) area normalisation.
    triangles = np.maximum(0.0, np.minimum(rising, falling)).astype(np.float32)  # triangles: [n_mels, F]
    area_norm = 2.0 / (edge_hz[2:] - edge_hz[:-2])  # area_norm: [n_mels]
    basis = (triangles * area_norm[:, None]).astype(np.float32)  # basis: [n_mels, F]
    basis.setflags(write=False)
    return basis


@functools.lru_cache(maxsize=8)
def periodic_hann_window(win_length: int, n_fft: int) -> np.ndarray:
    """``torch.hann_window(win_length)`` (periodic) zero-padded to ``n_fft`` in the centre, as torch.stft does.

    Returns:
        Read-only float64 [n_fft].
    """
    if win_length > n_fft:
        raise ValueError(f"window length {win_length} exceeds n_fft {n_fft}")
    hann = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(win_length) / win_length)  # hann: [win_length]
    left = (n_fft - win_length) // 2
    window = np.zeros(n_fft, dtype=np.float64)
    window[left : left + win_length] = hann
    window.setflags(write=False)
    return window


def _stft(signal: np.ndarray, n_fft: int, hop: int, window: np.ndarray) -> np.ndarray:
    """One-sided STFT without padding (torch.stft ``center=False``): complex128 [frames, n_fft // 2 + 1]."""
    frames = np.lib.stride_tricks.sliding_window_view(signal, n_fft)[::hop]  # frames: [T, n_fft]
    return np.fft.rfft(frames * window, axis=-1)  # spectrum: [T, n_fft // 2 + 1]


def _as_mono(wav: np.ndarray, what: str, min_samples: int) -> np.ndarray:
    """Accept [N] or [1, N] float audio; returns float64 [N]."""
    wav = np.asarray(wav)
    if wav.ndim == 2 and wav.shape[0] == 1:
        wav = wav[0]
    if wav.ndim != 1:
        raise InputError(
            f"{what} needs a mono waveform [N] or [1, N], got shape {wav.shape}. Downmix it first."
        )
    if wav.shape[0] < min_samples:
        raise InputError(
            f"{what} needs at least {min_samples} samples, got {wav.shape[0]}. Use a longer prompt recording."
        )
    return wav.astype(np.float64)


# --- campplus input: Kaldi fbank ---------------------------------------------------------------------------


def kaldi_fbank(wav16k: np.ndarray, num_mel_bins: int = _KALDI_NUM_MEL_BINS) -> np.ndarray:
    """``torchaudio.compliance.kaldi.fbank(wav, num_mel_bins, dither=0, sample_frequency=16000)``.

    Kaldi defaults otherwise (25 ms / 10 ms frames, snip_edges, DC removal, preemphasis 0.97, povey
    window, 512-point power spectrum, mel bins 20 Hz..Nyquist, log floored at float32 eps, no energy).
    Computed by kaldi-native-fbank, which matches torchaudio within the golden tolerance. The input is the
    float waveform in [-1, 1], not int16-scaled.

    Args:
        wav16k: 16 kHz mono waveform, [N] or [1, N].

    Returns:
        float32 [T, num_mel_bins], T = 1 + (N - 400) // 160.
    """
    knf = require("kaldi_native_fbank", "cpu")
    samples = _as_mono(wav16k, "kaldi_fbank", 400).astype(np.float32)  # samples: [N]
    options = knf.FbankOptions()
    options.frame_opts.dither = 0.0
    options.frame_opts.samp_freq = float(SPEAKER_SAMPLE_RATE)
    options.mel_opts.num_bins = num_mel_bins
    extractor = knf.OnlineFbank(options)
    extractor.accept_waveform(float(SPEAKER_SAMPLE_RATE), samples)
    extractor.input_finished()
    frames = [extractor.get_frame(i) for i in range(extractor.num_frames_ready)]
    return np.asarray(frames, dtype=np.float32).reshape(-1, num_mel_bins)  # fbank: [T, num_mel_bins]


def speaker_features(wav16k: np.ndarray) -> np.ndarray:
    """The campplus input: Kaldi fbank with its mean over time removed (float32).

    Args:
        wav16k: 16 kHz mono waveform, [N] or [1, N].

    Returns:
        float32 [1, T, 80].
    """
    fbank = kaldi_fbank(wav16k)  # fbank: [T, 80]
    return (fbank - fbank.mean(axis=0, keepdims=True))[None]  # features: [1, T, 80]


# --- speech-tokenizer input: whisper log-mel ----------------------------------------------------------------


def whisper_log_mel(wav16k: np.ndarray, n_mels: int = 128) -> np.ndarray:
    """openai-whisper ``log_mel_spectrogram(wav, n_mels)`` without the 30 s padding.

    Periodic Hann 400, hop 160, centred STFT with reflect padding, last frame dropped, power spectrum,
    slaney mel filters (16 kHz, n_fft 400), log10 floored at 1e-10, clipped to (global max - 8),
    then ``(x + 4) / 4``.

    Args:
        wav16k: 16 kHz mono waveform, [N] or [1, N] (N > 200).

    Returns:
        float32 [1, n_mels, N // 160].
    """
    samples = _as_mono(wav16k, "whisper_log_mel", _WHISPER_N_FFT // 2 + 1)  # samples: [N]
    padded = np.pad(samples, _WHISPER_N_FFT // 2, mode="reflect")  # padded: [N + 400]
    window = periodic_hann_window(_WHISPER_N_FFT, _WHISPER_N_FFT)
    spectrum = _stft(padded, _WHISPER_N_FFT, _WHISPER_HOP, window)[:-1]  # spectrum: [T, 201]
    power = spectrum.real**2 + spectrum.imag**2  # power: [T, 201]
    filters = slaney_mel_filterbank(SPEAKER_SAMPLE_RATE, _WHISPER_N_FFT, n_mels)  # filters: [n_mels, 201]
    mel = filters.astype(np.float64) @ power.T  # mel: [n_mels, T]
    log_mel = np.log10(np.maximum(mel, _WHISPER_LOG_FLOOR))
    log_mel = np.maximum(log_mel, log_mel.max() - _WHISPER_DYNAMIC_RANGE)
    return ((log_mel + 4.0) / 4.0).astype(np.float32)[None]  # log_mel: [1, n_mels, T]


# --- flow prompt mel: Matcha mel_spectrogram ----------------------------------------------------------------


def flow_prompt_mel(wav: np.ndarray, cfg: MelConfig) -> np.ndarray:
    """Matcha ``mel_spectrogram`` (the yaml ``feat_extractor``) as the frontend lays it out.

    Reflect pad (n_fft - hop) / 2 on both sides, STFT without centring (periodic Hann of ``win_size``),
    magnitude ``sqrt(re^2 + im^2 + 1e-9)``, slaney mel basis (fmin/fmax from ``cfg``), natural log
    floored at 1e-5.

    Args:
        wav: mono waveform at ``cfg.sampling_rate``, [N] or [1, N] (N > (n_fft - hop) / 2).
        cfg: the model's mel settings.

    Returns:
        float32 [1, T, cfg.num_mels], T = N // hop_size.
    """
    if cfg.center:
        # Matcha pads by hand and every release config sets center False; torch.stft would pad again.
        raise InputError("MelConfig.center=True is not supported; the CosyVoice configs use center=False.")
    pad = (cfg.n_fft - cfg.hop_size) // 2
    samples = _as_mono(wav, "flow_prompt_mel", pad + 1)  # samples: [N]
    padded = np.pad(samples, pad, mode="reflect")  # padded: [N + 2 * pad]
    window = periodic_hann_window(cfg.win_size, cfg.n_fft)
    spectrum = _stft(padded, cfg.n_fft, cfg.hop_size, window)  # spectrum: [T, n_fft // 2 + 1]
    magnitude = np.sqrt(spectrum.real**2 + spectrum.imag**2 + _MATCHA_MAGNITUDE_EPS)
    basis = slaney_mel_filterbank(cfg.sampling_rate, cfg.n_fft, cfg.num_mels, cfg.fmin, cfg.fmax)
    mel = magnitude @ basis.T.astype(np.float64)  # mel: [T, num_mels]
    return np.log(np.maximum(mel, _MATCHA_LOG_FLOOR)).astype(np.float32)[None]  # mel: [1, T, num_mels]


# --- prompt length alignment --------------------------------------------------------------------------------


def align_prompt(
    speech_tokens: np.ndarray, feat: np.ndarray, token_mel_ratio: int = 2
) -> tuple[np.ndarray, np.ndarray]:
    """Trim the prompt tokens and prompt mel to a common length (CosyVoice2/3 zero-shot, spec §2.8).

    ``token_len = min(T // token_mel_ratio, n)``; keeps ``tokens[:, :token_len]`` and
    ``feat[:, :token_mel_ratio * token_len]``. Voice conversion does not call this.

    Args:
        speech_tokens: prompt speech tokens [1, n].
        feat: prompt mel [1, T, 80].
        token_mel_ratio: mel frames per speech token (the yaml ``token_mel_ratio``).

    Returns:
        ``(tokens [1, token_len], feat [1, token_mel_ratio * token_len, 80])``, views of the inputs.
    """
    token_len = min(feat.shape[1] // token_mel_ratio, speech_tokens.shape[1])
    if token_len < speech_tokens.shape[1] or token_mel_ratio * token_len < feat.shape[1]:
        _LOGGER.debug(
            "prompt aligned: %d tokens / %d frames -> %d tokens",
            speech_tokens.shape[1],
            feat.shape[1],
            token_len,
        )
    return speech_tokens[:, :token_len], feat[:, : token_mel_ratio * token_len]
