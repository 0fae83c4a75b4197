"""Streamed answers of a synthesis job: the encoded audio itself, or OpenAI's server-sent events.

Both pull the job chunk by chunk and send what the request's encoder (``streaming_encoders``) has
ready after each chunk, so the first bytes leave with the first chunk (its first ``FIRST_PIECE_S``
encoded on their own). Compressed formats are encoded in a worker thread (a few ms per second of
audio), so the event loop stays free; what they cost is counted in ``encode_cpu_seconds``.

Server-sent events (``"stream_format": "sse"``), as OpenAI's speech API sends them::

    data: {"type": "speech.audio.delta", "audio": "<base64 of the next bytes of the file>"}

    data: {"type": "speech.audio.done", "usage": {"input_tokens": 12, "output_tokens": 80, "total_tokens": 92}}

The deltas' bytes, joined, are the same file the audio stream sends. ``input_tokens`` counts the text
tokens of the input, ``output_tokens`` the speech tokens spoken. A synthesis that fails midway ends
the events with ``{"type": "error", "error": {"message", "type", "param", "code"}}`` instead of done.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Final

import anyio
import numpy as np

from ..synthesis import AudioChunk
from .errors import APIError, error_body
from .jobs import SynthesisJob
from .streaming_encoders import AudioEncoder

__all__ = [
    "FIRST_PIECE_S",
    "SSE_HEADERS",
    "audio_stream",
    "count_encoding",
    "encoded",
    "finished",
    "first_pieces",
    "sse_stream",
]

_LOGGER = logging.getLogger(__name__)

SSE_HEADERS: Final = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Sent with an event stream: no caching, and no buffering by a reverse proxy (nginx)."""


FIRST_PIECE_S: Final = 0.25
"""Of the first chunk, this much audio is encoded and sent on its own before the rest: enough for
every codec's first audio frame (mp3 and Opus pages: 24 and 100 ms, AAC's 2048 samples of delay,
FLAC's block), so the first bytes leave after ~1 ms of encoding instead of the ~10-20 ms a 2 s chunk
takes (more while the LLM thread keeps both cores busy)."""


async def encoded(encoder: AudioEncoder, samples: np.ndarray) -> bytes:
    """``encoder.encode(samples)``, in a worker thread for the costly encoders."""
    if encoder.costly:
        return await anyio.to_thread.run_sync(encoder.encode, samples)
    return encoder.encode(samples)


async def finished(encoder: AudioEncoder) -> bytes:
    """``encoder.finish()``, in a worker thread for the costly encoders."""
    return await anyio.to_thread.run_sync(encoder.finish) if encoder.costly else encoder.finish()


def first_pieces(encoder: AudioEncoder, first: AudioChunk) -> list[np.ndarray]:
    """The first chunk's samples as they are encoded: a costly encoder's head apart, else whole."""
    head = int(FIRST_PIECE_S * first.sample_rate)
    if not encoder.costly or first.samples.size <= 2 * head:
        return [first.samples]
    return [first.samples[:head], first.samples[head:]]  # [head], [N - head]


def count_encoding(job: SynthesisJob, encoder: AudioEncoder) -> None:
    """Add what ``encoder`` cost to the app's ``encode_cpu_seconds`` (once, when it is done)."""
    job.metrics.encode_cpu.labels(encoder.format or "unknown").inc(encoder.cpu_s)


async def _pieces(
    job: SynthesisJob, first: AudioChunk, encoder: AudioEncoder, on_chunk: Callable[[AudioChunk], None]
) -> AsyncIterator[bytes]:
    """The encoded bytes after each chunk (possibly empty), then the encoder's rest. Failures of the
    synthesis pass through (the job is closed then); the encoder is freed in every case."""
    try:
        on_chunk(first)
        for samples in first_pieces(encoder, first):
            yield await encoded(encoder, samples)
        while (chunk := await job.next()) is not None:
            on_chunk(chunk)
            yield await encoded(encoder, chunk.samples)
        if not job.cancelled:
            yield await finished(encoder)
    finally:
        encoder.close()
        count_encoding(job, encoder)
        job.close("disconnect")  # a no-op when it completed


async def audio_stream(job: SynthesisJob, first: AudioChunk, encoder: AudioEncoder) -> AsyncIterator[bytes]:
    """The file's bytes as they are encoded. The status line has gone out already, so a failure ends
    the stream early (logged and counted)."""
    try:
        async for piece in _pieces(job, first, encoder, lambda chunk: None):
            if piece:
                yield piece
    except APIError as exc:
        _LOGGER.warning("stream ended early: %s", exc.message)
    except Exception:
        _LOGGER.exception("synthesis failed in the middle of a stream; the stream ends here")


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode("utf-8") + b"\n\n"


async def sse_stream(
    job: SynthesisJob, first: AudioChunk, encoder: AudioEncoder, input_tokens: int
) -> AsyncIterator[bytes]:
    """OpenAI's speech events: a delta per encoded piece, then done with the token usage (or an error
    event when the synthesis fails midway)."""
    spoken = {"tokens": 0}

    def count(chunk: AudioChunk) -> None:
        spoken["tokens"] += int(chunk.timings.get("tokens", 0))

    try:
        async for piece in _pieces(job, first, encoder, count):
            if piece:
                yield _event({"type": "speech.audio.delta", "audio": base64.b64encode(piece).decode("ascii")})
    except APIError as exc:
        _LOGGER.warning("event stream ended early: %s", exc.message)
        yield _event({"type": "error", **error_body(exc.status, exc.message, exc.code, exc.param)})
        return
    except Exception:
        _LOGGER.exception("synthesis failed in the middle of an event stream")
        yield _event(
            {
                "type": "error",
                **error_body(500, "the synthesis failed; see the server log.", "synthesis_failed"),
            }
        )
        return
    if job.cancelled:
        return
    usage = {
        "input_tokens": input_tokens,
        "output_tokens": spoken["tokens"],
        "total_tokens": input_tokens + spoken["tokens"],
    }
    yield _event({"type": "speech.audio.done", "usage": usage})
