"""``WS /v1/audio/speech/stream``: text in while audio comes out (CosyVoice2/3 text-in streaming).

Protocol (docs/server.md, "Streamed text"): the client sends JSON text frames, the server binary
audio frames and JSON text frames.

* client ``{"type": "start", "voice": NAME, "format": "pcm", "seed": 0, "instructions": ...}``
  (``format``: pcm (16-bit little-endian mono, the default), wav, or a compressed format the server
  streams; ``sample_rate``: leave it out or give the model's rate) -> server ``{"type": "started",
  "sample_rate": 24000, "format": "pcm", "voice": NAME}``;
* client ``{"type": "text", "text": "a few words "}`` as often as it likes, then ``{"type": "end"}``;
  the pieces are spoken as they come (``stages.bistream``: tokenised one by one, not normalised);
* server: binary frames of audio as soon as each chunk exists, then ``{"type": "done", ...counts and
  timings}`` and close 1000.

The limits of ``POST /v1/audio/speech`` hold: the API key (``Authorization: Bearer``, or from a browser
the subprotocol ``bearer.<key>``; without it the handshake is refused),
``max_input_chars`` over all pieces, a synthesis slot of ``max_concurrent`` (``max_queue`` may wait;
more: 4429), ``request_timeout_s`` for the whole stream, and ``body_timeout_s`` as the longest pause
between two client messages before ``end``. An error sends ``{"type": "error", "error": {message,
type, param, code}}`` and closes with 4000 + the HTTP status of the same error (4400, 4404, 4408,
4413, 4429, 4503, 4504), 1003 for a binary frame, 1007 for a frame that is not a JSON message, 1011
for a server fault. A client that leaves cancels its synthesis at once and frees its slot.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Final

import anyio
from fastapi import APIRouter, WebSocket
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.websockets import WebSocketDisconnect, WebSocketState

from ..errors import InputError
from ..stages.bistream import TextStream
from ..synthesis import SynthesisConfig
from .audio_encoding import check_format
from .audio_stream import count_encoding, encoded, finished, first_pieces
from .auth import WS_KEY_PREFIX
from .errors import APIError, error_body
from .jobs import SynthesisJob
from .state import ServerState
from .streaming_encoders import open_encoder, streams_incrementally
from .voice_names import resolve_voice

__all__ = ["STREAM_PATH", "speech_stream_router"]

_LOGGER = logging.getLogger(__name__)

STREAM_PATH: Final = "/v1/audio/speech/stream"
CLOSE_NORMAL: Final = 1000
CLOSE_UNSUPPORTED_DATA: Final = 1003  # a binary frame from the client
CLOSE_INVALID_PAYLOAD: Final = 1007  # not a JSON message
CLOSE_INTERNAL: Final = 1011
_REASON_BYTES: Final = 120  # a close reason is at most 123 bytes


class StartMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: str
    voice: str
    format: str = "pcm"
    sample_rate: int | None = None
    seed: int | None = Field(default=None, ge=0)
    instructions: str | None = None


class StreamError(Exception):
    """Ends the stream: an error frame (unless the client is gone), then a close with ``close_code``."""

    def __init__(self, close_code: int, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.close_code, self.status, self.message, self.code, self.param = (
            close_code,
            status,
            message,
            code,
            param,
        )

    @classmethod
    def of(cls, error: APIError) -> StreamError:
        return cls(4000 + error.status, error.status, error.message, error.code, error.param)


class _Playback:
    """Counts and timings of the audio sent, as a listener who plays it as it arrives would hear it."""

    def __init__(self) -> None:
        self.chunks = 0
        self.audio_s = 0.0
        self.first_at: float | None = None
        self.longest_gap_s = 0.0  # between two chunks sent
        self.stall_s = 0.0  # total silence a listener would hear after the first audio
        self.longest_stall_s = 0.0
        self._last_at: float | None = None
        self._played_until = 0.0

    def sent(self, now: float, seconds: float) -> None:
        if self.first_at is None:
            self.first_at, self._played_until = now, now
        if self._last_at is not None:
            self.longest_gap_s = max(self.longest_gap_s, now - self._last_at)
        stall = max(0.0, now - self._played_until)
        self.stall_s += stall
        self.longest_stall_s = max(self.longest_stall_s, stall)
        self._played_until = max(self._played_until, now) + seconds
        self._last_at = now
        self.chunks += 1
        self.audio_s += seconds


class _Session:
    """One WebSocket's streamed synthesis."""

    def __init__(self, state: ServerState, websocket: WebSocket):
        self.state, self.ws = state, websocket
        self.settings = state.settings
        self.opened_at = time.perf_counter()
        self.text: TextStream | None = None
        self.job: SynthesisJob | None = None
        self.failure: StreamError | None = None
        self.gone = False  # the client disconnected

    async def run(self) -> None:
        try:
            await self._serve()
        except StreamError as error:
            await self._fail(error)
        except WebSocketDisconnect:
            self.gone = True
        except Exception as exc:  # a server fault: the client gets 1011, the log the trace
            _LOGGER.exception("streamed synthesis failed")
            await self._fail(StreamError(CLOSE_INTERNAL, 500, f"the server failed: {exc}", "server_error"))
        finally:
            if self.job is not None:
                self.job.close("disconnect" if self.gone else ("error" if self.failure else None))
            if self.text is not None:
                self.text.abort()

    async def _serve(self) -> None:
        start = await self._start_message()
        settings, state = self.settings, self.state
        try:
            state.require_ready()
            fmt = check_format(start.format, state.formats)
        except APIError as error:
            raise StreamError.of(error) from None
        if not streams_incrementally(fmt):
            raise StreamError(
                4400,
                400,
                f"format {fmt!r} cannot be streamed; use pcm or wav.",
                "unsupported_format",
                "format",
            )
        tts = state.tts
        rate = int(tts.sample_rate)
        if start.sample_rate is not None and start.sample_rate != rate:
            raise StreamError(
                4400,
                400,
                f"this model speaks at {rate} Hz; leave sample_rate out or give {rate}.",
                "unsupported_sample_rate",
                "sample_rate",
            )
        if start.instructions is not None and len(start.instructions) > settings.max_instructions_chars:
            raise StreamError(
                4400,
                400,
                f"instructions are longer than {settings.max_instructions_chars} characters.",
                "instructions_too_long",
                "instructions",
            )
        try:
            voice = resolve_voice(state.store, settings, start.voice).voice
        except APIError as error:
            raise StreamError.of(error) from None
        self.text = TextStream(tts.tokenizer.encode)
        instruct = start.instructions if start.instructions and start.instructions.strip() else None
        config = SynthesisConfig(stream=True, instruct=instruct, max_text_tokens=settings.max_segment_tokens)
        try:
            chunks = await anyio.to_thread.run_sync(
                lambda: tts.synthesize(self.text, voice, start.seed, config)
            )
        except InputError as exc:
            raise StreamError(4400, 400, str(exc), "invalid_request") from None
        try:
            slot = await state.admission.acquire(settings.request_timeout_s)
        except APIError as error:
            chunks.close()
            raise StreamError.of(error) from None
        self.job = SynthesisJob(chunks, slot, state.metrics, self.opened_at, settings.request_timeout_s)
        encoder = open_encoder(fmt, rate)
        await self.ws.send_json({"type": "started", "sample_rate": rate, "format": fmt, "voice": start.voice})
        playback = _Playback()
        async with anyio.create_task_group() as group:
            group.start_soon(self._read_text)
            try:
                await self._write_audio(encoder, playback)
            finally:
                group.cancel_scope.cancel()
                encoder.close()
        if self.failure is not None:
            raise self.failure
        if self.gone:
            return
        await self.ws.send_json(self._done(playback))
        await self.ws.close(CLOSE_NORMAL)

    async def _start_message(self) -> StartMessage:
        message = await self._receive(self.settings.body_timeout_s)
        if message.get("type") != "start":
            raise StreamError(
                4400,
                400,
                'the first message must be {"type": "start", "voice": ...}.',
                "expected_start",
                "type",
            )
        try:
            return StartMessage.model_validate(message)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first.get("loc", ()))
            raise StreamError(
                4400, 400, f"bad start message: {where}: {first.get('msg')}", "invalid_start", where or None
            ) from None

    async def _receive(self, idle_s: float) -> dict[str, Any]:
        """The client's next JSON message (StreamError for the bad ones, 4408 after ``idle_s`` of silence)."""
        with anyio.move_on_after(idle_s) as waited:
            frame = await self.ws.receive()
        if waited.cancelled_caught:
            raise StreamError(
                4408,
                408,
                f"no message for {idle_s:g} s; send text more often or end the stream.",
                "idle_timeout",
            )
        if frame["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(frame.get("code", 1000))
        if frame.get("bytes") is not None:
            raise StreamError(
                CLOSE_UNSUPPORTED_DATA,
                400,
                "binary frames are not accepted; send JSON text messages.",
                "binary_frame",
            )
        try:
            message = json.loads(frame.get("text") or "")
        except json.JSONDecodeError:
            message = None
        if not isinstance(message, dict):
            raise StreamError(
                CLOSE_INVALID_PAYLOAD,
                400,
                'every message must be a JSON object such as {"type": "text", "text": "..."}.',
                "invalid_json",
            )
        return message

    async def _read_text(self) -> None:
        """The client's pieces into the text stream until ``end``; after it, anything is an error."""
        text, job = self.text, self.job
        assert text is not None and job is not None
        limit = self.settings.max_input_chars
        try:
            while True:
                message = await self._receive(
                    self.settings.body_timeout_s if not text.ended else float("inf")
                )
                kind = message.get("type")
                if text.ended:
                    raise StreamError(
                        4400,
                        400,
                        "a message came after end; start a new stream for more text.",
                        "text_after_end",
                    )
                if kind == "end":
                    text.end()
                elif kind == "text":
                    piece = message.get("text")
                    if not isinstance(piece, str):
                        raise StreamError(
                            4400, 400, 'a text message needs "text": a string.', "invalid_text", "text"
                        )
                    if text.chars + len(piece) > limit:
                        raise StreamError(
                            4413,
                            413,
                            f"the text is longer than {limit} characters; end this stream and start another.",
                            "input_too_long",
                            "text",
                        )
                    try:
                        text.put(piece)
                    except InputError as exc:
                        raise StreamError(4400, 400, str(exc), "invalid_text", "text") from None
                else:
                    raise StreamError(
                        4400,
                        400,
                        f'unknown message type {kind!r}; send "text" or "end".',
                        "unknown_type",
                        "type",
                    )
        except StreamError as error:
            self.failure = error
            job.cancel("error")
        except WebSocketDisconnect:
            self.gone = True
            job.cancel("disconnect")

    async def _write_audio(self, encoder: Any, playback: _Playback) -> None:
        job = self.job
        assert job is not None
        try:
            while (chunk := await job.next()) is not None:
                pieces = first_pieces(encoder, chunk) if playback.chunks == 0 else [chunk.samples]
                playback.sent(time.perf_counter(), chunk.duration)
                for samples in pieces:
                    if data := await encoded(encoder, samples):
                        await self.ws.send_bytes(data)
            if job.cancelled:
                return
            if tail := await finished(encoder):
                await self.ws.send_bytes(tail)
        except APIError as error:  # the request timeout
            self.failure = self.failure or StreamError.of(error)
        except WebSocketDisconnect:
            self.gone = True
            job.cancel("disconnect")
        finally:
            count_encoding(job, encoder)

    def _done(self, playback: _Playback) -> dict[str, Any]:
        text = self.text
        assert text is not None
        now = time.perf_counter()
        first_piece = text.first_piece_at
        return {
            "type": "done",
            "chunks": playback.chunks,
            "audio_seconds": round(playback.audio_s, 4),
            "text_pieces": text.pieces,
            "text_chars": text.chars,
            "text_tokens": text.ids_received,
            "first_audio_s": None
            if playback.first_at is None or first_piece is None
            else round(playback.first_at - first_piece, 4),
            "after_last_text_s": None if text.last_piece_at is None else round(now - text.last_piece_at, 4),
            "longest_gap_s": round(playback.longest_gap_s, 4),
            "playback_stall_s": round(playback.stall_s, 4),
            "longest_stall_s": round(playback.longest_stall_s, 4),
            "elapsed_s": round(now - self.opened_at, 4),
        }

    async def _fail(self, error: StreamError) -> None:
        self.failure = self.failure or error
        if self.gone or self.ws.client_state == WebSocketState.DISCONNECTED:
            return
        body = {"type": "error", **error_body(error.status, error.message, error.code, error.param)}
        try:
            if self.ws.client_state == WebSocketState.CONNECTING:
                await self.ws.accept()
            await self.ws.send_json(body)
            await self.ws.close(
                error.close_code, error.message.encode("utf-8")[:_REASON_BYTES].decode("utf-8", "ignore")
            )
        except (WebSocketDisconnect, RuntimeError):  # the client left meanwhile
            self.gone = True


def speech_stream_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.websocket(STREAM_PATH)
    async def speech_stream(websocket: WebSocket) -> None:
        """Text in (JSON pieces), audio out (binary frames) while the text is still being written."""
        offered = [p for p in websocket.scope.get("subprotocols", ()) if p.startswith(WS_KEY_PREFIX)]
        await websocket.accept(
            subprotocol=offered[0] if offered else None
        )  # a browser's key: echoed, as it must be
        await _Session(state, websocket).run()

    return router
