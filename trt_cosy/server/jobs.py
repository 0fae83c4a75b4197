"""One request's synthesis: the engine's lazy generator pulled chunk by chunk in a worker thread.

The generator runs one chunk at a time in a thread (``anyio.to_thread``), so the event loop stays
free. A worker thread cannot be interrupted, so cancellation (client gone, timeout) takes effect
at the next chunk boundary: the generator is then closed, which stops the engine's work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import anyio
import numpy as np

from ..synthesis import AudioChunk
from .audio_encoding import pcm16, wav_header
from .errors import APIError
from .limits import Slot
from .metrics import Metrics

__all__ = ["SynthesisJob", "stream_body", "collect"]

_LOGGER = logging.getLogger(__name__)


class SynthesisJob:
    """Owns a held slot and the engine generator of one request until ``close``.

    Args:
        chunks: the lazy generator from ``CosyVoice.synthesize``.
        slot: the admission slot, released on ``close``.
        metrics: where time to first audio, RTF and cancellations are recorded.
        received_at: ``time.perf_counter()`` when the request arrived (time to first audio counts from it).
        timeout_s: the request's budget from ``received_at``; checked before every chunk.
    """

    def __init__(
        self,
        chunks: Iterator[AudioChunk],
        slot: Slot,
        metrics: Metrics,
        received_at: float,
        timeout_s: float,
    ):
        self._chunks = chunks
        self._slot = slot
        self._metrics = metrics
        self._received_at = received_at
        self._deadline = received_at + timeout_s
        self._timeout_s = timeout_s
        self._started = time.perf_counter()
        self._audio_s = 0.0
        self._count = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def next(self) -> AudioChunk | None:
        """The next chunk, or None when the synthesis is complete (the job is then closed).

        Raises:
            APIError: 504 when the request's time is up (the job is closed first).
        """
        if self._closed:
            return None
        if time.perf_counter() > self._deadline:
            self.close("timeout")
            raise APIError(
                504, f"the synthesis took longer than the {self._timeout_s:g} s request timeout.", "timeout"
            )
        try:
            # Not abandoned on cancel: a cancellation waits for the running chunk, then close() is safe.
            chunk = await anyio.to_thread.run_sync(next, self._chunks, None)
        except anyio.get_cancelled_exc_class():
            self.close("disconnect")  # the request's scope was cancelled: its client went away
            raise
        except BaseException:
            self.close("error")
            raise
        if chunk is None:
            self.close()
            return None
        if self._count == 0:
            self._metrics.first_audio.observe(time.perf_counter() - self._received_at)
        self._count += 1
        self._audio_s += chunk.duration
        return chunk

    def close(self, reason: str | None = None) -> None:
        """Stop the engine generator and free the slot; ``reason`` None means it completed."""
        if self._closed:
            return
        self._closed = True
        try:
            self._chunks.close()
        except ValueError:  # "generator already executing": only if a thread was abandoned
            _LOGGER.warning("could not close a running synthesis; it finishes its chunk first")
        finally:
            self._slot.release()
        elapsed = time.perf_counter() - self._started
        if reason is None:
            if self._audio_s > 0:
                self._metrics.rtf.observe(elapsed / self._audio_s)
        else:
            self._metrics.cancelled.labels(reason).inc()
            _LOGGER.info("synthesis stopped (%s) after %d chunk(s), %.2f s", reason, self._count, elapsed)
        self._metrics.audio_seconds.inc(self._audio_s)


async def collect(
    job: SynthesisJob, first: AudioChunk, disconnected: Callable[[], Awaitable[bool]]
) -> np.ndarray | None:
    """All the audio of ``job`` (float32 [N]); None when the client went away (the job is closed)."""
    pieces = [first.samples]
    while True:
        if await disconnected():
            job.close("disconnect")
            return None
        chunk = await job.next()
        if chunk is None:
            return np.concatenate(pieces)  # [N]
        pieces.append(chunk.samples)


async def stream_body(
    job: SynthesisJob, first: AudioChunk, response_format: str, sample_rate: int
) -> AsyncIterator[bytes]:
    """WAV (header of unknown length first) or raw PCM bytes, each chunk sent as soon as it exists.

    The status line has gone out already, so a failure here ends the stream early (logged and counted).
    """
    if response_format == "wav":
        yield wav_header(sample_rate)
    chunk: AudioChunk | None = first
    try:
        while chunk is not None:
            yield pcm16(chunk.samples)
            try:
                chunk = await job.next()
            except APIError as exc:
                _LOGGER.warning("stream ended early: %s", exc.message)
                return
            except Exception:
                _LOGGER.exception("synthesis failed in the middle of a stream; the stream ends here")
                return
    finally:
        job.close("disconnect")  # a no-op when it completed
