"""The HTTP app (``trt_cosy.server.create_app``) as a Ray Serve deployment: one engine per replica.

    trt-cosy serve --engines ENGINES --ray --replicas 2
    serve run trt_cosy.serving.ray_app:build_app engines=ENGINES replicas=2

Every replica loads the engines once, builds the same FastAPI app as ``trt-cosy serve`` (same routes,
streaming, stored voices, limits) and answers with an ``X-Trt-Cosy-Replica`` header naming itself.
TensorRT engines get one GPU per replica (``num_gpus=1``). ONNX Runtime engines share the machine's CPU
budget (``runtime/cpu_budget``): each replica claims its own whole cores on its node at start, pins itself
to them and runs one thread per core, and Ray reserves those CPUs for it (``cpu_share``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ..errors import InputError

__all__ = ["RayServeOptions", "CpuShare", "backpressure", "build_app", "cpu_share", "deployment_for",
           "run_ray_serve", "REPLICA_HEADER"]

_LOGGER = logging.getLogger(__name__)

REPLICA_HEADER: Final = "x-trt-cosy-replica"
APP_NAME: Final = "trt_cosy"


@dataclass(frozen=True)
class RayServeOptions:
    """What the Ray deployment needs: the engines, the server settings and the scale."""

    engines: Path
    voices_dir: Path | None = None
    """Folder of stored voices, shared by every replica (a network volume on a cluster). None: the
    trt-cosy cache's ``voices/<model id>`` on each node."""
    host: str = "127.0.0.1"
    port: int = 8000
    threads: int | None = None
    """CPU threads (whole cores) per graph in each replica; None: the usable cores divided among the
    replicas (``cpu_share``)."""
    max_concurrent: int = 1
    max_queue: int = 8
    request_timeout_s: float = 300.0
    replicas: int = 1
    autoscale: tuple[int, int] | None = None
    """(min, max) replicas, scaled on ongoing requests; None: ``replicas`` fixed."""
    ray_address: str | None = None
    """A running cluster's address; None: start a local Ray bound to ``host``."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """More ``ServerSettings`` fields (``model_name``, ``max_input_chars``...)."""
    deterministic: bool | None = None
    """``EngineConfig.deterministic`` of every replica's engine (None: its default)."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise InputError(f"replicas must be >= 1, got {self.replicas}.")


class _ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that made it (``pid@replica``)."""

    def __init__(self, app: Any, name: str):
        self.app = app
        self.header = (REPLICA_HEADER.encode(), name.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def named(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named)


@dataclass(frozen=True)
class CpuShare:
    """What each replica of a CPU deployment gets: its threads (= whole cores), Ray's reservation, and
    the slots planned per machine (replicas pin to disjoint ones, ``cpu_budget.pin_replica``)."""

    threads: int
    num_cpus: float
    """Logical CPUs reserved in Ray: the replica's cores with their SMT siblings."""
    replicas: int


def cpu_share(options: RayServeOptions, budget: Any = None) -> CpuShare:
    """The CPU share of each replica on ``budget`` (default: this machine's, ``read_budget()``)."""
    from ..runtime.cpu_budget import read_budget

    budget = budget if budget is not None else read_budget()
    replicas = options.autoscale[1] if options.autoscale is not None else options.replicas
    plan = budget.plan(replicas, options.threads)
    if plan.shared:  # more replicas than cores: reserve an even part of the CPUs, so all can start
        num_cpus = round(len(budget.cpus) / replicas, 2) or 0.01
    else:
        num_cpus = float(len(plan.slots[0].cpus))
    return CpuShare(threads=plan.threads, num_cpus=num_cpus, replicas=replicas)


class TrtCosyReplica:
    """One replica: the loaded engine and the app around it (Ray builds the app after ``__init__``)."""

    def __init__(self, engines: str, settings: dict[str, Any], threads: int | None,
                 cpu: dict[str, Any] | None = None, engine: dict[str, Any] | None = None):
        from ..runtime.manifest import Manifest
        from ..synthesis import EngineConfig
        from ..tts import CosyVoice

        started = time.perf_counter()
        if cpu is not None:  # ONNX Runtime engines: pin to this replica's cores before loading
            from ..runtime.cpu_budget import pin_replica

            slot = pin_replica(cpu["replicas"], cpu["threads"], cpu["key"])
            threads = slot.threads if slot is not None else cpu["threads"]
        # ``engine``: more EngineConfig fields (the KV slots of the shared decode loop, deterministic)
        self.tts = CosyVoice.load(engines, backend=Manifest.read(Path(engines)).backend,
                                  config=EngineConfig(threads=threads, **(engine or {})))
        self.settings = dict(settings)
        self.name = f"{os.getpid()}@{_replica_id()}"
        _LOGGER.info("replica %s loaded %s in %.1f s", self.name, self.tts.model_id, time.perf_counter() - started)

    def __serve_build_asgi_app__(self) -> Any:
        from ..cache_dir import cache_root
        from ..server import ServerSettings, create_app

        settings = dict(self.settings)
        settings.setdefault("voices_dir", cache_root() / "voices" / self.tts.model_id)
        self.server_app = create_app(self.tts, ServerSettings(**settings))
        return _ReplicaHeader(self.server_app, self.name)

    def check_health(self) -> None:
        """Ray's health check: a replica whose warm-up failed is restarted."""
        state = getattr(getattr(self, "server_app", None), "state", None)
        error = getattr(getattr(state, "server", None), "warmup_error", None)
        if error:
            raise RuntimeError(f"warm-up failed: {error}")


def _replica_id() -> str:
    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # noqa: BLE001 - outside a replica (tests constructing it directly)
        return "local"


def deployment_for(options: RayServeOptions) -> Any:
    """The bound Ray Serve application for ``options`` (``serve.run`` it)."""
    from ray import serve

    from ..runtime.manifest import Manifest

    engines = Path(options.engines).resolve()
    gpu = Manifest.read(engines).backend == "tensorrt"
    settings: dict[str, Any] = {
        "host": options.host, "port": options.port, "max_concurrent": options.max_concurrent,
        "max_queue": options.max_queue, "request_timeout_s": options.request_timeout_s, **options.settings,
    }
    if options.voices_dir is not None:
        settings["voices_dir"] = str(Path(options.voices_dir).resolve())
    scale: dict[str, Any] = {"num_replicas": options.replicas}
    if options.autoscale is not None:
        low, high = options.autoscale
        scale = {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                        "target_ongoing_requests": options.max_concurrent}}
    cpu = None
    if gpu:
        actor: dict[str, Any] = {"num_gpus": 1}
    else:
        share = cpu_share(options)
        actor = {"num_cpus": share.num_cpus}
        cpu = {"replicas": share.replicas, "threads": share.threads, "key": f"ray-{APP_NAME}-{options.port}"}
    deployment = serve.deployment(serve.ingress()(TrtCosyReplica)).options(
        name="TrtCosy",
        ray_actor_options=actor,
        **backpressure(options),
        **scale,
    )
    # One KV slot of the shared decode loop per synthesis a replica runs at once, as `trt-cosy serve`.
    engine = {"llm_slots": options.max_concurrent, "deterministic": options.deterministic}
    return deployment.bind(str(engines), settings, options.threads, cpu, engine)


def backpressure(options: RayServeOptions) -> dict[str, int]:
    """Ray Serve's back-pressure settings, tied to each replica's own admission (docs/deploy.md).

    ``max_ongoing_requests``: what one replica's app holds, ``max_concurrent`` running plus ``max_queue``
    waiting; its admission by expected work answers at once (503 + Retry-After) what would not finish
    in time, so a replica's ongoing requests are the ones it admitted, and Ray's router (the less busy
    of two replicas) sends new work where fewer are admitted, never more than a replica can hold.
    ``max_queued_requests``: requests that find every replica full wait at Ray's proxy, where no
    admission sees them while their timeout runs; unbounded by default, so at most ``max_queue`` wait
    there (per proxy) and Ray answers the rest 503 at once.
    """
    return {
        "max_ongoing_requests": options.max_concurrent + options.max_queue,
        "max_queued_requests": max(1, options.max_queue),
    }


def build_app(args: dict[str, str]) -> Any:
    """``serve run trt_cosy.serving.ray_app:build_app engines=DIR [replicas=N] [voices_dir=DIR]
    [threads=N] [max_concurrent=N] [max_queue=N] [autoscale=MIN:MAX]``."""
    known = {"engines", "replicas", "voices_dir", "threads", "max_concurrent", "max_queue", "autoscale"}
    unknown = sorted(set(args) - known)
    if unknown or "engines" not in args:
        raise InputError(f"arguments: engines=DIR plus any of {sorted(known - {'engines'})}; got {sorted(args)}.")
    autoscale = None
    if "autoscale" in args:
        low, high = args["autoscale"].split(":")
        autoscale = (int(low), int(high))
    integer = {name: int(args[name]) for name in ("replicas", "threads", "max_concurrent", "max_queue") if name in args}
    return deployment_for(RayServeOptions(engines=Path(args["engines"]), voices_dir=args.get("voices_dir"),
                                          autoscale=autoscale, **integer))


def start_ray(options: RayServeOptions) -> None:
    """Connect to ``options.ray_address``, or start a local Ray bound to ``options.host``, and start Serve's
    HTTP proxy on ``host:port``."""
    import ray
    from ray import serve

    if not ray.is_initialized():
        if options.ray_address:
            ray.init(address=options.ray_address)
        else:
            ray.init(address="local", _node_ip_address=_node_ip(options.host), include_dashboard=False)
    serve.start(http_options={"host": options.host, "port": options.port})


def _node_ip(host: str) -> str:
    return "127.0.0.1" if host in ("127.0.0.1", "localhost", "0.0.0.0", "::1") else host


def run_ray_serve(options: RayServeOptions, progress: Callable[[str], None] = print) -> None:
    """``trt-cosy serve --ray``: deploy and serve until interrupted, then shut Serve down."""
    import ray
    from ray import serve

    start_ray(options)
    scale = f"{options.autoscale[0]}-{options.autoscale[1]}" if options.autoscale else str(options.replicas)
    progress(f"deploying {scale} replica(s) of {options.engines} with Ray Serve...")
    serve.run(deployment_for(options), name=APP_NAME, route_prefix="/")
    progress(f"serving on http://{options.host}:{options.port} (Ray Serve; Ctrl-C stops)")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `docker stop`, systemd: shut down like Ctrl-C
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        progress("stopping")
    finally:
        signal.signal(signal.SIGTERM, previous)
        serve.shutdown()
        if not options.ray_address:
            ray.shutdown()  # the local Ray this command started


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
