"""Voice conversion (official ``inference_vc``): recorded speech in, the same words in another voice out.

The official ``frontend_vc`` runs the speech tokenizer on the source (16 kHz) and the target reference,
and ``CosyVoiceModel.tts(source_speech_token=...)`` hands the source tokens to the flow in place of the
LLM's output (``vc_job``); the flow renders them with the target's prompt tokens, prompt mel and speaker
embedding, on the same chunk schedule as text-to-speech when streaming (docs/cosyvoice-spec §2.4).
Here a conversion is a ``pipeline.Request`` of the model's family whose "LLM" is the speech tokenizer:
``conversion_request_class`` swaps the family request's ``_decode`` for the tokens of one source window.

Differences from the official code, on purpose:

* Sources longer than the tokenizer's 30 s (the official frontend asserts) are cut at pauses
  (``pause_windows``: the quietest 100 ms between 15 and 30 s into the window) into windows that
  are tokenised and converted in order, one segment each: a window's audio starts where the last
  one's ended (``AudioChunk.segment`` and ``text`` say which window and which seconds of the source).
  The next window is tokenised only once the previous one's first chunk has been taken, so first
  audio never waits for the rest of the source.
* A source may be sampled at 8 kHz or more (the official ``load_wav`` asserts 16 kHz); it is
  resampled to 16 kHz for the tokenizer, and multi-channel audio is mixed down (channel mean).
* The target prompt of ``vc_voice`` is the official VC prompt (tokens and mel *not* trimmed to
  each other, unlike a zero-shot voice); a stored ``Voice`` gives its own (trimmed) prompt.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np

from .audio import load_audio, resample
from .errors import InputError
from .frontend.features import SPEAKER_SAMPLE_RATE, flow_prompt_mel
from .frontend.voice import SILENCE_PEAK, Voice, VoiceBuilder, _check_reference
from .pipeline import Request
from .synthesis import Segment

__all__ = [
    "SOURCE_RATE",
    "MIN_SOURCE_SECONDS",
    "MAX_SOURCE_SECONDS",
    "WINDOW_SECONDS",
    "MIN_SOURCE_RATE",
    "SourceWindow",
    "read_source",
    "check_source",
    "pause_windows",
    "vc_voice",
    "check_vc_voice",
    "conversion_request_class",
    "window_segments",
]

_LOGGER = logging.getLogger(__name__)

SOURCE_RATE: Final = SPEAKER_SAMPLE_RATE  # the speech tokenizer's input rate (16 kHz)
MIN_SOURCE_RATE: Final = 8000  # telephone audio; resampled up to 16 kHz
MIN_SOURCE_SECONDS: Final = 0.5
MAX_SOURCE_SECONDS: Final = 3600.0  # the API's cap; servers set their own (ServerConfig)
WINDOW_SECONDS: Final = 30.0  # the official frontend asserts this before the speech tokenizer
MIN_WINDOW_SECONDS: Final = 15.0  # a cut falls in the quietest part of [15, 30] s of a window
_ENERGY_FRAME: Final = 160  # 10 ms at 16 kHz
_PAUSE_FRAMES: Final = 10  # the quietest 100 ms
_CUT_STEP: Final = 640  # cuts on whole 25 Hz token periods (two 50 Hz v1 tokens)


@dataclass(frozen=True)
class SourceWindow:
    """One piece of the source given to the tokenizer at once: samples ``[start, end)`` at 16 kHz."""

    start: int
    end: int

    @property
    def seconds(self) -> tuple[float, float]:
        return self.start / SOURCE_RATE, self.end / SOURCE_RATE

    def label(self) -> str:
        """``"source 0.00-28.44 s"``: where the window's audio comes from (``AudioChunk.text``)."""
        first, last = self.seconds
        return f"source {first:.2f}-{last:.2f} s"


def read_source(
    source: str | Path | tuple[np.ndarray, int], max_seconds: float = MAX_SOURCE_SECONDS
) -> np.ndarray:
    """The source speech as mono float32 [N] at 16 kHz: a file, or ``(samples, rate)``.

    ``samples`` is [N] or [N, channels] (soundfile's layout), float in [-1, 1] or int16.

    Raises:
        InputError: unreadable, too low a rate, too short, too long or silent.
    """
    if isinstance(source, tuple):
        if len(source) != 2:
            raise InputError("a source given as a tuple must be (samples, sample_rate).")
        samples, rate = source
        wav = _mono(samples, rate)
        name = "the source audio"
        if rate != SOURCE_RATE:
            wav = resample(wav, int(rate), SOURCE_RATE)  # wav: [N * 16000 / rate]
    elif isinstance(source, (str, Path)):
        name = f"source audio {source}"
        _check_file_duration(Path(source), name, max_seconds)  # before reading it all into memory
        wav = load_audio(source, SOURCE_RATE, min_sr=MIN_SOURCE_RATE)  # wav: [N16]
    else:
        raise InputError(
            f"source must be a path, (samples, sample_rate) or a trt_cosy.Voice, got {type(source).__name__}."
        )
    check_source(wav, name, max_seconds)
    return wav


def _check_file_duration(path: Path, name: str, max_seconds: float) -> None:
    """``InputError`` for a file longer than ``max_seconds`` (its header; unreadable files are left
    to ``load_audio``'s message)."""
    import soundfile

    try:
        info = soundfile.info(str(path))
    except Exception:  # libsndfile raises several types for garbage; load_audio says what is wrong
        return
    if info.samplerate > 0 and info.frames / info.samplerate > max_seconds:
        seconds = info.frames / info.samplerate
        raise InputError(
            f"{name} is {seconds:.0f} s long; at most {max_seconds:g} s can be converted in one request. "
            "Split the recording."
        )


def _mono(samples: object, rate: object) -> np.ndarray:
    if not isinstance(rate, (int, np.integer)) or isinstance(rate, bool) or rate < MIN_SOURCE_RATE:
        raise InputError(
            f"the source sample rate must be an integer of at least {MIN_SOURCE_RATE} Hz, got {rate!r}."
        )
    array = np.asarray(samples)
    if array.dtype == np.int16:
        array = array.astype(np.float32) / np.float32(32768.0)
    if array.dtype.kind != "f" or array.ndim not in (1, 2) or array.size == 0:
        raise InputError(
            f"source samples must be a non-empty float or int16 array [N] or [N, channels], got "
            f"{array.dtype} {array.shape}."
        )
    if not np.all(np.isfinite(array)):
        raise InputError("the source samples contain NaN or infinite values.")
    array = array.astype(np.float32, copy=False)
    return array if array.ndim == 1 else array.mean(axis=1, dtype=np.float32)  # [N]


def check_source(wav16k: np.ndarray, name: str, max_seconds: float = MAX_SOURCE_SECONDS) -> None:
    """``InputError`` for a source that is too short, too long or silent (16 kHz samples [N])."""
    seconds = wav16k.shape[0] / SOURCE_RATE
    if seconds < MIN_SOURCE_SECONDS:
        raise InputError(
            f"{name} is {seconds:.2f} s long; voice conversion needs at least {MIN_SOURCE_SECONDS:g} s "
            "of speech."
        )
    if seconds > max_seconds:
        raise InputError(
            f"{name} is {seconds:.0f} s long; at most {max_seconds:g} s can be converted in one request. "
            "Split the recording."
        )
    peak = float(np.max(np.abs(wav16k)))
    if peak < SILENCE_PEAK:
        raise InputError(f"{name} is silent (peak {peak:.2g}); pass a recording of speech.")


def pause_windows(
    wav16k: np.ndarray,
    max_seconds: float = WINDOW_SECONDS,
    min_seconds: float = MIN_WINDOW_SECONDS,
) -> list[SourceWindow]:
    """Cut a source [N] at 16 kHz into windows of at most ``max_seconds``, at pauses.

    Each cut falls in the middle of the quietest ``_PAUSE_FRAMES`` x 10 ms stretch (lowest mean
    energy) between ``min_seconds`` and ``max_seconds`` into the window, on a whole token period.
    A source of ``max_seconds`` or less is one window.
    """
    total = wav16k.shape[0]
    longest = int(max_seconds * SOURCE_RATE) // _CUT_STEP * _CUT_STEP
    shortest = int(min_seconds * SOURCE_RATE)
    frames = total // _ENERGY_FRAME
    framed = wav16k[: frames * _ENERGY_FRAME].astype(np.float64).reshape(frames, _ENERGY_FRAME)
    energy = np.square(framed).mean(axis=1)  # energy: [frames]
    # pause[i]: mean energy of frames [i, i + _PAUSE_FRAMES)
    pause = np.convolve(energy, np.ones(_PAUSE_FRAMES) / _PAUSE_FRAMES, mode="valid")  # [frames - 9]
    windows, start = [], 0
    while total - start > longest:
        first = (start + shortest) // _ENERGY_FRAME
        last = (start + longest) // _ENERGY_FRAME - _PAUSE_FRAMES  # the stretch ends inside the window
        quietest = first + int(np.argmin(pause[first : last + 1]))
        middle = (quietest + _PAUSE_FRAMES // 2) * _ENERGY_FRAME
        cut = min(start + longest, max(start + _CUT_STEP, middle // _CUT_STEP * _CUT_STEP))
        windows.append(SourceWindow(start, cut))
        start = cut
    windows.append(SourceWindow(start, total))
    return windows


def window_segments(windows: list[SourceWindow]) -> list[Segment]:
    """One request segment per window (no text; ``text`` names the source seconds)."""
    return [Segment(window.label(), np.zeros(0, np.int64)) for window in windows]


def vc_voice(builder: VoiceBuilder, path: str | Path) -> Voice:
    """The official ``frontend_vc`` target prompt of a reference recording (1-30 s of speech).

    Speech tokens, prompt mel and speaker embedding, with no transcript; unlike a zero-shot voice,
    the tokens and the mel are *not* trimmed to each other (the official VC frontend does not).

    Raises:
        InputError: unreadable, too short, too long or silent audio.
    """
    wav16k = load_audio(path, SPEAKER_SAMPLE_RATE)  # wav16k: [N16]
    _check_reference(path, wav16k)
    tokens = builder.speech_tokens(wav16k)  # tokens: [1, P]
    if tokens.shape[1] == 0:
        raise InputError(f"reference audio {path} gave no speech tokens. Use 3-10 s of clear speech.")
    wav_model = load_audio(path, builder.mel_config.sampling_rate)  # wav_model: [N]
    mel = flow_prompt_mel(wav_model, builder.mel_config)  # mel: [1, T, 80]
    return Voice(
        prompt_text="",
        prompt_text_ids=np.zeros(0, np.int32),
        speech_tokens=tokens[0],
        prompt_mel=mel[0],
        speaker_embedding=builder.speaker_embedding(wav16k),  # [192]
        sample_rate=builder.mel_config.sampling_rate,
        model_id=builder.model_id,
    )


def check_vc_voice(voice: object, sample_rate: int, num_mels: int, embed_dim: int) -> None:
    """``InputError`` unless ``voice`` is a ``Voice`` whose arrays fit the model (any prompt lengths)."""
    if not isinstance(voice, Voice):
        raise InputError(
            "voice must be a trt_cosy.Voice (CosyVoice.vc_voice_from_wav, voice_from_wav or Voice.load) or "
            f"the name of a preset speaker, got {type(voice).__name__}."
        )
    tokens, frames = voice.speech_tokens.shape[0], voice.prompt_mel.shape[0]
    if (
        voice.sample_rate != sample_rate
        or voice.speaker_embedding.shape != (embed_dim,)
        or voice.prompt_mel.shape[1] != num_mels
        or (tokens == 0) != (frames == 0)
    ):
        raise InputError(
            f"the voice does not fit this model ({voice.sample_rate} Hz, embedding "
            f"{voice.speaker_embedding.shape}, prompt mel {voice.prompt_mel.shape}); make it again with this "
            "model."
        )


class _SourceTokens:
    """The request mixin of voice conversion: a segment's speech tokens are its source window's.

    ``tokens_of(index)`` tokenises window ``index`` (in the request's worker thread). Window
    ``index + 1`` is tokenised once the first chunk of window ``index`` has been taken.
    """

    def attach_source(self, tokens_of: Callable[[int], np.ndarray], windows: int) -> None:
        self._tokens_of = tokens_of
        self._window_taken = [threading.Event() for _ in range(windows)]

    def _decode(self, index: int) -> Iterator[int]:
        if index > 0:
            while not self._window_taken[index - 1].wait(0.05):
                if self.feed.cancelled:
                    return
        tokens = self._tokens_of(index)  # tokens: [n]
        _LOGGER.debug("window %d: %d source tokens", index, tokens.size)
        yield from (int(token) for token in tokens)

    def _segment_chunks(self, index: int, started: float, count: int) -> Iterator:
        taken = self._window_taken[index]
        try:
            for chunk in super()._segment_chunks(index, started, count):
                yield chunk
                taken.set()  # the consumer has the window's first chunk: the next window may start
        finally:
            taken.set()


@functools.cache
def conversion_request_class(request_class: type[Request]) -> type[Request]:
    """The family's request class with source tokens in place of the LLM (and no silent-token
    filter: the official ``vc_job`` hands the tokens over as they are)."""
    return type(f"Conversion{request_class.__name__}", (_SourceTokens, request_class), {})
