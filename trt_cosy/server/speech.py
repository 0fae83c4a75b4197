"""``POST /v1/audio/speech`` (OpenAI's body) and ``POST /tts`` (simple): text in, audio out."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Literal

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..synthesis import SynthesisConfig
from .audio_encoding import STREAMING_FORMATS, check_format, content_type, encode_audio
from .errors import APIError
from .jobs import SynthesisJob, cancel_on_disconnect, collect, stream_body
from .state import ServerState

__all__ = ["SpeechRequest", "SimpleTTSRequest", "speech_router"]

_LOGGER = logging.getLogger(__name__)

_ENGINE_STREAMS = "stream" in {item.name for item in dataclasses.fields(SynthesisConfig)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class VoiceRef(_Strict):
    id: str


class SpeechRequest(_Strict):
    """OpenAI's speech body. ``voice`` names a stored voice (a string or ``{"id": name}``)."""

    input: str
    voice: str | VoiceRef
    model: str = "cosyvoice2"
    response_format: str | None = None
    speed: float = 1.0
    stream: bool | None = None  # None: the server's ``stream_speech`` setting (True unless changed)
    stream_format: Literal["audio", "sse"] | None = None
    instructions: str | None = None
    seed: int | None = Field(default=None, ge=0)


class SimpleTTSRequest(_Strict):
    """``POST /tts``: the plain form; one complete file unless ``stream`` is true."""

    text: str
    voice: str
    format: str = "wav"
    stream: bool = False
    seed: int | None = Field(default=None, ge=0)


class SynthesisResponse(StreamingResponse):
    """A streaming response that always closes its job, even when the body never started."""

    def __init__(self, job: SynthesisJob, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.close("disconnect")  # a no-op when the synthesis completed


def _synthesis_config(speed: float, stream: bool, max_segment_tokens: int) -> SynthesisConfig:
    if not math.isfinite(speed) or not 0.25 <= speed <= 4.0:
        raise APIError(400, f"speed must be between 0.25 and 4.0, got {speed!r}.", "invalid_speed", "speed")
    if speed != 1.0:
        # Only what the engine supports: SynthesisConfig refuses other speeds with a message.
        try:
            return SynthesisConfig(speed=speed, max_text_tokens=max_segment_tokens)
        except Exception as exc:
            raise APIError(400, str(exc), "unsupported_speed", "speed") from None
    return SynthesisConfig(stream=stream and _ENGINE_STREAMS, max_text_tokens=max_segment_tokens)


async def _synthesize(
    state: ServerState,
    request: Request,
    text: str,
    voice_name: str,
    response_format: str,
    stream: bool,
    seed: int | None,
    speed: float = 1.0,
) -> Response:
    received_at = time.perf_counter()
    state.require_ready()
    settings = state.settings
    check_format(response_format, state.formats)
    if len(text) > settings.max_input_chars:
        raise APIError(
            400,
            f"input is {len(text)} characters; at most {settings.max_input_chars} are accepted. "
            "Send the text in parts.",
            "input_too_long",
            "input",
        )
    voice = state.store.get(voice_name).voice
    streaming = stream and response_format in STREAMING_FORMATS
    config = _synthesis_config(speed, streaming, settings.max_segment_tokens)
    # Checks the text (normalises and tokenises it) at once; InputError becomes a 400. Lazy after that.
    chunks = await anyio.to_thread.run_sync(lambda: state.tts.synthesize(text, voice, seed, config))
    try:
        # Refused at once (503/413) when it would not finish in time with the work admitted.
        left_s = settings.request_timeout_s - (time.perf_counter() - received_at)
        work = state.work.admit(request.scope, chunks, streaming, left_s) if state.work else None
        try:
            slot = await state.admission.acquire(settings.request_timeout_s)
        except BaseException:
            if work is not None:
                work.close(completed=False)
            raise
    except BaseException:
        chunks.close()
        raise
    job = SynthesisJob(chunks, slot, state.metrics, received_at, settings.request_timeout_s, work)
    try:
        # A client that leaves cancels the work at once (mid-chunk), streamed or not.
        async with cancel_on_disconnect(job, request.receive):
            first = await job.next()
            samples = None if streaming or first is None else await collect(job, first)
    except BaseException:
        job.close("error")
        raise
    if job.cancelled:
        raise APIError(499, "the client closed the request.", "client_closed")
    if first is None:  # cannot happen with CosyVoice (a request has at least one segment)
        raise APIError(500, "the engine produced no audio for this text.", "no_audio")
    sample_rate = first.sample_rate
    headers = {"X-Sample-Rate": str(sample_rate)}
    media_type = content_type(response_format)
    if streaming:
        body = stream_body(job, first, response_format, sample_rate)
        return SynthesisResponse(job, body, media_type=media_type, headers=headers)
    if samples is None:
        raise APIError(499, "the client closed the request.", "client_closed")
    data = await anyio.to_thread.run_sync(encode_audio, samples, sample_rate, response_format)
    return Response(data, media_type=media_type, headers=headers)


def speech_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    default_format = "mp3" if "mp3" in state.formats else "wav"

    @router.post("/v1/audio/speech")
    async def create_speech(body: SpeechRequest, request: Request) -> Response:
        """OpenAI-compatible speech: wav/pcm stream as they are made (as OpenAI's do) unless ``stream`` is false."""
        if body.stream_format == "sse":
            raise APIError(
                400, "stream_format 'sse' is not supported; use 'audio'.", "unsupported_stream_format"
            )
        if body.instructions:
            raise APIError(
                400,
                "instructions are not supported by this server; leave them out.",
                "unsupported_param",
                "instructions",
            )
        voice = body.voice if isinstance(body.voice, str) else body.voice.id
        if body.stream is not None:
            stream = body.stream
        else:
            stream = body.stream_format == "audio" or state.settings.stream_speech
        response_format = body.response_format or default_format
        return await _synthesize(
            state, request, body.input, voice, response_format, stream, body.seed, body.speed
        )

    @router.post("/tts")
    async def simple_tts(body: SimpleTTSRequest, request: Request) -> Response:
        """Speak ``text`` in the stored ``voice`` as ``format`` (wav by default)."""
        return await _synthesize(state, request, body.text, body.voice, body.format, body.stream, body.seed)

    return router
