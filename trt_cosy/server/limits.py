"""Overload protection: a bounded number of syntheses with a bounded queue, and request body limits."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import anyio
from starlette.exceptions import HTTPException

from .errors import RETRY_BUSY_S, APIError, error_bytes
from .http_middleware import HTTPMiddleware
from .metrics import Metrics

__all__ = ["Admission", "Slot", "BodySizeLimit", "BodyTooLarge"]

_LOGGER = logging.getLogger(__name__)


class Slot:
    """A held synthesis slot; ``release()`` is idempotent."""

    def __init__(self, admission: Admission):
        self._admission = admission
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._admission._release()


class Admission:
    """At most ``max_active`` holders at once and ``max_queue`` waiting; more is refused with 429.

    Lives on the event loop: ``acquire`` and ``release`` are called from it only.
    """

    def __init__(self, max_active: int, max_queue: int, metrics: Metrics):
        self.max_active = max_active
        self.max_queue = max_queue
        self._metrics = metrics
        self._semaphore = anyio.Semaphore(max_active)
        self.active = 0
        self.waiting = 0

    async def acquire(self, timeout_s: float) -> Slot:
        """Wait (at most ``timeout_s``) for a slot.

        Raises:
            APIError: 429 when every slot and queue place is taken; 503 after waiting ``timeout_s``.
        """
        if self.active + self.waiting >= self.max_active + self.max_queue:
            raise APIError(
                429,
                f"the server is busy ({self.active} running, {self.waiting} queued, the most it takes); "
                "retry later.",
                "server_overloaded",
                headers={"Retry-After": str(RETRY_BUSY_S)},
            )
        self.waiting += 1
        self._publish()
        try:
            with anyio.fail_after(timeout_s if math.isfinite(timeout_s) else None):
                await self._semaphore.acquire()
        except TimeoutError:
            raise APIError(
                503,
                f"no synthesis slot became free within {timeout_s:g} s; retry later.",
                "queue_timeout",
                headers={"Retry-After": str(RETRY_BUSY_S)},
            ) from None
        finally:
            self.waiting -= 1
            self._publish()
        self.active += 1
        self._publish()
        return Slot(self)

    def _release(self) -> None:
        self.active -= 1
        self._semaphore.release()
        self._publish()

    def _publish(self) -> None:
        self._metrics.queue_depth.set(self.waiting)
        self._metrics.active.set(self.active)


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` when a body outgrows its limit. An ``HTTPException`` because FastAPI
    re-raises those from body parsing (any other error there becomes a generic 400)."""

    def __init__(self, limit: int):
        super().__init__(413, f"the request body is larger than {limit} bytes.")


class BodySizeLimit(HTTPMiddleware):
    """ASGI middleware: refuses a request body larger than ``limit_for(path)`` bytes with 413, the
    message ending with ``advice_for(path)`` (what to send instead).

    The declared Content-Length is checked first; a chunked body is counted as it arrives, so an
    oversized upload is never read whole into memory or onto disk.
    """

    def __init__(
        self,
        app,
        limit_for: Callable[[str], int],
        on_refused: Callable[[str], None],
        advice_for: Callable[[str], str] = lambda path: "send less.",
    ):
        super().__init__(app)
        self.limit_for = limit_for
        self.advice_for = advice_for
        self.on_refused = on_refused

    async def handle(self, scope, receive, send) -> None:
        limit = self.limit_for(scope.get("path", ""))
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, send, limit)
            return
        received = 0
        started = False

        async def counting_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if started:
                raise
            await self._refuse(scope, send, limit)

    async def _refuse(self, scope, send, limit: int) -> None:
        self.on_refused(scope.get("path", ""))
        path = scope.get("path", "")
        body = error_bytes(
            413, f"the request body is larger than {limit} bytes; {self.advice_for(path)}", "body_too_large"
        )
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
