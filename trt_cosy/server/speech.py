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

from ..family_lookup import family_named
from ..synthesis import SynthesisConfig
from .audio_encoding import check_format, content_type
from .audio_stream import SSE_HEADERS, audio_stream, sse_stream
from .errors import APIError
from .jobs import SynthesisJob, start_job
from .state import ServerState
from .streaming_encoders import encode_file, open_encoder, streams_incrementally
from .voice_names import resolve_voice

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
    speed: float = 1.0
    instructions: str | None = None


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


def _synthesis_config(
    speed: float, stream: bool, max_segment_tokens: int, instructions: str | None = None
) -> SynthesisConfig:
    if not math.isfinite(speed) or not 0.25 <= speed <= 4.0:
        raise APIError(400, f"speed must be between 0.25 and 4.0, got {speed!r}.", "invalid_speed", "speed")
    instruct = instructions if instructions and instructions.strip() else None
    if speed != 1.0:
        # Only what the engine supports: SynthesisConfig refuses other speeds with a message.
        try:
            return SynthesisConfig(speed=speed, max_text_tokens=max_segment_tokens, instruct=instruct)
        except Exception as exc:
            raise APIError(400, str(exc), "unsupported_speed", "speed") from None
    return SynthesisConfig(
        stream=stream and _ENGINE_STREAMS, max_text_tokens=max_segment_tokens, instruct=instruct
    )


def _input_tokens(tts: object, text: str) -> int:
    """Text tokens of ``text`` (the SSE usage); 0 for an engine without a tokenizer."""
    tokenizer = getattr(tts, "tokenizer", None)
    return int(tokenizer.count_tokens(text)) if tokenizer is not None else 0


async def _synthesize(
    state: ServerState,
    request: Request,
    text: str,
    voice_name: str,
    response_format: str,
    stream: bool,
    seed: int | None,
    speed: float = 1.0,
    instructions: str | None = None,
    sse: bool = False,
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
    if instructions is not None and len(instructions) > settings.max_instructions_chars:
        raise APIError(
            400,
            f"instructions are {len(instructions)} characters; at most {settings.max_instructions_chars} are "
            "accepted. Say how to speak in a sentence or two.",
            "instructions_too_long",
            "instructions",
        )
    family = getattr(state.tts, "family", None)  # a CosyVoice; a worker pool's stand-in may not say
    if instructions and instructions.strip() and family and not family_named(family).instructs_any_voice:
        raise APIError(
            400,
            "instructions need a CosyVoice2 or CosyVoice3 model: CosyVoice 1's instruct mode "
            "(CosyVoice-300M-Instruct) speaks only in its preset speakers, which this server does not "
            "serve. Leave instructions out.",
            "unsupported_param",
            "instructions",
        )
    voice = resolve_voice(state.store, settings, voice_name).voice
    # Encoded as the audio is made: wav and pcm always, the compressed formats with PyAV. Events
    # (sse) are a stream in any case; their deltas carry whatever the encoder has ready.
    incremental = streams_incrementally(response_format)
    streaming = sse or (stream and incremental)
    config = _synthesis_config(speed, stream and incremental, settings.max_segment_tokens, instructions)
    # Checks the text (normalises and tokenises it) at once; InputError becomes a 400. Lazy after that.
    chunks = await anyio.to_thread.run_sync(lambda: state.tts.synthesize(text, voice, seed, config))
    job, first, samples = await start_job(
        state,
        request,
        chunks,
        lambda left_s: state.work.admit(request.scope, chunks, streaming, left_s),
        received_at,
        streaming,
    )
    if job.cancelled:
        raise APIError(499, "the client closed the request.", "client_closed")
    if first is None:  # cannot happen with CosyVoice (a request has at least one segment)
        raise APIError(500, "the engine produced no audio for this text.", "no_audio")
    sample_rate = first.sample_rate
    headers = {"X-Sample-Rate": str(sample_rate)}
    media_type = content_type(response_format)
    if streaming:
        try:
            encoder = open_encoder(response_format, sample_rate)
        except BaseException:
            job.close("error")
            raise
        if sse:
            body = sse_stream(job, first, encoder, _input_tokens(state.tts, text))
            headers.update(SSE_HEADERS)
            return SynthesisResponse(job, body, media_type="text/event-stream", headers=headers)
        return SynthesisResponse(job, audio_stream(job, first, encoder), media_type=media_type, headers=headers)
    if samples is None:
        raise APIError(499, "the client closed the request.", "client_closed")
    data = await anyio.to_thread.run_sync(encode_file, samples, sample_rate, response_format)
    return Response(data, media_type=media_type, headers=headers)


def speech_router(state: ServerState) -> APIRouter:
    router = APIRouter()
    default_format = "mp3" if "mp3" in state.formats else "wav"

    @router.post("/v1/audio/speech")
    async def create_speech(body: SpeechRequest, request: Request) -> Response:
        """OpenAI-compatible speech: every format streams as it is made (as OpenAI's do) unless ``stream`` is
        false; ``stream_format: "sse"`` sends OpenAI's events (base64 deltas, then done with usage)."""
        voice = body.voice if isinstance(body.voice, str) else body.voice.id
        if body.stream is not None:
            stream = body.stream
        else:
            stream = body.stream_format is not None or state.settings.stream_speech
        response_format = body.response_format or default_format
        return await _synthesize(
            state,
            request,
            body.input,
            voice,
            response_format,
            stream,
            body.seed,
            body.speed,
            body.instructions,
            sse=body.stream_format == "sse",
        )

    @router.post("/tts")
    async def simple_tts(body: SimpleTTSRequest, request: Request) -> Response:
        """Speak ``text`` in the stored ``voice`` as ``format`` (wav by default)."""
        return await _synthesize(
            state,
            request,
            body.text,
            body.voice,
            body.format,
            body.stream,
            body.seed,
            body.speed,
            body.instructions,
        )

    return router
