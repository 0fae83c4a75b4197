"""The serving commands: ``trt-cosy serve`` (one uvicorn process, or a Ray Serve deployment with ``--ray``)
and ``trt-cosy triton-repo`` (a Triton Inference Server model repository)."""

from __future__ import annotations

import functools
from pathlib import Path

import click

from .options import CountOrAuto, backend_option, engines_or_model_dir, measured_split


@click.command("triton-repo")
@click.option("--engines", required=True, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Engines directory from `trt-cosy build` (referenced by path, not copied).")
@click.option("--out", "repo", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Model repository folder to write into (tritonserver --model-repository).")
@click.option("--model-name", default="trt_cosy", show_default=True, help="The model's name in Triton.")
@click.option("--instances", type=CountOrAuto(), default=1, show_default=True,
              help="Model instances (per GPU with --device gpu), each loading the engines once; auto: the "
                   "replicas and threads `trt-cosy tune-threads` measured best for throughput here.")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True,
              help="KIND_GPU or KIND_CPU instances; auto: GPU for TensorRT engines, CPU for ONNX Runtime ones.")
@click.option("--voices-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of stored voices (<name>.npz) for the `voice` input.")
@click.option("--max-queue", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests waiting for a free instance; Triton refuses more.")
@click.option("--timeout", "request_timeout_s", type=click.FloatRange(min=0, min_open=True), default=300.0,
              show_default=True, help="Seconds a request may take: what would not finish within it is refused at "
                                      "once (admission by expected work); Triton rejects what is still queued after it.")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=4, show_default=True,
              help="Admitted requests each instance of the decoupled model runs at once.")
@click.option("--work-admission/--no-work-admission", default=True, show_default=True,
              help="Refuse at once (UNAVAILABLE + retry hint) what cannot finish within the timeout.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads per graph and instance.")
@click.option("--decoupled/--no-decoupled", default=True, show_default=True,
              help="Decoupled (streaming, gRPC and HTTP generate_stream) or one response per request "
                   "(Triton's HTTP infer endpoint refuses decoupled models).")
@click.option("--python-path", multiple=True, type=click.Path(exists=True, file_okay=False),
              help="Folder put first on the backend stub's import path (repeatable), e.g. a venv's site-packages.")
@click.option("--text-streaming", is_flag=True,
              help="Text in several requests of one sequence (START: voice + first piece, END: last piece); "
                   "the START request's responses carry the audio (docs/text-streaming.md).")
def triton_repo(engines: Path, repo: Path, model_name: str, instances: int, device: str, voices_dir: Path | None,
                max_queue: int, request_timeout_s: float, max_concurrent: int, work_admission: bool,
                threads: int | None, decoupled: bool, python_path: tuple[str, ...],
                text_streaming: bool) -> None:
    """Write a Triton Inference Server model repository (Python backend) that serves the engines."""
    from ..serving.triton_repo import TritonRepoOptions, write_triton_repo

    if instances == "auto":
        choice = measured_split(engines, "throughput", "--instances")
        instances, threads = choice.replicas, threads or choice.threads
    options = TritonRepoOptions(model_name=model_name, instances=instances, device=device, voices_dir=voices_dir,
                                max_queue=max_queue, decoupled=decoupled, threads=threads, python_path=python_path,
                                request_timeout_s=request_timeout_s, max_concurrent=max_concurrent,
                                work_admission=work_admission, text_streaming=text_streaming)
    model_dir = write_triton_repo(engines, repo, options)
    click.echo(f"wrote {model_dir}; serve it with: tritonserver --model-repository {repo.resolve()}")


def _autoscale(value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        low, high = (int(part) for part in value.split(":"))
    except ValueError:
        raise click.BadParameter(f"{value!r}: use MIN:MAX, e.g. 1:4.") from None
    if not 0 <= low <= high or high < 1:
        raise click.BadParameter(f"{value!r}: need 0 <= MIN <= MAX and MAX >= 1.")
    return low, high


def ray_serve_options(serve_command):
    """Add ``--ray``, ``--replicas``, ``--autoscale`` and ``--ray-address`` to ``serve``; with ``--ray``
    the app runs as a Ray Serve deployment instead of one uvicorn process."""

    @functools.wraps(serve_command)
    def serve(ray: bool, replicas: int | str | None, autoscale: str | None, ray_address: str | None, **options):
        if not ray:
            if replicas is not None or autoscale is not None or ray_address is not None:
                raise click.UsageError("--replicas, --autoscale and --ray-address go with --ray.")
            return serve_command(**options)
        if replicas is not None and autoscale is not None:
            raise click.UsageError("pass only one of --replicas, --autoscale.")
        if options.get("workers") is not None:
            raise click.UsageError("--workers is for one machine without Ray; with --ray use --replicas.")
        if options.get("engines") is None:
            raise click.UsageError(
                "--ray needs --engines: an engines directory every replica loads (`trt-cosy build --out DIR`)."
            )
        from ..errors import require

        for module in ("ray", "fastapi", "uvicorn", "python_multipart", "prometheus_client"):
            require(module, "ray")
        from ..serving.ray_app import RayServeOptions, run_ray_serve

        threads = options.get("threads")
        if replicas == "auto":
            choice = measured_split(options["engines"], "throughput", "--replicas")
            replicas, threads = choice.replicas, threads or choice.threads
        run_ray_serve(RayServeOptions(
            engines=Path(options["engines"]), voices_dir=options.get("voices_dir"), host=options["host"],
            port=options["port"], threads=threads, max_concurrent=options["max_concurrent"],
            max_queue=options["max_queue"], request_timeout_s=options["timeout_s"], replicas=replicas or 1,
            autoscale=_autoscale(autoscale), ray_address=ray_address, deterministic=options.get("deterministic"),
            settings={"max_segment_tokens": options["max_segment_tokens"], "work_admission": options["work_admission"]}
            | ({"api_key": options["api_key"]} if options.get("api_key") else {})
            | ({"default_voice": options["default_voice"]} if options.get("default_voice") else {})
            | ({"voice_aliases": _aliases(options.get("voice_aliases", ()))} if options.get("voice_aliases") else {}),
        ), progress=lambda message: click.echo(message, err=True))

    def _aliases(specs: tuple[str, ...]) -> dict[str, str]:
        from ..server.voice_names import parse_voice_aliases

        try:
            return parse_voice_aliases(specs)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--voice-alias") from None

    for option in reversed((
        click.option("--ray", is_flag=True, help="Serve as a Ray Serve deployment (one engine per replica)."),
        click.option("--replicas", type=CountOrAuto(), default=None,
                     help="--ray: replicas (default 1); auto: as `trt-cosy tune-threads` measured best for "
                          "throughput on this machine."),
        click.option("--autoscale", default=None, metavar="MIN:MAX", help="--ray: autoscale between MIN and MAX."),
        click.option("--ray-address", default=None,
                     help="--ray: a running cluster (ray://host:10001 or auto); default: a local Ray."),
    )):
        serve = option(serve)
    return serve


@click.command()
@click.option("--engines", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Engines directory from `trt-cosy build`.")
@click.option("--model-dir", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Official release directory instead of --engines: engines are built into the cache when needed.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Loopback by default; anything else should have --api-key.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--voices-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of stored voices (default: the trt-cosy cache, voices/<model id>).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="CPU threads per graph (default: the usable cores, or a worker's share of them; one engine: "
                   "what `trt-cosy tune-threads` measured faster here, if it did).")
@click.option("--workers", type=CountOrAuto(), default=None,
              help="Server processes behind the one port, each pinned to its own whole cores (one thread per "
                   "core, within one NUMA node where they fit). auto: the split `trt-cosy tune-threads` "
                   "measured best for throughput here. Default: one process.")
@click.option("--max-concurrent", type=click.IntRange(min=1), default=1, show_default=True,
              help="Syntheses running at once.")
@click.option("--max-queue", type=click.IntRange(min=0), default=8, show_default=True,
              help="Requests waiting for a slot; more are answered 429.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=0, min_open=True), default=300.0,
              show_default=True, help="Per-request time limit, seconds.")
@click.option("--api-key", envvar="TRT_COSY_API_KEY", default=None, show_envvar=True,
              help="Require 'Authorization: Bearer KEY' on every route but /health and the playground page.")
@click.option("--stream-default/--no-stream-default", "stream_speech", default=True, show_default=True,
              help="/v1/audio/speech streams wav and pcm unless the body says stream: false (as OpenAI's).")
@click.option("--max-segment-tokens", type=click.IntRange(min=1), default=200, show_default=True,
              help="Most text tokens in one sentence-segment; longer ones get 400 (render memory grows "
                   "with the square of a segment's length).")
@click.option("--deterministic/--no-deterministic", default=None,
              help="Batch-invariant decoding: a seed's audio is the same byte for byte whatever else the server "
                   "decodes (every shared decode step runs all slots; docs/determinism.md gives the cost). "
                   "Default: EngineConfig's.")
@click.option("--work-admission/--no-work-admission", default=True, show_default=True,
              help="Refuse at once (503 + Retry-After, or 413) a request that would not finish within "
                   "--timeout given the work already admitted; render admitted requests in order.")
@click.option("--default-voice", default=None, metavar="NAME",
              help="Stored voice that OpenAI's voice names (alloy, ash, ... verse) speak in when no voice of "
                   "that name is stored (clients such as Pipecat send only those).")
@click.option("--voice-alias", "voice_aliases", multiple=True, metavar="ALIAS=NAME[,...]",
              help="Speak a requested voice name in a stored voice, e.g. alloy=fox,echo=bob (repeatable).")
@backend_option()
@ray_serve_options
def serve(engines: Path | None, model_dir: Path | None, host: str, port: int, voices_dir: Path | None,
          threads: int | None, workers: int | str | None, max_concurrent: int, max_queue: int, timeout_s: float,
          api_key: str | None, stream_speech: bool, max_segment_tokens: int, deterministic: bool | None,
          work_admission: bool, default_voice: str | None, voice_aliases: tuple[str, ...], backend: str) -> None:
    """Serve an OpenAI-compatible speech API (POST /v1/audio/speech) with stored voices."""
    from ..errors import require

    for module in ("fastapi", "uvicorn", "python_multipart", "prometheus_client"):
        require(module, "serve")
    from ..cache_dir import cache_root
    from ..server import ServerSettings, run_server
    from ..server.voice_names import parse_voice_aliases
    from ..synthesis import EngineConfig
    from ..tts import CosyVoice

    try:
        aliases = parse_voice_aliases(voice_aliases)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--voice-alias") from None
    engines = engines_or_model_dir(engines, model_dir, backend)
    pinned = False
    if workers == "auto":
        choice = measured_split(engines, "throughput", "--workers")
        workers, threads, pinned = choice.replicas, threads or choice.threads, choice.pinned
    elif threads is None and (workers or 1) == 1:
        threads, pinned = _one_engine_split(engines)
    if workers is not None and workers > 1:
        _serve_workers(engines, backend, workers, threads, dict(
            voices_dir=voices_dir, host=host, port=port, max_concurrent=max_concurrent, max_queue=max_queue,
            request_timeout_s=timeout_s, api_key=api_key, stream_speech=stream_speech,
            max_segment_tokens=max_segment_tokens, work_admission=work_admission,
        ), deterministic)
        return
    if pinned:
        _pin_one_engine(threads)
    # The shared LLM decode loop gets one KV slot per synthesis the server runs at once.
    config = EngineConfig(threads=threads, llm_slots=max_concurrent, deterministic=deterministic)
    tts = CosyVoice.load(engines, backend=backend, config=config)
    settings = ServerSettings(
        voices_dir=voices_dir or cache_root() / "voices" / tts.model_id, host=host, port=port,
        max_concurrent=max_concurrent, max_queue=max_queue, request_timeout_s=timeout_s, api_key=api_key,
        stream_speech=stream_speech, max_segment_tokens=max_segment_tokens, work_admission=work_admission,
        default_voice=default_voice, voice_aliases=aliases,
    )
    click.echo(f"serving {tts.model_id} on http://{host}:{port} (voices in {settings.voices_dir})", err=True)
    click.echo(f"playground: http://{host}:{port}/" + ("" if api_key is None else " (API key required)"), err=True)
    run_server(tts, settings)


def _one_engine_split(engines: Path) -> tuple[int | None, bool]:
    """(threads, pinned) of one engine alone: the default (None, unpinned) unless `trt-cosy tune-threads`
    measured another single-engine split faster on this machine."""
    from ..runtime.thread_plan import ONE_ENGINE, planned_split

    choice = planned_split(engines, ONE_ENGINE)
    if choice is None or choice.default:
        return None, False
    click.echo(f"one engine: {choice.threads} thread(s){', pinned' if choice.pinned else ''}, measured faster "
               f"here than the default ({choice.reason})", err=True)
    return choice.threads, choice.pinned


def _pin_one_engine(threads: int | None) -> None:
    from ..runtime.cpu_budget import format_cpu_list, pin_process, read_budget

    slot = read_budget().plan(1, threads).slots[0]
    pin_process(slot.cpus)
    click.echo(f"pinned to CPUs {format_cpu_list(slot.cpus)}", err=True)


def _serve_workers(engines: Path, backend: str, workers: int, threads: int | None, settings: dict,
                   deterministic: bool | None = None) -> None:
    """``serve --workers N``: N pinned processes on one port (``server.workers``); exits with their error."""
    from ..server.workers import run_workers, worker_plan

    plan = worker_plan(workers, threads)
    click.echo(f"serving {engines} on http://{settings['host']}:{settings['port']} with {workers} workers "
               f"(Ctrl-C stops): {plan.describe()}", err=True)
    code = run_workers(plan, settings["host"], settings["port"], _serve_worker,
                       {"engines": str(engines), "backend": backend, "settings": settings,
                        "deterministic": deterministic},
                       progress=lambda message: click.echo(message, err=True))
    if code:
        raise SystemExit(code)


def _serve_worker(threads: int, sock, busy, index: int, engines: str, backend: str, settings: dict,
                  deterministic: bool | None = None) -> None:
    """One ``--workers`` process (already pinned): load the engines with ``threads`` and serve ``sock``."""
    from ..download import cache_root
    from ..server import ServerSettings
    from ..server.workers import serve_app_worker
    from ..synthesis import EngineConfig
    from ..tts import CosyVoice

    tts = CosyVoice.load(engines, backend=backend,
                         config=EngineConfig(threads=threads, llm_slots=settings["max_concurrent"],
                                             deterministic=deterministic))
    settings = dict(settings)
    settings["voices_dir"] = settings["voices_dir"] or cache_root() / "voices" / tts.model_id
    serve_app_worker(tts, ServerSettings(**settings), sock, busy, index)
