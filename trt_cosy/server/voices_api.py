"""``GET/POST/DELETE /v1/voices``: upload a reference recording once, speak in it by name."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated

import anyio
from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser

from ..errors import InputError
from ..frontend.voice import Voice
from ..synthesis import check_text
from .errors import APIError
from .state import ServerState
from .voices_store import check_name

__all__ = ["voices_router"]

_LOGGER = logging.getLogger(__name__)

_COPY_BLOCK = 1 << 16


_VOICE_HINT = "3-10 s of speech"


def _audio_seconds(path: Path, hint: str = _VOICE_HINT) -> float:
    """The duration of an uploaded file; 400 when it is not audio libsndfile can read (the message asks
    for a recording of ``hint``)."""
    import soundfile

    try:
        info = soundfile.info(str(path))
    except Exception as exc:  # libsndfile raises several types for garbage
        raise APIError(
            400,
            f"the uploaded file is not audio that can be read ({type(exc).__name__}); send a wav, flac "
            f"or ogg recording of {hint}.",
            "invalid_audio",
            "file",
        ) from None
    if info.samplerate <= 0 or info.frames <= 0:
        raise APIError(400, "the uploaded audio has no samples.", "invalid_audio", "file")
    return info.frames / info.samplerate


class InvalidFormField(HTTPException):
    """A form field that is not text in the declared charset (UTF-8 unless the request says otherwise).

    An ``HTTPException`` because FastAPI re-raises those from body parsing; ``code`` and ``param``
    reach the JSON error body (``app._add_error_handlers``).
    """

    def __init__(self, field: str, charset: str):
        super().__init__(
            400,
            f"the form field {field!r} is not valid {charset} text; send it encoded as {charset}.",
        )
        self.code = "invalid_form_encoding"
        self.param = field


class _StrictMultiPartParser(MultiPartParser):
    """Starlette's parser, except that a field whose bytes are not valid in the charset is refused
    (Starlette silently decodes those as latin-1, which stores mojibake)."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is None:
            try:
                bytes(part.data).decode(self._charset)
            except UnicodeDecodeError:
                raise InvalidFormField(part.field_name, self._charset) from None
        super().on_part_end()


class _StrictFormRequest(Request):
    async def _get_form(self, *, max_files=1000, max_fields=1000, max_part_size=1024 * 1024):
        content_type = self.headers.get("content-type", "")
        if self._form is None and content_type.lower().startswith("multipart/form-data"):
            parser = _StrictMultiPartParser(
                self.headers,
                self.stream(),
                max_files=max_files,
                max_fields=max_fields,
                max_part_size=max_part_size,
            )
            try:
                self._form = await parser.parse()
            except MultiPartException as exc:
                raise HTTPException(400, f"the multipart body is malformed: {exc.message}") from None
        return await super()._get_form(
            max_files=max_files, max_fields=max_fields, max_part_size=max_part_size
        )


class _StrictFormRoute(APIRoute):
    """A route whose multipart form fields must decode in their charset (400 ``invalid_form_encoding``)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_handler(request: Request):
            return await handler(_StrictFormRequest(request.scope, request.receive))

        return strict_handler


async def save_recording(
    upload: UploadFile,
    limit: int,
    folder: Path,
    max_seconds: float,
    what: str,
    advice: str,
    hint: str = _VOICE_HINT,
) -> tuple[Path, float]:
    """The upload saved in ``folder`` (``_save_upload``: at most ``limit`` bytes) and its duration; 400
    when it is not readable audio or longer than ``max_seconds`` (the message names ``what`` it is
    and gives ``advice``; an unreadable or oversized file is asked to be ``hint``)."""
    path = await _save_upload(upload, limit, folder, hint)
    seconds = await anyio.to_thread.run_sync(_audio_seconds, path, hint)
    if seconds > max_seconds:
        raise APIError(
            400,
            f"{what} is {seconds:.1f} s long; at most {max_seconds:g} s is accepted. {advice}",
            "audio_too_long",
            "file",
        )
    return path, seconds


@contextlib.asynccontextmanager
async def staged_recording(
    state: ServerState,
    upload: UploadFile,
    kind: str,
    max_seconds: float,
    what: str,
    advice: str,
    hint: str = _VOICE_HINT,
) -> AsyncIterator[tuple[Path, float]]:
    """``save_recording`` of ``upload`` (at most ``max_upload_bytes``) in a fresh staging folder of the
    voices store (``kind`` names it), removed when the block ends; a crash leaves it to
    ``VoiceStore.load`` to clean."""
    staging = await anyio.to_thread.run_sync(state.store.staging_dir, kind)
    try:
        yield await save_recording(
            upload, state.settings.max_upload_bytes, staging, max_seconds, what, advice, hint
        )
    finally:
        shutil.rmtree(staging, ignore_errors=True)


async def _save_upload(upload: UploadFile, limit: int, folder: Path, hint: str = _VOICE_HINT) -> Path:
    """Copy the upload to a private file in ``folder``, refusing more than ``limit`` bytes (413; the
    message asks for ``hint``)."""
    handle, name = tempfile.mkstemp(
        prefix="upload-", suffix=Path(upload.filename or "").suffix[:8], dir=folder
    )
    size = 0
    try:
        with os.fdopen(handle, "wb") as sink:
            while block := await upload.read(_COPY_BLOCK):
                size += len(block)
                if size > limit:
                    raise APIError(
                        413,
                        f"the audio file is larger than {limit} bytes; send {hint}.",
                        "file_too_large",
                        "file",
                    )
                sink.write(block)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise
    return Path(name)


def voices_router(state: ServerState) -> APIRouter:
    router = APIRouter(route_class=_StrictFormRoute)

    @router.get("/v1/voices")
    async def list_voices() -> dict:
        return {"object": "list", "data": [stored.describe() for stored in state.store.list()]}

    @router.get("/v1/voices/{name}")
    async def get_voice(name: str) -> dict:
        return state.store.get(check_name(name)).describe()

    @router.post("/v1/voices", status_code=201)
    async def create_voice(
        file: Annotated[UploadFile, File(description="Reference recording (wav/flac/ogg, 1-30 s).")],
        name: Annotated[str, Form(description="Name to store the voice under.")],
        text: Annotated[
            str | None, Form(description="Its transcript (zero-shot); none: cross-lingual.")
        ] = None,
        overwrite: bool = False,
    ) -> JSONResponse:
        state.require_ready()
        settings = state.settings
        state.store.check_free(name, overwrite)
        if text is not None and len(text) > settings.max_input_chars:
            raise APIError(
                400, f"text is longer than {settings.max_input_chars} characters.", "text_too_long", "text"
            )
        if text is not None:
            try:
                check_text(text, "text")
            except InputError as exc:
                raise APIError(400, str(exc), "invalid_text", "text") from None
        recording = staged_recording(
            state, file, "upload", settings.max_upload_seconds, "the recording", "Trim it to 3-10 s of clear speech."
        )
        async with recording as (path, _):
            slot = await state.admission.acquire(settings.request_timeout_s)
            try:
                voice = await anyio.to_thread.run_sync(state.tts.voice_from_wav, path, text)
            except InputError as exc:  # too short, silent...: say so without the temp file's path
                raise APIError(
                    400, str(exc).replace(str(path), "the uploaded file"), "invalid_audio", "file"
                ) from None
            else:  # in the same slot: its first request then does no prompt work
                await anyio.to_thread.run_sync(_prepare, state, voice)
            finally:
                slot.release()
        stored = await anyio.to_thread.run_sync(state.store.add, name, voice, overwrite)
        return JSONResponse(stored.describe(), status_code=201)

    @router.delete("/v1/voices/{name}")
    async def delete_voice(name: str) -> dict:
        await anyio.to_thread.run_sync(state.store.delete, name)
        return {"id": name, "object": "voice", "deleted": True}

    return router


def _prepare(state: ServerState, voice: Voice) -> None:
    """The flow's prompt prefix of an uploaded voice, computed now (``CosyVoice.prepare_voice``); a
    failure here costs only the speed of its first request, never the upload."""
    prepare = getattr(state.tts, "prepare_voice", None)
    if prepare is None:
        return
    try:
        prepare(voice)
    except Exception as exc:  # the voice is stored and valid; its first request computes the prefix
        _LOGGER.warning("could not precompute the uploaded voice's flow prefix: %r", exc)
