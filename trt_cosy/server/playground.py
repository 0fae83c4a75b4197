"""``GET /``: the web playground, one static page shipped in the package (``playground.html``).

The page has no build step and loads nothing from elsewhere: its Content-Security-Policy allows only
its own inline script (by hash), inline styles, and requests to this server.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

__all__ = ["playground_router", "playground_page"]

_LOGGER = logging.getLogger(__name__)


def playground_page() -> bytes:
    return resources.files(__package__).joinpath("playground.html").read_bytes()


def _content_security_policy(page: bytes) -> str:
    scripts = re.findall(rb"<script>(.*?)</script>", page, re.DOTALL)
    hashes = " ".join(
        "'sha256-" + base64.b64encode(hashlib.sha256(script).digest()).decode() + "'" for script in scripts
    )
    return (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
        "media-src blob:; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )


def playground_router() -> APIRouter:
    router = APIRouter()
    page = playground_page()
    headers = {
        "Content-Security-Policy": _content_security_policy(page),
        "X-Content-Type-Options": "nosniff",
        "Cache-Control": "no-cache",
    }

    @router.get("/", include_in_schema=False)
    async def playground() -> Response:
        """The playground page (open without an API key; its API calls send the key typed into it)."""
        return Response(page, media_type="text/html; charset=utf-8", headers=headers)

    return router
