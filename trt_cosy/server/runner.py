"""Serving the app with uvicorn: in the foreground (``trt-cosy serve``) or in a thread (tests, benchmarks)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from .settings import ServerSettings

__all__ = ["run_server", "ThreadedServer"]

_LOGGER = logging.getLogger(__name__)


def _config(app: Any, host: str, port: int, log_level: str):
    import uvicorn

    from .timeouts import header_timeout_protocol

    # The app's settings (``create_app``) give the header deadline; other ASGI apps get the default.
    state = getattr(getattr(app, "state", None), "server", None)
    header_timeout_s = state.settings.header_timeout_s if state is not None else 10.0
    # timeout_graceful_shutdown: open streams get this long to finish on Ctrl-C, then are cut.
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=10,
        access_log=False,
        http=header_timeout_protocol(header_timeout_s),
    )


def run_server(tts: Any, settings: ServerSettings, log_level: str = "info") -> None:
    """Serve ``tts`` on ``settings.host:settings.port`` until interrupted."""
    import uvicorn

    from .app import create_app

    server_logger = logging.getLogger("trt_cosy.server")
    if server_logger.getEffectiveLevel() > logging.INFO:  # show the access lines (unless -vv asked for more)
        server_logger.setLevel(logging.INFO)
    if not settings.is_loopback and settings.api_key is None:
        _LOGGER.warning(
            "binding %s without an API key: anyone who can reach this address can use the server; "
            "pass --api-key (or set TRT_COSY_API_KEY)",
            settings.host,
        )
    uvicorn.Server(_config(create_app(tts, settings), settings.host, settings.port, log_level)).run()


class ThreadedServer:
    """A real uvicorn server on a free loopback port, in a background thread (a context manager).

    with ThreadedServer(app) as server:
        httpx.get(server.url + "/health")
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", log_level: str = "warning"):
        import uvicorn

        # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so; without it every
        # keep-alive response waits ~40 ms for a delayed ACK (Nagle).
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        self._server = uvicorn.Server(_config(app, host, self.port, log_level))
        self._server.install_signal_handlers = lambda: None  # uvicorn < 0.29 only; harmless later
        self._thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)

    def _run(self) -> None:
        self._server.run(sockets=[self._socket])

    def start(self, timeout_s: float = 30.0) -> ThreadedServer:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()
