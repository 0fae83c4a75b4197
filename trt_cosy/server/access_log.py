"""One log line per HTTP request, written when its last byte has gone out (or the client left):

    127.0.0.1 "POST /v1/audio/speech" 200 96044B 1.234s
    127.0.0.1 "POST /tts" 503 301B 0.004s refused: overloaded (expected 112.0 s of work)

A route that refuses a request puts why in the ASGI scope under ``REASON_KEY``; the line ends with it.
Logged at INFO on this module's logger (``trt_cosy.server.access_log``), so it can be filtered or
routed on its own; ``trt-cosy serve`` shows it.
"""

from __future__ import annotations

import logging
import time

__all__ = ["AccessLog", "REASON_KEY"]

REASON_KEY = "trt_cosy.reason"
"""Scope key of a short reason (no newlines) that a route gives for refusing a request."""

_LOGGER = logging.getLogger(__name__)


class AccessLog:
    """ASGI middleware: logs client, method, path, status, body bytes sent and duration of each request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status, sent = 500, 0  # 500: the app raised before answering (the server error handler answers)

        async def logging_send(message) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
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
                '%s "%s %s" %d %dB %.3fs%s',
                client[0] if client else "-",
                scope.get("method", ""),
                path,
                status,
                sent,
                time.perf_counter() - started,
                f" {reason}" if reason else "",
            )
