"""API keys: ``Authorization: Bearer <key>`` (what OpenAI clients send) on every route but the open ones.

The presented key is compared in constant time: both sides are hashed to SHA-256 first, so neither
the content nor the length of the server's key shows in the time a refusal takes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Callable
from typing import Final

from .errors import error_body

__all__ = ["BearerAuth", "OPEN_ROUTES", "WS_KEY_PREFIX"]

_LOGGER = logging.getLogger(__name__)

WS_KEY_PREFIX: Final = "bearer."
"""A WebSocket client that cannot send headers (a browser) offers the subprotocol ``bearer.<key>``."""

OPEN_ROUTES: Final = frozenset((method, path) for method in ("GET", "HEAD") for path in ("/health", "/"))
"""(method, path) pairs answered without a key: the health check and the playground page (whose API
calls send the key typed into it)."""

_HOW: Final = (
    "send the header 'Authorization: Bearer <key>' with the key the server was started with "
    "(trt-cosy serve --api-key, or TRT_COSY_API_KEY)"
)


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


class BearerAuth:
    """ASGI middleware: refuses a request without the right bearer key with 401 and a JSON error.

    Args:
        app: the wrapped ASGI app.
        api_key: the key requests must present.
        on_refused: called with (path, code) for each refusal (metrics).
    """

    def __init__(self, app, api_key: str, on_refused: Callable[[str, str], None]):
        self.app = app
        self._expected = _digest(api_key.encode("utf-8"))
        self.on_refused = on_refused

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        if (scope.get("method", "GET"), scope.get("path", "")) in OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        refusal = self._check(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        code, message = refusal
        self.on_refused(scope.get("path", ""), code)
        _LOGGER.debug("refused %s %s: %s", scope.get("method", ""), scope.get("path", ""), code)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
            return
        body = json.dumps(error_body(401, message, code)).encode("utf-8")
        challenge = 'Bearer realm="trt-cosy"' + (
            ', error="invalid_token"' if code == "invalid_api_key" else ""
        )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", challenge.encode()),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    def _check(self, scope) -> tuple[str, str] | None:
        """None when the request carries the key; else (code, message)."""
        values = [value for name, value in scope.get("headers", ()) if name == b"authorization"]
        if not values and scope["type"] == "websocket":  # browsers cannot set headers on a WebSocket
            values = [
                b"Bearer " + p[len(WS_KEY_PREFIX) :].encode()
                for p in scope.get("subprotocols", ())
                if p.startswith(WS_KEY_PREFIX)
            ]
        if not values:
            return "missing_api_key", f"this server needs an API key: {_HOW}."
        scheme, _, token = values[0].strip().partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            return "invalid_api_key", f"the Authorization header is not 'Bearer <key>': {_HOW}."
        if not hmac.compare_digest(_digest(token.strip()), self._expected):
            return "invalid_api_key", f"the API key is not the server's: {_HOW}."
        return None
