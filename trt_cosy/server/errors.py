"""OpenAI-shaped JSON errors: ``{"error": {"message", "type", "param", "code"}}`` for every failure."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["APIError", "error_body", "error_bytes", "validation_message", "RETRY_BUSY_S", "RETRY_WARMING_S"]

_LOGGER = logging.getLogger(__name__)

RETRY_BUSY_S: Final = 2
"""``Retry-After`` of a 429 or a queue timeout: every slot is taken now; one frees within seconds."""
RETRY_WARMING_S: Final = 5
"""``Retry-After`` while the server warms up (one short synthesis of each kind)."""

_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """An error answered to the client as JSON with ``status``.

    Args:
        status: the HTTP status (4xx for the client's mistakes, 429/503/504 for load).
        message: what went wrong and what to do.
        code: a stable machine-readable code (``"voice_not_found"``).
        param: the request field at fault, if one is.
        headers: extra response headers (``Retry-After`` on 429 and 503).
    """

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_bytes(status: int, message: str, code: str) -> bytes:
    return json.dumps(error_body(status, message, code)).encode("utf-8")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable line from pydantic/FastAPI validation errors, and the first field at fault."""
    parts, param = [], None
    for error in errors[:5]:
        location = [str(item) for item in error.get("loc", ()) if item not in ("body", "query", "path")]
        field = ".".join(location)
        message = str(error.get("msg", "invalid value"))
        kind = error.get("type")
        if kind == "json_invalid":
            message = f"the body is not valid JSON ({error.get('ctx', {}).get('error', message)})"
            field = ""
        elif not field and kind in ("model_attributes_type", "dict_type", "model_type"):
            message = "the body must be a JSON object, sent with Content-Type: application/json"
        param = param or field or None
        parts.append(f"{field}: {message}" if field else message)
    return "; ".join(parts) + ".", param
