"""``POST /v1/audio/conversions``: voice conversion (official ``inference_vc``), speech in, the same words
in a stored voice out.

Multipart form: ``file`` (the source recording: wav/flac/ogg, any rate from 8 kHz, up to
``max_source_seconds``), ``voice`` (a stored voice's name), ``response_format`` (as the speech route),
``stream`` (chunks as they are made, wav/pcm), ``seed``, ``speed`` (0.25-4.0, the official
``inference_vc(speed=)``: each window's mel stretched, so a window is sent whole). The same limits as
the speech route and the voice uploads: the upload's bytes (413) and duration (400), authentication,
429 when the queue is full, 503/504 on timeouts, a client that leaves cancels the work. ElevenLabs
names the same thing ``POST /v1/speech-to-speech/{voice_id}``; this path sits beside OpenAI's
``/v1/audio/speech``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Annotated

import anyio
from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response

from ..errors import InputError
from ..synthesis import SynthesisConfig
from .audio_encoding import check_format, content_type
from .audio_stream import audio_stream
from .errors import APIError
from .jobs import start_job
from .speech import SynthesisResponse
from .state import ServerState
from .streaming_encoders import encode_file, open_encoder, streams_incrementally
from .voices_api import _StrictFormRoute, staged_recording

__all__ = ["CONVERSIONS_PATH", "conversions_router"]

_LOGGER = logging.getLogger(__name__)

CONVERSIONS_PATH = "/v1/audio/conversions"
_SOURCE_HINT = (
    "speech of at least 0.5 s (flac or ogg are smaller than wav; a long recording may be sent in parts)"
)


def conversions_router(state: ServerState) -> APIRouter:
    router = APIRouter(route_class=_StrictFormRoute)

    @router.post(CONVERSIONS_PATH)
    async def create_conversion(
        request: Request,
        file: Annotated[UploadFile, File(description="The source recording (wav/flac/ogg, >= 8 kHz).")],
        voice: Annotated[str, Form(description="The stored voice to speak in.")],
        response_format: Annotated[str, Form()] = "wav",
        stream: Annotated[bool, Form()] = False,
        seed: Annotated[int | None, Form(ge=0)] = None,
        speed: Annotated[float, Form()] = 1.0,
    ) -> Response:
        """The words, timing and intonation of ``file`` spoken in ``voice``."""
        received_at = time.perf_counter()
        state.require_ready()
        settings = state.settings
        check_format(response_format, state.formats)
        if not math.isfinite(speed) or not 0.25 <= speed <= 4.0:
            raise APIError(
                400, f"speed must be between 0.25 and 4.0, got {speed!r}.", "invalid_speed", "speed"
            )
        target = state.store.get(voice).voice
        streaming = stream and streams_incrementally(response_format)
        recording = staged_recording(
            state, file, "conversion", settings.max_source_seconds, "the source", "Send it in parts.", _SOURCE_HINT
        )
        async with recording as (path, seconds):
            # the official speed path stretches a whole window's mel: not streamed (as the speech route)
            config = SynthesisConfig(stream=streaming and speed == 1.0, speed=speed)
            try:  # reads and checks the source now (silent, too short...); tokenising is lazy
                chunks = await anyio.to_thread.run_sync(
                    lambda: state.tts.convert(path, target, seed, config, settings.max_source_seconds)
                )
            except InputError as exc:
                message = str(exc).replace(str(path), "the uploaded file")
                raise APIError(400, message, "invalid_audio", "file") from None
        job, first, samples = await start_job(
            state,
            request,
            chunks,
            lambda left_s: state.work.admit_conversion(request.scope, seconds, streaming, left_s),
            received_at,
            streaming,
        )
        if job.cancelled or (first is not None and not streaming and samples is None):
            raise APIError(499, "the client closed the request.", "client_closed")
        if first is None:  # cannot happen: a conversion has at least one window
            raise APIError(500, "the engine produced no audio for this source.", "no_audio")
        headers = {"X-Sample-Rate": str(first.sample_rate)}
        media_type = content_type(response_format)
        if streaming:
            try:
                encoder = open_encoder(response_format, first.sample_rate)
            except BaseException:
                job.close("error")
                raise
            return SynthesisResponse(
                job, audio_stream(job, first, encoder), media_type=media_type, headers=headers
            )
        data = await anyio.to_thread.run_sync(encode_file, samples, first.sample_rate, response_format)
        return Response(data, media_type=media_type, headers=headers)

    return router
