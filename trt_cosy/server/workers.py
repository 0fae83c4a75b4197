"""``trt-cosy serve --workers N``: N server processes behind one port, each pinned to its own whole cores.

The parent binds the port once and starts N workers (``multiprocessing`` spawn: no engine state is
forked). Each worker pins itself to its slot of ``CpuBudget.plan(N)`` before it loads the engines, loads
them with one thread per core of its slot, and serves the shared listening socket.

A worker accepts a connection only while it has a free synthesis slot (requests in flight plus
connections that have not sent a request yet < ``max_concurrent``), so new connections go to an idle
worker instead of queueing behind a busy one; when every worker is full, any worker accepts (its own
queue and 429 limit then apply). A connection stays with the worker that accepted it (HTTP keep-alive).

If a worker exits, the parent stops the others and exits with an error (let the supervisor restart
the service): a half-sized server would answer slower without saying so.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any, Final

from ..runtime.cpu_budget import ReplicaPlan, format_cpu_list, pin_process, read_budget

__all__ = ["WORKER_HEADER", "listening_socket", "run_workers", "serve_app_worker", "serve_worker_socket", "worker_plan"]

_LOGGER = logging.getLogger(__name__)
_POLL_S: Final = 0.05  # how often a full worker looks whether every worker is full
WORKER_HEADER: Final = "x-trt-cosy-replica"  # the header Ray replicas set too: ``pid@worker-N``


def worker_plan(workers: int, threads: int | None = None) -> ReplicaPlan:
    """The cores and threads of ``workers`` server processes on this machine."""
    return read_budget().plan(workers, threads)


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening (IPv6 for an address with a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say so (runner.ThreadedServer).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _Gate:
    """This worker's load: requests in flight and accepted connections that have sent none yet.
    ``busy`` is shared with the parent and the other workers (one int per worker, -1 while it loads)."""

    def __init__(self, capacity: int, busy: Any, index: int):
        self.capacity, self.shared, self.index = capacity, busy, index
        self.ready = False  # warmed up: until then -1 in ``shared``
        self.in_flight = 0
        self.fresh: set[tuple] = set()
        self.changed = asyncio.Event()

    def update(self) -> None:
        if self.ready:
            self.shared[self.index] = self.in_flight + len(self.fresh)
        self.changed.set()

    def may_accept(self) -> bool:
        if not self.ready:  # warming up: answer (503 "warming up", /health probes) only while no worker is ready
            return all(self.shared[index] < 0 for index in range(len(self.shared)))
        if self.in_flight + len(self.fresh) < self.capacity:
            return True
        # Every worker full (or still loading): accept anyway, so the app's queue and 429 apply
        # instead of the backlog.
        return all(not 0 <= self.shared[index] < self.capacity for index in range(len(self.shared)))


class _CountRequests:
    """ASGI middleware: an HTTP request keeps its worker busy from its start until its response ends;
    every response names the worker (``WORKER_HEADER``)."""

    def __init__(self, app: Any, gate: _Gate):
        self.app, self.gate = app, gate
        self.state = getattr(app, "state", None)  # runner._config reads the app's settings from it
        self.header = (WORKER_HEADER.encode(), f"{os.getpid()}@worker-{gate.index}".encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.gate.fresh.discard(tuple(scope.get("client") or ()))
        self.gate.in_flight += 1
        self.gate.update()

        async def named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        try:
            await self.app(scope, receive, named)
        finally:
            self.gate.in_flight -= 1
            self.gate.update()


def _tracked_protocol(base: type, gate: _Gate) -> type:
    """uvicorn's protocol class, telling the gate when a connection closes (before any request ends it)."""

    class TrackedProtocol(base):  # type: ignore[misc, valid-type]
        def connection_lost(self, exc) -> None:
            peer = getattr(self, "client", None)
            if peer is not None and tuple(peer) in gate.fresh:
                gate.fresh.discard(tuple(peer))
                gate.update()
            super().connection_lost(exc)

    return TrackedProtocol


async def _accept(server: Any, sock: socket.socket, gate: _Gate, is_ready: Callable[[], bool]) -> None:
    """Accept connections on the shared socket while ``gate`` allows, handing them to uvicorn; the worker
    counts as ready (for the parent and the other workers) once ``is_ready()`` (its warm-up is done)."""
    loop = asyncio.get_running_loop()
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(0.01)
    config = server.config
    protocol = _tracked_protocol(config.http_protocol_class, gate)

    def make_protocol() -> asyncio.Protocol:
        return protocol(config=config, server_state=server.server_state, app_state=server.lifespan.state,
                        _loop=loop)

    sock.setblocking(False)
    fd = sock.fileno()

    async def serve_connection(connection: socket.socket, peer: tuple) -> None:
        try:
            await loop.connect_accepted_socket(make_protocol, connection)
        except OSError as exc:
            _LOGGER.info("connection from %s lost at once: %s", peer, exc)
            gate.fresh.discard(peer)
            gate.update()

    def on_readable() -> None:
        # Checked before every accept: a connection is taken only while the gate allows it (the reader
        # is removed otherwise), so no socket is ever accepted and then dropped.
        if not gate.may_accept():
            return
        try:
            connection, address = sock.accept()
        except (BlockingIOError, InterruptedError):  # another worker took it
            return
        except OSError as exc:  # EMFILE and the like: keep serving the open connections
            _LOGGER.warning("accept failed: %s", exc)
            return
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = tuple(address[:2])
        gate.fresh.add(peer)
        gate.update()
        loop.create_task(serve_connection(connection, peer))

    listening = False
    try:
        while not server.should_exit:
            if not gate.ready and is_ready():
                gate.ready = True
                gate.update()  # the parent and the other workers see this worker's load from now on
            wanted = gate.may_accept()
            if wanted and not listening:
                loop.add_reader(fd, on_readable)
            elif listening and not wanted:
                loop.remove_reader(fd)
            listening = wanted
            gate.changed.clear()
            try:
                await asyncio.wait_for(gate.changed.wait(), _POLL_S)
            except TimeoutError:
                pass
    finally:
        if listening:
            loop.remove_reader(fd)


def serve_worker_socket(app: Any, config_for: Callable[[Any], Any], sock: socket.socket, capacity: int,
                        busy: Any, index: int) -> None:
    """Run uvicorn on ``app`` in this process, accepting from the shared ``sock`` through a gate of
    ``capacity`` (``config_for(app)`` makes the ``uvicorn.Config``). Returns when the server stops."""
    import uvicorn

    async def main() -> None:
        gate = _Gate(capacity, busy, index)
        server = uvicorn.Server(config_for(_CountRequests(app, gate)))
        state = getattr(getattr(app, "state", None), "server", None)  # create_app's ServerState
        accepting = asyncio.ensure_future(_accept(server, sock, gate, lambda: getattr(state, "ready", True)))
        try:
            await server.serve(sockets=[])  # no listener of its own: _accept hands it the connections
        finally:
            accepting.cancel()
            await asyncio.gather(accepting, return_exceptions=True)

    asyncio.run(main())


def serve_app_worker(tts: Any, settings: Any, sock: socket.socket, busy: Any, index: int) -> None:
    """Serve the HTTP app (``create_app(tts, settings)``) on the shared ``sock`` as worker ``index``."""
    from .app import create_app
    from .runner import _config

    if index == 0 and not settings.is_loopback and settings.api_key is None:
        _LOGGER.warning("binding %s without an API key: anyone who can reach this address can use the server; "
                        "pass --api-key (or set TRT_COSY_API_KEY)", settings.host)
    serve_worker_socket(create_app(tts, settings),
                        lambda app: _config(app, settings.host, settings.port, "info"),
                        sock, settings.max_concurrent, busy, index)


def _worker_main(index: int, cpus: tuple[int, ...], threads: int, sock: socket.socket, busy: Any,
                 serve_one: Callable[..., None], options: dict[str, Any]) -> None:
    """A worker process (started pinned): load and serve (``serve_one(threads=, sock=, busy=, index=, **options)``)."""
    pin_process(cpus)  # already inherited at start; again for any thread started before this point
    logging.basicConfig(level=logging.INFO, format=f"[worker {index}] %(levelname)s %(name)s: %(message)s")
    _LOGGER.info("worker %d (pid %d) pinned to CPUs %s, %d threads per graph", index, os.getpid(),
                 format_cpu_list(cpus), threads)
    serve_one(threads=threads, sock=sock, busy=busy, index=index, **options)


def run_workers(plan: ReplicaPlan, host: str, port: int, serve_one: Callable[..., None], options: dict[str, Any],
                progress: Callable[[str], None] = print) -> int:
    """Start one worker per slot of ``plan`` on one listening ``host:port`` and wait; returns the exit code.

    ``serve_one`` (a module-level function: the workers are spawned) loads the engines and serves.
    """
    sock = listening_socket(host, port)
    context = multiprocessing.get_context("spawn")
    busy = context.Array("i", [-1] * len(plan.slots), lock=False)
    if plan.shared:
        _LOGGER.warning("%d workers on %d usable cores: they share cores", len(plan.slots),
                        len({cpu for slot in plan.slots for cpu in slot.cpus}))
    processes = []
    for slot in plan.slots:
        process = context.Process(
            target=_worker_main, name=f"trt-cosy-worker-{slot.index}",
            args=(slot.index, slot.cpus, slot.threads, sock, busy, serve_one, options),
        )
        _start_pinned(process, slot.cpus)
        processes.append(process)
        progress(f"worker {slot.index}: pid {process.pid}, CPUs {format_cpu_list(slot.cpus)}, "
                 f"{slot.threads} thread(s) per graph")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    code = 0
    try:
        ended: list = []
        while not ended:  # until a worker exits; say once when every worker serves
            ended = multiprocessing.connection.wait([process.sentinel for process in processes], timeout=0.2)
            if busy is not None and all(value >= 0 for value in busy):
                progress(f"all {len(processes)} workers ready")
                busy = None
        for process in processes:
            if process.sentinel in ended:
                code = process.exitcode or 1
                progress(f"worker {processes.index(process)} exited ({process.exitcode}); stopping the others")
    except KeyboardInterrupt:
        progress("stopping")
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(processes)
        sock.close()
    return code


def _start_pinned(process: Any, cpus: tuple[int, ...]) -> None:
    """Start ``process`` already pinned to ``cpus``: the child inherits the affinity of the thread that
    forks it, so the thread pools its imports start (OpenBLAS) size themselves to its cores too."""
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # this thread only; the parent's other threads keep their CPUs
    try:
        process.start()
    finally:
        os.sched_setaffinity(0, own)


def _stop(processes: list, timeout_s: float = 20.0) -> None:
    for process in processes:
        if process.is_alive():
            os.kill(process.pid, signal.SIGTERM)  # uvicorn's graceful shutdown
    deadline = time.monotonic() + timeout_s
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join(5)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt

