"""One log line per HTTP request, written when its last byte has gone out (or the client left):

    127.0.0.1 "POST /v1/audio/speech" 200 96044B 1.234s id=5f0c8d9e2b7a4c61a0e3f1d2c4b5a697
    127.0.0.1 "POST /tts" 503 301B 0.004s id=0b1e... refused: overloaded (expected 112.0 s of work)

Every answer carries an ``x-request-id`` header with the same id: the client's own ``x-request-id``
when it sent a sane one (printable ASCII, at most 128 characters), else a fresh random one. Clients
log it with their errors (the OpenAI SDK's ``request_id``, LiveKit's), so a line is found by it.

A route that refuses a request puts why in the ASGI scope under ``REASON_KEY``; the line ends with it.
Logged at INFO on this module's logger (``trt_cosy.server.access_log``), so it can be filtered or
routed on its own; ``trt-cosy serve`` shows it.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Final

from .http_middleware import HTTPMiddleware

__all__ = ["AccessLog", "REASON_KEY", "REQUEST_ID_HEADER", "request_id_of"]

REASON_KEY = "trt_cosy.reason"
"""Scope key of a short reason (no newlines) that a route gives for refusing a request."""

_LOGGER = logging.getLogger(__name__)

REQUEST_ID_HEADER: Final = b"x-request-id"
_MAX_ID_CHARS: Final = 128


def request_id_of(scope) -> str:
    """The client's ``x-request-id`` when it is printable ASCII without spaces (<= 128 characters),
    else a new random id (32 hex digits)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == REQUEST_ID_HEADER:
            if 0 < len(value) <= _MAX_ID_CHARS and all(0x21 <= byte <= 0x7E for byte in value):
                return value.decode("ascii")
            break
    return uuid.uuid4().hex


class AccessLog(HTTPMiddleware):
    """ASGI middleware: logs client, method, path, status, body bytes sent, duration and request id of each
    request, and adds the ``x-request-id`` header to its answer (``scope["state"]["request_id"]``)."""

    async def handle(self, scope, receive, send) -> None:
        started = time.perf_counter()
        status, sent = 500, 0  # 500: the app raised before answering (the server error handler answers)
        request_id = request_id_of(scope)
        scope.setdefault("state", {})["request_id"] = request_id

        async def logging_send(message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [item for item in message.get("headers", []) if item[0].lower() != REQUEST_ID_HEADER]
                message = {**message, "headers": [*headers, (REQUEST_ID_HEADER, request_id.encode("ascii"))]}
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, logging_send)
        finally:
            client = scope.get("client")
            # The path as sent (percent-encoded): no spaces or newlines to forge a log line with.
            raw_path = scope.get("raw_path")
            path = raw_path.decode("latin-1") if raw_path else repr(scope.get("path", ""))
            reason = scope.get(REASON_KEY)
            _LOGGER.info(
                '%s "%s %s" %d %dB %.3fs id=%s%s',
                client[0] if client else "-",
                scope.get("method", ""),
                path,
                status,
                sent,
                time.perf_counter() - started,
                request_id,
                f" {reason}" if reason else "",
            )
