"""Streamed answers of a synthesis job: the encoded audio itself, or OpenAI's server-sent events.

Both pull the job chunk by chunk and send what the request's encoder (``streaming_encoders``) has
ready after each chunk, so the first bytes leave with the first chunk. Compressed formats are
encoded in a worker thread (a few ms per second of audio), so the event loop stays free.

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

from ..synthesis import AudioChunk
from .errors import APIError, error_body
from .jobs import SynthesisJob
from .streaming_encoders import AudioEncoder

__all__ = ["SSE_HEADERS", "audio_stream", "sse_stream"]

_LOGGER = logging.getLogger(__name__)

SSE_HEADERS: Final = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""Sent with an event stream: no caching, and no buffering by a reverse proxy (nginx)."""


async def _encoded(encoder: AudioEncoder, chunk: AudioChunk) -> bytes:
    if encoder.costly:
        return await anyio.to_thread.run_sync(encoder.encode, chunk.samples)
    return encoder.encode(chunk.samples)


async def _finished(encoder: AudioEncoder) -> bytes:
    return await anyio.to_thread.run_sync(encoder.finish) if encoder.costly else encoder.finish()


async def _pieces(
    job: SynthesisJob, first: AudioChunk, encoder: AudioEncoder, on_chunk: Callable[[AudioChunk], None]
) -> AsyncIterator[bytes]:
    """The encoded bytes after each chunk (possibly empty), then the encoder's rest. Failures of the
    synthesis pass through (the job is closed then); the encoder is freed in every case."""
    chunk: AudioChunk | None = first
    try:
        while chunk is not None:
            on_chunk(chunk)
            yield await _encoded(encoder, chunk)
            chunk = await job.next()
        if not job.cancelled:
            yield await _finished(encoder)
    finally:
        encoder.close()
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
            {"type": "error", **error_body(500, "the synthesis failed; see the server log.", "synthesis_failed")}
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
