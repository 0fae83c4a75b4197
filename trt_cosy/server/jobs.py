"""One request's synthesis: the engine's lazy generator pulled chunk by chunk in a worker thread.

The generator runs one chunk at a time in a thread (``anyio.to_thread``), so the event loop stays
free. A worker thread cannot be interrupted, but the engine's iterator has a thread-safe
``cancel()`` (``pipeline.CancellableChunks``): when the waiting task is cancelled (client gone) the
job calls it, the engine stops at its next LLM step or chunk, and the thread returns; the generator
is then closed. Iterators without ``cancel()`` stop at the next chunk boundary.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from ..synthesis import AudioChunk
from .errors import APIError
from .limits import Slot
from .metrics import Metrics
from .work_admission import WorkTicket

if TYPE_CHECKING:
    from .state import ServerState

__all__ = ["SynthesisJob", "collect", "cancel_on_disconnect", "start_job"]

_LOGGER = logging.getLogger(__name__)


class SynthesisJob:
    """Owns a held slot and the engine generator of one request until ``close``.

    Args:
        chunks: the lazy generator from ``CosyVoice.synthesize``.
        slot: the admission slot, released on ``close``.
        metrics: where time to first audio, RTF and cancellations are recorded.
        received_at: ``time.perf_counter()`` when the request arrived (time to first audio counts from it).
        timeout_s: the request's budget from ``received_at``; checked before every chunk.
        work: the request's place in the admission by expected work (``WorkTicket``): started now,
            told each chunk, closed with the job.
    """

    def __init__(
        self,
        chunks: Iterator[AudioChunk],
        slot: Slot,
        metrics: Metrics,
        received_at: float,
        timeout_s: float,
        work: WorkTicket | None = None,
    ):
        self._chunks = chunks
        self._work = work or WorkTicket()
        self._work.start()
        self._slot = slot
        self._metrics = metrics
        self._received_at = received_at
        self._deadline = received_at + timeout_s
        self._timeout_s = timeout_s
        self._started = time.perf_counter()
        self._audio_s = 0.0
        self._count = 0
        self._closed = False
        self._cancel_reason: str | None = None

    @property
    def metrics(self) -> Metrics:
        """Where this job's request is counted (the app's metrics)."""
        return self._metrics

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def cancelled(self) -> bool:
        """``cancel`` was called: the job ends without its remaining audio."""
        return self._cancel_reason is not None

    def cancel(self, reason: str = "disconnect") -> None:
        """Ask the engine to stop soon, even while a chunk is being computed (idempotent).

        The job closes (with ``reason``) when its running chunk returns.
        """
        if self._closed or self._cancel_reason is not None:
            return
        self._cancel_reason = reason
        cancel = getattr(self._chunks, "cancel", None)
        if cancel is not None:
            cancel()

    async def next(self) -> AudioChunk | None:
        """The next chunk, or None when the synthesis is complete (the job is then closed).

        Raises:
            APIError: 504 when the request's time is up (the job is closed first).
        """
        if self._closed:
            return None
        if self._cancel_reason is not None:
            self.close(self._cancel_reason)
            return None
        if time.perf_counter() > self._deadline:
            self.close("timeout")
            raise APIError(
                504, f"the synthesis took longer than the {self._timeout_s:g} s request timeout.", "timeout"
            )
        try:
            chunk = await self._pull()
        except anyio.get_cancelled_exc_class():
            self.close(self._cancel_reason or "disconnect")  # the request's scope was cancelled
            raise
        except BaseException:
            self.close("error")
            raise
        if chunk is None or self._cancel_reason is not None:
            self.close(self._cancel_reason)
            return None
        if self._count == 0:
            self._metrics.first_audio.observe(time.perf_counter() - self._received_at)
        self._count += 1
        self._audio_s += chunk.duration
        self._work.progress(chunk)
        return chunk

    async def _pull(self) -> AudioChunk | None:
        """The engine's next chunk, computed in a worker thread.

        The thread is never abandoned (closing a generator that runs would fail): when the waiting
        task is cancelled, the engine is told to stop (``cancel``) and the thread is waited for
        (shielded), which takes at most one LLM step or chunk render.
        """
        outcome: dict[str, object] = {}
        done = anyio.Event()

        async def pull() -> None:
            with anyio.CancelScope(shield=True):
                try:
                    outcome["chunk"] = await anyio.to_thread.run_sync(next, self._chunks, None)
                except BaseException as exc:  # raised again in the waiting task
                    outcome["error"] = exc
                finally:
                    done.set()

        async with anyio.create_task_group() as group:
            group.start_soon(pull)
            try:
                await done.wait()
            except anyio.get_cancelled_exc_class():
                self.cancel(self._cancel_reason or "disconnect")
                raise  # the task group waits for the shielded thread first
        if "error" in outcome:
            raise outcome["error"]  # type: ignore[misc]
        return outcome.get("chunk")  # type: ignore[return-value]

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
            self._work.close(completed=reason is None)
        elapsed = time.perf_counter() - self._started
        if reason is None:
            if self._audio_s > 0:
                self._metrics.rtf.observe(elapsed / self._audio_s)
        else:
            self._metrics.cancelled.labels(reason).inc()
            _LOGGER.info("synthesis stopped (%s) after %d chunk(s), %.2f s", reason, self._count, elapsed)
        self._metrics.audio_seconds.inc(self._audio_s)


@contextlib.asynccontextmanager
async def cancel_on_disconnect(job: SynthesisJob, receive: Callable[[], Awaitable[dict]]):
    """While the block runs, a watcher waits on ``receive`` (the request's ASGI receive, its body
    already read) for the client's disconnect and then cancels ``job`` at once, even in the middle
    of a chunk. Exceptions of the block pass unchanged."""

    async def watch_disconnect() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        job.cancel("disconnect")

    failure: Exception | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(watch_disconnect)
        try:
            yield
        except Exception as exc:  # raised after the group, unwrapped (a group would wrap it)
            failure = exc
        group.cancel_scope.cancel()
    if failure is not None:
        raise failure


async def collect(job: SynthesisJob, first: AudioChunk) -> np.ndarray | None:
    """All the audio of ``job`` (float32 [N]); None when it was cancelled (the job is closed).

    Run it under ``cancel_on_disconnect`` so that a client that leaves stops the work at once.
    """
    pieces = [first.samples]
    while (chunk := await job.next()) is not None:
        pieces.append(chunk.samples)
    if job.cancelled:
        return None
    return np.concatenate(pieces)  # [N]


async def start_job(
    state: ServerState,
    request: Any,
    chunks: Iterator[AudioChunk],
    admit: Callable[[float], WorkTicket | None],
    received_at: float,
    streaming: bool,
) -> tuple[SynthesisJob, AudioChunk | None, np.ndarray | None]:
    """Admit a request's ``chunks`` and run it up to its first audio (all of it when not ``streaming``).

    ``admit(left_s)`` asks the work model (``state.work``, when the server has one) to take the request
    with ``left_s`` seconds left of its timeout; it refuses at once (503/413) work that would not
    finish in time. Then a slot of ``state.admission`` (429/503), then the job: a client that leaves
    cancels the work at once (mid-chunk), streamed or not. Returns the job, its first chunk (None: no
    audio) and, not streaming, every sample (None when the client left).
    """
    settings = state.settings
    try:
        left_s = settings.request_timeout_s - (time.perf_counter() - received_at)
        work = admit(left_s) if state.work else None
        try:
            slot = await state.admission.acquire(settings.request_timeout_s)
        except BaseException:
            if work is not None:
                work.close(completed=False)
            raise
    except BaseException:
        chunks.close()  # type: ignore[attr-defined]
        raise
    job = SynthesisJob(chunks, slot, state.metrics, received_at, settings.request_timeout_s, work)
    try:
        async with cancel_on_disconnect(job, request.receive):
            first = await job.next()
            samples = None if streaming or first is None else await collect(job, first)
    except BaseException:
        job.close("error")
        raise
    return job, first, samples
