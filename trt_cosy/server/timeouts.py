"""Slow clients: a deadline for a request's headers and for every read of its body.

Uvicorn has a keep-alive timeout (idle between requests) but none while a request arrives, so a
client that sends half its headers, or declares ``Content-Length: 100`` and sends 10 bytes, holds
a connection (and, for the body, a request task) forever. Two guards close that gap:

- ``header_timeout_protocol(seconds)``: uvicorn's HTTP protocol class with a timer from the moment
  a connection opens (or its previous response ends) until the next request's headers are complete;
  when it fires, the client gets ``408`` and the connection is closed.
- ``BodyReadTimeout``: ASGI middleware; while the body is incomplete, each ``receive()`` must
  return within its timeout. Otherwise 408 (``request_timeout``) with ``Connection: close``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

import anyio
from starlette.exceptions import HTTPException

from .errors import error_bytes
from .http_middleware import HTTPMiddleware

__all__ = ["BodyReadTimeout", "RequestTimeout", "header_timeout_protocol"]

_LOGGER = logging.getLogger(__name__)

_HEADER_408: Final = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
)


class RequestTimeout(HTTPException):
    """Raised from ``receive`` when a piece of the body is late. An ``HTTPException`` because FastAPI
    re-raises those from body parsing (the app's handler answers 408 ``request_timeout``)."""

    def __init__(self, timeout_s: float):
        super().__init__(
            408, f"the request body stopped arriving for {timeout_s:g} s; send the whole body at once."
        )


class BodyReadTimeout(HTTPMiddleware):
    """ASGI middleware: every ``receive()`` of an unfinished body must return within ``timeout_s``.

    Once the body is complete, ``receive()`` waits for the disconnect without a deadline (streamed
    responses and disconnect watchers rely on that).
    """

    def __init__(self, app, timeout_s: float):
        super().__init__(app)
        self.timeout_s = timeout_s

    async def handle(self, scope, receive, send) -> None:
        body_done = False
        timed_out = False
        started = False

        async def timed_receive():
            nonlocal body_done, timed_out
            if body_done:
                return await receive()
            try:
                with anyio.fail_after(self.timeout_s):
                    message = await receive()
            except TimeoutError:
                timed_out = True
                _LOGGER.info("%s %s: body read timed out", scope.get("method"), scope.get("path"))
                raise RequestTimeout(self.timeout_s) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_done = True
            return message

        async def closing_send(message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if timed_out:  # the rest of the body may still come: never reuse this connection
                    headers = [
                        item for item in message.get("headers", []) if item[0].lower() != b"connection"
                    ]
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        try:
            await self.app(scope, timed_receive, closing_send)
        except RequestTimeout as exc:
            if started:
                raise
            body = error_bytes(408, exc.detail, "request_timeout")
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            await send({"type": "http.response.start", "status": 408, "headers": headers})
            await send({"type": "http.response.body", "body": body})


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """Uvicorn's HTTP protocol (httptools or h11) with a deadline for each request's headers.

    The timer starts when the connection opens and again when a response ends; it is void once a
    new request has started (its headers are complete). Pass the class as ``uvicorn.Config(http=...)``.
    """
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class HeaderTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            self._header_timer = asyncio.get_running_loop().call_later(
                timeout_s, self._headers_late, self.cycle
            )

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self, cycle_when_armed: object) -> None:
            self._header_timer = None
            if self.cycle is not cycle_when_armed or self.transport.is_closing():
                return  # a request started in time; the next arming is at its response's end
            _LOGGER.info("closing a connection whose request headers took over %g s", timeout_s)
            body = error_bytes(
                408, f"the request headers took longer than {timeout_s:g} s.", "header_timeout"
            )
            self.transport.write(_HEADER_408 + b"content-length: %d\r\n\r\n" % len(body) + body)
            self.transport.close()

    return HeaderTimeoutProtocol
