"""The HTTP server (``trt-cosy serve``): OpenAI-compatible speech, stored voices, health and metrics.

Needs the ``serve`` extra (fastapi, uvicorn, python-multipart, prometheus-client). ``create_app(tts, settings)``
builds the app around a loaded ``CosyVoice``; ``run_server`` serves it with uvicorn.
"""

from __future__ import annotations

from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "run_server", "ThreadedServer"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    if name in ("run_server", "ThreadedServer"):
        from . import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'trt_cosy.server' has no attribute {name!r}")
