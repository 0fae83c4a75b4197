"""Stage threads of one request: the LLM decodes in a worker thread while the caller renders audio.

``TokenFeed`` runs the speech LLM over every text segment of a request in its own thread and
publishes the tokens; the request's generator (``CosyVoice.synthesize``) waits for as many tokens
as the next chunk needs, renders flow + vocoder in the caller's thread, and yields. ONNX Runtime
releases the GIL while a graph runs, so the LLM's next tokens are decoded while the flow and the
vocoder render the previous chunk.

Stopping: ``close()`` (called when the generator is closed, garbage-collected or fails) sets a
stop flag that the worker checks between tokens, then joins it; at most one LLM step finishes after
the flag is set. An exception in the worker is re-raised in the thread that waits for tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Final, NamedTuple

import numpy as np

from .runtime import heap
from .runtime.render_turns import RENDER_TURNS, RenderTurns
from .runtime.run_scope import RunCancelled, RunScope
from .runtime.work_gate import RENDER_GATE, GateCancelled
from .stages.flow import FlowStage
from .stages.flow_incremental import FlowCache
from .stages.llm import LLMStage
from .stages.sampling import RASSampler
from .stages.speed import stretch_mel
from .stages.vocoder import VocoderCache, VocoderStage
from .streaming import OFFICIAL_SCHEDULE, ChunkPlan, HopSchedule, hop_schedule
from .synthesis import AudioChunk, LLMPrompt, Segment, llm_prompt, request_rngs
from .token_feed import Cancelled, TokenFeed

if TYPE_CHECKING:
    from .config import ModelConfig
    from .frontend.voice import Voice
    from .stages.bistream import BistreamPrompt, TextStream

__all__ = [
    "TokenFeed",
    "Cancelled",
    "Stages",
    "Request",
    "CancellableChunks",
    "render_chunk",
    "iterate_in_thread",
]

_LOGGER = logging.getLogger(__name__)


class Stages(NamedTuple):
    """The stateless stages one engine shares between all its requests."""

    llm: LLMStage
    flow: FlowStage
    vocoder: VocoderStage


def render_chunk(
    stages: Stages,
    voice: Voice,
    tokens: np.ndarray,
    plan: ChunkPlan,
    cache: VocoderCache,
    rng: np.random.Generator | np.ndarray,
    token_mel_ratio: int,
    flow_cache: FlowCache | None = None,
    speed: float = 1.0,
) -> tuple[np.ndarray, float, float]:
    """Flow + vocoder for one chunk (official ``token2wav``): (samples [N], flow s, vocoder s).

    The flow reruns on prompt + ``tokens[:plan.end]`` (chunk attention unless final); the frames
    from ``token_mel_ratio * plan.offset`` on are new and go to the vocoder with the request's cache.
    ``rng`` draws the vocoder's NSF noise (or is that noise, as ``VocoderStage.render`` takes it).
    ``flow_cache`` (the segment's ``FlowStage.new_cache()``): chunk-attention calls compute only the
    frames after the cached ones, with the same result. ``speed`` != 1 (a whole segment, ``plan.final``
    from offset 0, as officially): the mel is stretched in time before the vocoder (``stretch_mel``).
    """
    if plan.end == 0:  # the LLM stopped at once: nothing to say
        return np.zeros(0, np.float32), 0.0, 0.0
    start = time.perf_counter()
    mel = stages.flow.token2mel(
        tokens[None, : plan.end],  # [1, end]
        voice.speech_tokens.astype(np.int64)[None],  # [1, P]
        voice.prompt_mel[None],  # [1, 2P, 80]
        voice.speaker_embedding[None],  # [1, 192]
        streaming=plan.streaming,
        finalize=plan.final,
        cache=flow_cache,
    ).mel  # mel: [1, 80, 2 * (end - 3 unless final)]
    mel = mel[:, :, token_mel_ratio * plan.offset :]  # mel: [1, 80, F]
    if speed != 1.0:
        mel = stretch_mel(mel, speed)  # mel: [1, 80, int(F / speed)]
    flow_done = time.perf_counter()
    samples = stages.vocoder.render(mel, rng, cache, final=plan.final)[0]  # samples: [N]
    return samples, flow_done - start, time.perf_counter() - flow_done


class Request:
    """One synthesis request: every piece of per-request state, and its generator of chunks.

    This is the CosyVoice2 request; the other families (``trt_cosy.models.v1.request``, ``models.v3.request``) override
    the hooks ``_decode`` (speech tokens of a segment), ``_schedule`` (where chunks fall),
    ``_new_state`` (per-segment vocoder state), ``_render`` (flow + vocoder of one chunk) and
    ``_new_tokens`` (tokens a chunk speaks).

    Args:
        stages: the engine's shared stages.
        config: the model config (token/mel ratio, chunk size, look-ahead, sample rate).
        segments: the planned text segments.
        voice: the (checked) voice.
        seed: None for fresh entropy.
        stream: the official streaming schedule (several chunks per segment) or one chunk per segment.
        max_new_tokens: cap on speech tokens per segment (the flow's fixed noise must cover them).
        prompt: what the LLM gets besides the text (spec §2.4); None: ``llm_prompt(voice)``
            (zero-shot with a transcript, else cross-lingual).
        schedule: the streaming schedule of CosyVoice2/3 (``trt_cosy.streaming.SCHEDULES``).

    ``llm_yield`` (class attribute; set it on an instance before iterating to change one request):
    when the LLM worker pauses while this thread renders a chunk. ``"first"``: during the first
    chunk of the request, so first audio gets the cores alone; ``"always"``: during every chunk;
    ``"never"``: the stages share the cores. docs/benchmarks.md has the measurements behind the default.
    """

    llm_yield: str = "first"
    speed: float = 1.0
    """Speaking rate (``SynthesisConfig.speed``; set on the instance, non-streaming requests only)."""
    render_turns: RenderTurns | None = RENDER_TURNS
    """Renders of concurrent requests take turns (first chunks first); None: they run at once."""
    render_priority: tuple[int, int, int] | None = None
    text_stream: TextStream | None = None
    """Text that arrives while the request speaks (one segment; ``LLMStage.generate_bistream`` with
    ``bistream_prompt``); None: the segments' text is all there."""
    bistream_prompt: BistreamPrompt | None = None
    """This request's place in the render turns (``RenderTurns.turn``), from a server's admission
    (``server.admission.render_priority``); None: each render in its arrival order (requests share
    the turns)."""

    def __init__(
        self,
        stages: Stages,
        config: ModelConfig,
        segments: list[Segment],
        voice: Voice,
        seed: int | None,
        stream: bool,
        max_new_tokens: int,
        prompt: LLMPrompt | None = None,
        schedule: str = OFFICIAL_SCHEDULE,
    ):
        self.stages, self.config, self.segments, self.voice = stages, config, segments, voice
        self.stream = stream
        self.schedule = schedule
        self.max_new_tokens = max_new_tokens
        self.prompt = prompt if prompt is not None else LLMPrompt(*llm_prompt(voice))
        llm_rng, self.vocoder_rng = request_rngs(seed)
        self.sampler = RASSampler.from_config(config.llm, llm_rng)
        self.feed = TokenFeed(self._decode, len(segments))
        self.runs = RunScope()  # the flow/vocoder runs in progress, aborted by cancel()
        self.first_audio_s: float | None = None
        self._audio_s = 0.0
        self._flow_cache: FlowCache | None = None

    @property
    def flow_cache(self) -> FlowCache | None:
        """The current segment's incremental flow cache (None unless streaming with the incremental graph)."""
        return self._flow_cache

    def cancel(self) -> None:
        """Stop the work soon, from any thread: the LLM after its current step, a running flow or
        vocoder graph at its next node (backends that can abort a run); the generator then ends."""
        self.feed.cancel()
        self.runs.cancel()
        if self.text_stream is not None:
            self.text_stream.abort()  # the LLM worker may wait for text

    def _decode(self, index: int) -> Iterator[int]:
        """The speech tokens of segment ``index`` (lazy; runs in the LLM worker thread)."""
        prompt = self.prompt
        if self.text_stream is not None:
            return self.stages.llm.generate_bistream(
                self.text_stream, self.bistream_prompt, self.sampler, self.max_new_tokens
            )
        return self.stages.llm.generate(
            self.segments[index].ids, prompt.text_ids, prompt.speech_ids, self.sampler, self.max_new_tokens
        )

    def chunks(self) -> Iterator[AudioChunk]:
        """The request's audio (lazy: nothing runs until you iterate; closing it stops the work)."""
        started = time.perf_counter()
        count = 0
        try:
            for index in range(len(self.segments)):
                for chunk in self._segment_chunks(index, started, count):
                    count += 1
                    yield chunk
        except Cancelled:
            _LOGGER.debug("request cancelled")
        finally:
            if self.text_stream is not None:
                self.text_stream.abort()  # wakes the LLM worker if it waits for text
            self.feed.close()
            self._flow_cache = None  # a stopped segment's cache goes with it
            heap.trim()  # the request's freed blocks go back to the OS (servers: "Memory under load")
            _LOGGER.debug(
                "request %s after %d chunks, %.2f s of audio in %.3f s (first audio %s s)",
                "finished" if self.feed.finished_all else "stopped",
                count,
                self._audio_s,
                time.perf_counter() - started,
                "-" if self.first_audio_s is None else f"{self.first_audio_s:.3f}",
            )

    def _schedule(self) -> HopSchedule:
        """Where the chunks of one segment fall (CosyVoice2 hops of ``schedule``, or one final chunk)."""
        return hop_schedule(
            self.voice.speech_tokens.shape[0],
            self.stream,
            self._chunk_tokens(),
            self.config.flow.encoder.pre_lookahead_len,
            self.schedule,
        )

    def _chunk_tokens(self) -> int:
        """Speech tokens per streamed chunk: the flow encoder's ``static_chunk_size``."""
        return self.config.flow.encoder.static_chunk_size

    def _new_state(self) -> VocoderCache:
        """The vocoder state of one segment (cache and cross-fade tail)."""
        return VocoderCache()

    def _render(
        self, tokens: np.ndarray, plan: ChunkPlan, state: VocoderCache
    ) -> tuple[np.ndarray, float, float]:
        """Flow + vocoder of one chunk: (samples [N], flow s, vocoder s)."""
        return render_chunk(
            self.stages,
            self.voice,
            tokens,
            plan,
            state,
            self.vocoder_rng,
            self.config.token_mel_ratio,
            flow_cache=self._flow_cache,
            speed=self.speed,
        )

    @staticmethod
    def flow_tokens(plan: ChunkPlan) -> int:
        """Speech tokens the flow call of chunk ``plan`` takes: all of them so far (the flow recomputes
        from the first token, as officially; the mel from ``plan.offset`` on is new)."""
        return plan.end

    def _new_tokens(self, plan: ChunkPlan) -> int:
        """Speech tokens this chunk speaks (a non-final chunk's look-ahead tokens come again)."""
        return plan.end - plan.offset - (0 if plan.final else self.config.flow.encoder.pre_lookahead_len)

    def _segment_chunks(self, index: int, started: float, count: int) -> Iterator[AudioChunk]:
        schedule = self._schedule()
        cache = self._new_state()
        # The segment's incremental flow state (CosyVoice2 engines with the incremental graph).
        new_flow_cache = getattr(getattr(self.stages, "flow", None), "new_cache", None)
        self._flow_cache = new_flow_cache() if self.stream and new_flow_cache is not None else None
        while True:
            waited = time.perf_counter()
            tokens, finished = self.feed.wait(index, schedule.needed)  # tokens: [n]
            plan = schedule.next_chunk(tokens.size, finished)
            if plan is None:  # cannot happen: wait returns when the next chunk is ready
                continue
            rendered = time.perf_counter()
            # Bounded render work in flight (memory); cancel() aborts a flow or vocoder graph mid-run.
            weight = self.voice.speech_tokens.shape[0] + plan.end
            # The LLM worker pauses while the first chunk renders (llm_yield), so the flow gets the cores.
            hold = self.llm_yield == "always" or (self.llm_yield == "first" and self.first_audio_s is None)
            # A server's non-streamed request sends its audio whole: its first chunk is no first audio,
            # and holding the shared LLM would stall the next segments of requests served before it.
            hold = hold and (self.stream or self.render_priority is None)
            # A shared (batched) decode loop pauses too while a first chunk renders.
            loop_hold = getattr(self.stages.llm, "render_hold", None) if hold else None
            turns = self.render_turns
            try:
                with contextlib.ExitStack() as stack:
                    first = self.first_audio_s is None
                    cancelled = lambda: self.feed.cancelled  # noqa: E731
                    stack.enter_context(RENDER_GATE.hold(weight, cancelled, self.render_priority, first))
                    if turns is not None:
                        stack.enter_context(turns.turn(first, cancelled, self.render_priority, plan.end))
                    stack.enter_context(self.runs.active())
                    if loop_hold is not None:
                        stack.enter_context(loop_hold())
                    if hold:
                        self.feed.hold()
                    render_began = time.perf_counter()
                    try:
                        samples, flow_s, vocoder_s = self._render(tokens, plan, cache)
                    finally:
                        self.feed.release()
            except (RunCancelled, GateCancelled):
                raise Cancelled("the request was cancelled") from None
            if self.feed.cancelled:  # cancelled while rendering: drop the chunk, stop now
                raise Cancelled("the request was cancelled")
            is_last = plan.final and index == len(self.segments) - 1
            timings = self._timings(index, plan, samples, started, rendered - waited, flow_s, vocoder_s)
            timings["render_wait_s"] = render_began - rendered  # the render gate and turns
            timings["tokens_ready_s"] = rendered - started  # the chunk's tokens were there
            yield AudioChunk(
                samples=np.ascontiguousarray(samples, dtype=np.float32),
                sample_rate=self.config.sample_rate,
                index=count,
                is_last=is_last,
                timings=timings,
                text=self.segments[index].text,
                segment=index,
                segments=len(self.segments),
            )
            count += 1
            if plan.final:
                return

    def _timings(
        self,
        index: int,
        plan: ChunkPlan,
        samples: np.ndarray,
        started: float,
        wait_s: float,
        flow_s: float,
        vocoder_s: float,
    ) -> dict[str, float]:
        now = time.perf_counter()
        audio_s = samples.shape[0] / self.config.sample_rate
        self._audio_s += audio_s
        if self.first_audio_s is None:
            self.first_audio_s = now - started
            _LOGGER.debug("time to first audio: %.3f s", self.first_audio_s)
        new_tokens = self._new_tokens(plan)
        timings = {
            "llm_wait_s": wait_s,
            "llm_s": self.feed.llm_seconds(index),
            "flow_s": flow_s,
            "vocoder_s": vocoder_s,
            "tokens": float(new_tokens),
            "audio_s": audio_s,
            "first_audio_s": self.first_audio_s,
            "elapsed_s": now - started,
            "rtf": (now - started) / self._audio_s if self._audio_s > 0 else float("inf"),
        }
        _LOGGER.debug(
            "segment %d chunk [%d, %d)%s: %s",
            index,
            plan.offset,
            plan.end,
            " final" if plan.final else "",
            ", ".join(f"{key}={value:.3g}" for key, value in timings.items()),
        )
        return timings


class CancellableChunks(Iterator[AudioChunk]):
    """``Request.chunks()`` plus ``cancel()``, which another thread (a server's event loop) may call
    while this iterator runs in a worker: the LLM stops after its current step, and the iterator
    ends (``StopIteration``) at its next check, a chunk being rendered is dropped.

    ``close()`` is the generator's: only from the thread that iterates, or when it is idle.
    """

    def __init__(self, request: Request):
        self.request = request
        self._chunks = request.chunks()

    def __next__(self) -> AudioChunk:
        return next(self._chunks)

    @property
    def flow_cache(self) -> FlowCache | None:
        """The current segment's incremental flow cache (None unless streaming with the incremental graph)."""
        return self._flow_cache

    def cancel(self) -> None:
        """Stop the work soon (thread-safe, idempotent)."""
        self.request.cancel()

    def close(self) -> None:
        self._chunks.close()


_DONE: Final = object()


def _pump(
    request: Request, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, slots: threading.Semaphore
) -> None:
    """Thread body of ``iterate_in_thread``: run the request's generator, hand chunks to the loop.

    Only this thread touches the generator (closing a generator another thread runs would fail).
    ``slots`` keeps the producer at most one chunk ahead of the consumer.
    """

    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            request.cancel()

    chunks = request.chunks()
    try:
        while slots.acquire() and not request.feed.cancelled:
            chunk = next(chunks, _DONE)
            put(chunk)
            if chunk is _DONE:
                return
    except BaseException as exc:  # handed to the consumer
        put(exc)
    finally:
        chunks.close()


async def iterate_in_thread(request: Request) -> AsyncIterator[AudioChunk]:
    """The request's chunks for asyncio, computed in a worker thread.

    Errors of the work are raised here; when the consumer stops (``aclose``, ``break`` with
    ``contextlib.aclosing``, garbage collection) or its task is cancelled, the request is cancelled:
    the LLM stops after its current token and the worker thread ends after the current chunk.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    slots = threading.Semaphore(1)
    worker = threading.Thread(
        target=_pump, args=(request, loop, queue, slots), name="trt-cosy-request", daemon=True
    )
    worker.start()
    try:
        while True:
            item = await queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            slots.release()
            yield item
    finally:
        request.cancel()
        slots.release()  # wake the pump if it waits for the consumer
