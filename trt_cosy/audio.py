"""Audio loading and resampling, torch-free (docs/cosyvoice-spec §2.1).

``load_audio`` reproduces the official ``load_wav``: torchaudio 2.3's soundfile backend (float32 in
[-1, 1], channels first), a mean over channels, then ``torchaudio.transforms.Resample(orig, new)`` with its
defaults. ``resample`` re-implements that resampler's polyphase Hann-windowed sinc filter in numpy: the same
gcd-reduced rates, the same kernel values (built in float64, stored as float32, as torchaudio does) and the
same output length, so the result matches it to float32 rounding.
"""

from __future__ import annotations

import functools
import logging
import math
from pathlib import Path
from typing import Final

import numpy as np
import soundfile

from .errors import InputError

__all__ = ["MIN_SAMPLE_RATE", "load_audio", "resample", "sinc_resample_kernel"]

_LOGGER = logging.getLogger(__name__)

MIN_SAMPLE_RATE: Final = 16000  # the official load_wav asserts the file rate is at least this
_LOWPASS_FILTER_WIDTH: Final = 6  # torchaudio Resample default
_ROLLOFF: Final = 0.99  # torchaudio Resample default


def load_audio(path: str | Path, target_sr: int, min_sr: int = MIN_SAMPLE_RATE) -> np.ndarray:
    """Read an audio file as mono float32 at ``target_sr``, like the official ``load_wav``.

    Args:
        path: any file libsndfile reads (wav, flac, ogg, ...).
        target_sr: output sample rate in Hz (16000 for the speaker/speech-token features, the model
            rate for the prompt mel).
        min_sr: the lowest accepted file rate in Hz; the official code asserts 16000.

    Returns:
        The waveform, float32 of shape [N], values in [-1, 1].

    Raises:
        InputError: the file is missing, not audio, empty, or sampled below ``min_sr``.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"audio file {path} does not exist. Pass the path of a wav/flac file.")
    try:
        # always_2d + transpose: [C, N] channels first, as torchaudio.load (soundfile backend) returned.
        data, sample_rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.SoundFileError, RuntimeError) as exc:
        raise InputError(
            f"could not read {path} as audio ({exc}). Pass a wav/flac/ogg file of recorded speech."
        ) from exc
    channels_first = np.ascontiguousarray(data.T)  # channels_first: [C, N]
    if channels_first.shape[1] == 0:
        raise InputError(
            f"audio file {path} contains no samples. Pass a recording of a few seconds of speech."
        )
    if sample_rate < min_sr:
        raise InputError(
            f"audio file {path} is sampled at {sample_rate} Hz; at least {min_sr} Hz is needed. "
            f"Use a recording made at {min_sr} Hz or more (upsampling a low-rate file does not help)."
        )
    mono = channels_first.mean(axis=0, dtype=np.float32)  # mono: [N]
    _LOGGER.debug("loaded %s: %d Hz, %d channel(s), %d samples", path, sample_rate, *channels_first.shape)
    if sample_rate != target_sr:
        mono = resample(mono, sample_rate, target_sr)  # mono: [N * target_sr / sample_rate]
    return mono


@functools.lru_cache(maxsize=16)
def sinc_resample_kernel(
    orig_sr: int,
    new_sr: int,
    lowpass_filter_width: int = _LOWPASS_FILTER_WIDTH,
    rolloff: float = _ROLLOFF,
) -> tuple[np.ndarray, int]:
    """The polyphase filter of torchaudio's ``sinc_interp_hann`` resampler (read-only, cached).

    Output phase ``j`` of every block of ``new`` outputs is the dot product of ``kernel[j]`` with
    ``2 * width + orig`` consecutive (zero-padded) inputs; blocks advance by ``orig`` inputs.

    Returns:
        ``(kernel, width)``: kernel float32 [new, 2 * width + orig] for the gcd-reduced rates.
    """
    gcd = math.gcd(orig_sr, new_sr)
    orig, new = orig_sr // gcd, new_sr // gcd
    base_freq = min(orig, new) * rolloff  # cutoff, in units of the reduced rates
    width = math.ceil(lowpass_filter_width * orig / base_freq)
    input_pos = np.arange(-width, width + orig, dtype=np.float64) / orig  # input_pos: [K]
    # torchaudio divides an int64 arange by new_freq, which gives float32 before the float64 sum.
    output_pos = (np.arange(0, -new, -1) / new).astype(np.float32).astype(np.float64)  # output_pos: [new]
    t = (output_pos[:, None] + input_pos[None, :]) * base_freq  # t: [new, K]
    t = np.clip(t, -lowpass_filter_width, lowpass_filter_width)
    window = np.cos(t * math.pi / lowpass_filter_width / 2) ** 2  # window: [new, K]
    t = t * math.pi
    safe_t = np.where(t == 0, 1.0, t)
    sinc = np.where(t == 0, 1.0, np.sin(safe_t) / safe_t)  # sinc: [new, K]
    kernel = (sinc * window * (base_freq / orig)).astype(np.float32)  # kernel: [new, K]
    kernel.setflags(write=False)
    return kernel, width


def resample(wav: np.ndarray, orig_sr: int, new_sr: int) -> np.ndarray:
    """Resample along the last axis like ``torchaudio.transforms.Resample(orig_sr, new_sr)``.

    Same defaults (sinc_interp_hann, lowpass_filter_width 6, rolloff 0.99) and the same output length
    ``ceil(N * new / orig)`` with the gcd-reduced rates. The dot products run in float64 on the float32
    kernel (torchaudio convolves in float32; the difference is below 1e-6) and the result is float32.

    Args:
        wav: float waveform [..., N].
        orig_sr: its sample rate in Hz.
        new_sr: the wanted sample rate in Hz.

    Returns:
        float32 array [..., ceil(N * new_sr / orig_sr)].
    """
    wav = np.asarray(wav, dtype=np.float32)
    if orig_sr == new_sr:
        return wav
    if orig_sr <= 0 or new_sr <= 0:
        raise InputError(f"sample rates must be positive, got {orig_sr} -> {new_sr}.")
    kernel, width = sinc_resample_kernel(int(orig_sr), int(new_sr))  # kernel: [new, K]
    gcd = math.gcd(int(orig_sr), int(new_sr))
    orig, new = orig_sr // gcd, new_sr // gcd
    batch_shape, length = wav.shape[:-1], wav.shape[-1]
    flat = wav.reshape(-1, length).astype(np.float64)  # flat: [B, N]
    padded = np.pad(flat, ((0, 0), (width, width + orig)))  # padded: [B, N + 2 * width + orig]
    # One block per `orig` inputs: a strided view, no copy until the matmul.
    blocks = np.lib.stride_tricks.sliding_window_view(padded, kernel.shape[1], axis=-1)[:, ::orig]
    out = blocks @ kernel.T.astype(np.float64)  # out: [B, N // orig + 1, new]
    out = out.reshape(flat.shape[0], -1)  # out: [B, (N // orig + 1) * new], phases interleaved
    target_length = math.ceil(new * length / orig)
    return out[:, :target_length].astype(np.float32).reshape(*batch_shape, target_length)
