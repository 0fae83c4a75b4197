"""What admission by expected work (``server.admission``) needs from a loaded engine, for every front end.

The HTTP server (``server.work_admission``) and the Triton model (``serving.triton_admission``) both
build their ``WorkAdmission`` here from the family's ratios (``work_admission_for``), measure the
machine with the same warm-up (``warm_up``) and read a planned request's work the same way
(``segment_tokens_of``). No web framework or metrics library is imported: the Triton stub may have
neither.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from ..synthesis import SynthesisConfig
from .admission import SpeedModel, WorkAdmission

__all__ = [
    "WarmupRun",
    "warm_up",
    "segment_tokens_of",
    "chunk_work",
    "work_admission_for",
    "STREAM_FIRST_TOKENS",
]

STREAM_FIRST_TOKENS: Final = 28.0  # CosyVoice2's first hop (25) plus its look-ahead (3)
_WARMUP_TEXTS: Final = ("Hello.", "Hello, this is a test of my voice.")
"""Spoken whole, then the first streamed: two lengths give the fixed cost per segment apart from the
cost per token (``SpeedModel.calibrate_alone``)."""
_WARMUP_RATE: Final = 16000


@dataclass(frozen=True)
class WarmupRun:
    """One warm-up synthesis, measured alone: what calibrates the work model."""

    streaming: bool
    text_tokens: int
    speech_tokens: float
    seconds: float
    segments: int = 1


def segment_tokens_of(chunks: Any) -> list[int] | None:
    """Text tokens of each planned segment of ``CosyVoice.synthesize``'s iterator; None for other
    iterators (their work cannot be estimated; they are admitted untracked)."""
    segments = getattr(getattr(chunks, "request", None), "segments", None)
    if not segments:
        return None
    return [int(segment.ids.size) for segment in segments]


def work_admission_for(tts: Any, clock: Callable[[], float] | None = None, **options: Any) -> WorkAdmission:
    """A ``WorkAdmission`` for the loaded engine ``tts``: its ``model.config`` gives the family's
    speech-per-text limits and token rate (an engine without one gets CosyVoice2's); ``options``
    go to ``WorkAdmission`` (``timeout_setting``...)."""
    config = getattr(getattr(tts, "model", None), "config", None)
    llm = getattr(config, "llm", None)
    speed = SpeedModel(
        float(getattr(llm, "min_token_text_ratio", 2.0)),
        float(getattr(llm, "max_token_text_ratio", 20.0)),
    )
    if clock is not None:
        options["clock"] = clock
    return WorkAdmission(
        speed,
        tokens_per_audio_s=float(getattr(config, "token_frame_rate", 25)),
        stream_first_tokens=STREAM_FIRST_TOKENS,
        **options,
    )


def chunk_work(chunk: Any) -> tuple[float, float | None]:
    """(speech tokens, render seconds or None) of one ``AudioChunk``, from its ``timings``: what
    ``WorkAdmission.progress`` is fed (a non-streamed chunk is a whole segment)."""
    timings = chunk.timings
    seconds = [timings.get(name) for name in ("llm_wait_s", "flow_s", "vocoder_s")]
    render_s = sum(seconds) if all(value is not None for value in seconds) else None
    return float(timings.get("tokens", 0.0)), render_s


def warm_up(tts: Any) -> list[WarmupRun]:
    """Run every graph once: a voice from a synthetic 2 s recording, then two short sentences, plain, and
    the first streamed (which also creates the deferred chunk-attention session, ``engines.LAZY_GRAPHS``).

    Returns each synthesis measured (the admission's first estimate of this machine's speed)."""
    rng = np.random.default_rng(0)
    time_axis = np.arange(2 * _WARMUP_RATE) / _WARMUP_RATE  # time_axis: [N]
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * time_axis)  # syllable-like loudness
    signal = (
        0.2 * envelope * (np.sin(2 * np.pi * 180 * time_axis) + 0.3 * rng.standard_normal(time_axis.size))
    )
    import soundfile

    with tempfile.TemporaryDirectory(prefix="trt-cosy-warmup-") as folder:
        path = Path(folder) / "warmup.wav"
        soundfile.write(path, signal.astype(np.float32), _WARMUP_RATE)
        voice = tts.voice_from_wav(path, None)
    runs = []
    plans = [(text, SynthesisConfig()) for text in _WARMUP_TEXTS] + [
        (_WARMUP_TEXTS[0], SynthesisConfig(stream=True))
    ]
    for text, config in plans:
        started = time.perf_counter()
        chunks = tts.synthesize(text, voice, 0, config=config)
        speech_tokens = sum(chunk.timings.get("tokens", 0.0) for chunk in chunks)
        segments = segment_tokens_of(chunks) or [0]
        seconds = time.perf_counter() - started
        runs.append(WarmupRun(config.stream, sum(segments), speech_tokens, seconds, len(segments)))
    return runs
