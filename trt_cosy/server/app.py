"""The FastAPI app: ``create_app(tts, settings)`` wires routes, limits, errors, metrics and warm-up.

    app = create_app(CosyVoice.load(engines), ServerSettings(voices_dir="voices"))
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: ``POST /v1/audio/speech`` (OpenAI), ``POST /tts``, ``POST /v1/audio/conversions`` (voice
conversion), ``GET /v1/models``,
``GET/POST/DELETE /v1/voices``, ``GET /health``, ``GET /metrics`` and the web playground at ``GET /``.
Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}``. With
``settings.api_key`` every route but ``/health`` and the page needs ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Final

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InputError
from ..runtime.heap import return_large_blocks
from ..version import __version__
from .access_log import AccessLog
from .audio_encoding import available_formats
from .auth import BearerAuth
from .conversions import CONVERSIONS_PATH, conversions_router
from .errors import RETRY_WARMING_S, APIError, error_body, validation_message
from .limits import Admission, BodySizeLimit
from .metrics import Metrics, MetricsMiddleware, exposition_for, path_label
from .playground import playground_router
from .settings import ServerSettings
from .speech import speech_router
from .speech_stream import speech_stream_router
from .state import ServerState
from .timeouts import BodyReadTimeout
from .voices_api import voices_router
from .voices_store import VoiceStore
from .work_admission import ServerWork
from .work_model import warm_up

__all__ = ["create_app", "warm_up"]

_LOGGER = logging.getLogger(__name__)

_UPLOAD_SLACK: Final = 64 * 1024  # multipart framing and the form fields around the file


def create_app(tts: Any, settings: ServerSettings) -> FastAPI:
    """The server app for a loaded engine (``CosyVoice``); voices are read from ``settings.voices_dir``."""
    return_large_blocks()  # RSS returns after bursts of long requests ("Memory under load")
    metrics = Metrics()
    state = ServerState(
        tts=tts,
        settings=settings,
        store=VoiceStore(settings.voices_dir, getattr(tts, "model_id", "")),
        metrics=metrics,
        admission=Admission(settings.max_concurrent, settings.max_queue, metrics),
        formats=available_formats(),
        work=ServerWork(tts, settings, metrics),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await anyio.to_thread.run_sync(state.store.load)
        async with anyio.create_task_group() as group:
            group.start_soon(_warm_up, state)
            yield
            group.cancel_scope.cancel()

    app = FastAPI(title="trt-cosy", version=__version__, lifespan=lifespan)
    app.state.server = state
    _add_error_handlers(app, metrics)
    app.include_router(speech_router(state))
    app.include_router(speech_stream_router(state))
    app.include_router(voices_router(state))
    app.include_router(conversions_router(state))
    _add_info_routes(app, state)
    app.include_router(playground_router())
    upload_limit = settings.max_upload_bytes + _UPLOAD_SLACK

    def is_upload(path: str) -> bool:
        return path.startswith(("/v1/voices", CONVERSIONS_PATH))

    def limit_for(path: str) -> int:
        return upload_limit if is_upload(path) else settings.max_json_bytes

    def advice_for(path: str) -> str:
        if is_upload(path):
            return (
                f"the audio file may be at most {settings.max_upload_bytes} bytes (the server's "
                "max_upload_bytes); send a shorter recording, or flac or ogg (smaller than wav)."
            )
        return f"a JSON body may be at most {settings.max_json_bytes} bytes; send the text in parts."

    def refused(path: str) -> None:
        metrics.errors.labels(path_label(path), "body_too_large").inc()

    app.add_middleware(BodySizeLimit, limit_for=limit_for, on_refused=refused, advice_for=advice_for)
    app.add_middleware(BodyReadTimeout, timeout_s=settings.body_timeout_s)
    if settings.api_key is not None:  # before the body limit: a caller without the key gets 401, not 413

        def unauthorized(path: str, code: str) -> None:
            metrics.errors.labels(path_label(path), code).inc()

        app.add_middleware(BearerAuth, api_key=settings.api_key, on_refused=unauthorized)
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(AccessLog)
    return app


async def _warm_up(state: ServerState) -> None:
    if state.settings.warmup:
        try:
            runs = await anyio.to_thread.run_sync(warm_up, state.tts)
            if state.work is not None:
                state.work.calibrate(runs)
        except Exception as exc:
            state.warmup_error = f"{type(exc).__name__}: {exc}"
            _LOGGER.exception("warm-up failed; the server stays unready")
            return
    state.set_ready()
    _LOGGER.info("ready: %d voice(s), formats %s", len(state.store.list()), ", ".join(state.formats))


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        """200 once warm-up has finished; 503 while warming up or after a failed warm-up."""
        if state.ready:
            return JSONResponse(
                {"status": "ok", "model": state.settings.model_name, "voices": len(state.store.list())}
            )
        status = "failed" if state.warmup_error else "warming_up"
        message = state.warmup_error or "warming up"
        retry = {} if state.warmup_error else {"Retry-After": str(RETRY_WARMING_S)}
        return JSONResponse(
            {"status": status, **error_body(503, message, status)}, status_code=503, headers=retry
        )

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Prometheus exposition (text 0.0.4, or OpenMetrics when the scraper's Accept asks for it)."""
        body, content_type = exposition_for(state.metrics, request.headers.get("accept", ""))
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": state.settings.model_name, "object": "model", "created": 0, "owned_by": "trt-cosy"}
        return {"object": "list", "data": [entry]}


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def answer(
        request: Request,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> JSONResponse:
        metrics.errors.labels(path_label(request.url.path), code).inc()
        return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return answer(request, exc.status, exc.message, exc.code, exc.param, exc.headers)

    @app.exception_handler(InputError)
    async def input_error(request: Request, exc: InputError) -> JSONResponse:
        return answer(request, 400, str(exc), "invalid_input")

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(exc.errors()))
        return answer(request, 400, message, "invalid_request", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {
            400: "invalid_body",  # FastAPI's "There was an error parsing the body", malformed multipart
            404: "not_found",
            405: "method_not_allowed",
            408: "request_timeout",
            413: "body_too_large",
        }
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}; see GET /docs for the routes."
        code = getattr(exc, "code", None) or codes.get(exc.status_code, "http_error")
        return answer(request, exc.status_code, message, code, getattr(exc, "param", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        _LOGGER.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return answer(request, 500, "internal server error; see the server log.", "internal_error")
