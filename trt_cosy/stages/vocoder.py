"""The vocoder stage (numpy only): mel chunks -> waveform through a runner of the ``HIFT`` graph.

Streaming follows the official ``CosyVoice2Model.token2wav`` (spec §6.1): each call after the first
prepends the last 8 mel frames of the previous call, overwrites the start of the new NSF source
with the previous 3840 source samples, and cross-fades its first 3840 output samples with the 3840
samples the previous call withheld (float64 ``numpy.hamming(7680)``, stored as float32). A call that
is not final withholds its last 3840 samples. That state lives in a per-request ``VocoderCache``, so
one ``VocoderStage`` serves any number of concurrent requests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import numpy as np

from ..config import HiFTConfig
from ..errors import InputError
from ..runtime.backends.base import Runner

__all__ = ["VocoderStage", "VocoderCache", "sine_noise", "fade_in_out"]

_LOGGER = logging.getLogger(__name__)
MEL_CACHE_FRAMES: Final = 8  # official mel_cache_len (v2)


def sine_noise(rng: np.random.Generator, n_samples: int, harmonics: int) -> np.ndarray:
    """Standard-normal NSF noise [1, n_samples, harmonics + 1] float32 (one channel per sine).

    ``harmonics`` is ``HiFTConfig.nb_harmonics`` (overtones above f0; 8 -> 9 sine channels).
    """
    return rng.standard_normal((1, n_samples, harmonics + 1), dtype=np.float32)


def fade_in_out(fade_in: np.ndarray, fade_out: np.ndarray, window: np.ndarray) -> np.ndarray:
    """Official ``fade_in_out``: cross-fade the start of ``fade_in`` with the end of ``fade_out``.

    ``window`` is float64 of length 2n; the mix is computed in float64 and stored in ``fade_in``'s
    dtype, as the official code does (a float32 tensor times a float64 numpy window).
    """
    overlap = window.shape[0] // 2
    faded = fade_in.copy()  # faded: [1, S]
    mixed = fade_in[..., :overlap] * window[:overlap] + fade_out[..., -overlap:] * window[overlap:]  # float64
    faded[..., :overlap] = mixed.astype(fade_in.dtype)
    return faded


@dataclass
class VocoderCache:
    """Per-request streaming state; empty until the first non-final ``render``.

    Attributes:
        mel: the last 8 mel frames given to the vocoder [1, 80, 8].
        source: the last 3840 NSF source samples [1, 1, 3840].
        speech: the 3840 output samples withheld from the last call [1, 3840].
    """

    mel: np.ndarray | None = None
    source: np.ndarray | None = None
    speech: np.ndarray | None = None

    @property
    def empty(self) -> bool:
        return self.mel is None


class VocoderStage:
    """Mel in, waveform out (24 kHz float32 for CosyVoice2).

    Args:
        runner: any Runner for the ``HIFT`` graph (torch reference, ONNX Runtime, TensorRT).
        config: the release's ``HiFTConfig``.
    """

    def __init__(self, runner: Runner, config: HiFTConfig):
        self.runner = runner
        self.config = config
        self.samples_per_frame = config.samples_per_frame
        self.source_cache_len = MEL_CACHE_FRAMES * self.samples_per_frame
        self.window = np.hamming(2 * self.source_cache_len)  # float64, as the official speech_window

    def render(
        self,
        mel: np.ndarray,
        rng_or_noise: np.random.Generator | np.ndarray,
        cache: VocoderCache | None = None,
        *,
        final: bool = True,
    ) -> np.ndarray:
        """Vocode one mel chunk and return the samples to emit now: [1, N] float32.

        Args:
            mel: the new mel frames [1, 80, F] (without the cached frames; the cache adds them).
            rng_or_noise: a ``numpy.random.Generator`` to draw the NSF noise from, or the noise
                itself [1, 480 (F + cached frames), nb_harmonics + 1] (tests inject the official draw).
            cache: the request's ``VocoderCache`` for streaming (read and updated in place), or
                None for a one-shot render.
            final: False withholds the last 3840 samples for the next call's cross-fade (needs a cache).
        """
        if not final and cache is None:
            raise InputError("a non-final vocoder call needs a VocoderCache to carry the streaming state.")
        mel = self._check_mel(mel)
        has_cache = cache is not None and not cache.empty
        if has_cache:
            mel = np.concatenate([cache.mel, mel], axis=2)  # mel: [1, 80, 8 + F]
            cache_source = cache.source  # cache_source: [1, 1, 3840]
        else:
            cache_source = np.zeros((1, 1, 0), dtype=np.float32)
        noise = self._noise(rng_or_noise, mel.shape[2] * self.samples_per_frame)  # noise: [1, 480F', H+1]
        outputs = self.runner.infer({"mel": mel, "sine_noise": noise, "cache_source": cache_source})
        speech, source = outputs["wav"], outputs["source"]  # speech: [1, 480F'], source: [1, 1, 480F']
        if has_cache:
            speech = fade_in_out(speech, cache.speech, self.window)
        if final:
            return speech
        cache.mel = mel[:, :, -MEL_CACHE_FRAMES:]
        cache.source = source[:, :, -self.source_cache_len :]
        cache.speech = speech[:, -self.source_cache_len :]
        return speech[:, : -self.source_cache_len]

    def _check_mel(self, mel: np.ndarray) -> np.ndarray:
        mel = np.asarray(mel)
        mels = self.config.in_channels
        if mel.ndim != 3 or mel.shape[0] != 1 or mel.shape[1] != mels or mel.shape[2] < 1:
            raise InputError(f"vocoder mel must have shape [1, {mels}, F>=1], got {mel.shape}.")
        return np.ascontiguousarray(mel, dtype=np.float32)

    def _noise(self, rng_or_noise: np.random.Generator | np.ndarray, n_samples: int) -> np.ndarray:
        channels = self.config.nb_harmonics + 1
        if isinstance(rng_or_noise, np.random.Generator):
            return sine_noise(rng_or_noise, n_samples, self.config.nb_harmonics)
        noise = np.asarray(rng_or_noise)
        if noise.shape != (1, n_samples, channels):
            raise InputError(
                f"injected sine noise must have shape (1, {n_samples}, {channels}) for this chunk "
                f"(cached mel frames included), got {noise.shape}."
            )
        return np.ascontiguousarray(noise, dtype=np.float32)
