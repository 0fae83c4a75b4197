"""The ``trt-cosy`` command line. Thin: parse options, call the library, report errors."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import click

from .errors import InputError, TrtCosyError
from .serving.cli import ray_serve_options, triton_repo
from .version import __version__

_LOGGER = logging.getLogger(__name__)

_BACKENDS = ("torch", "onnxruntime", "tensorrt", "openvino", "mixed")


class _Group(click.Group):
    """Turns TrtCosyError into a one-line message and exit status 2 (no traceback); Ctrl-C and SIGTERM
    into a line and the shell's status for the signal (130, 143)."""

    def invoke(self, ctx: click.Context):
        from .interrupts import exit_status, signal_name, sigterm_raises

        try:
            with sigterm_raises():  # SIGTERM unwinds like Ctrl-C: temporary files are removed
                return super().invoke(ctx)
        except TrtCosyError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)
        except KeyboardInterrupt as exc:
            click.echo(f"interrupted ({signal_name(exc)})", err=True)
            if threading.active_count() > 1:
                # The main thread's cleanup (temporary files) has run. Engine threads may still be inside
                # ONNX Runtime (the shared LLM decode loop, a graph being cancelled): a normal interpreter
                # exit would tear them down mid-call and abort ("terminate called ..."); leave at once.
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(exit_status(exc))
            sys.exit(exit_status(exc))


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="trt-cosy")
@click.option("-v", "--verbose", count=True, help="-v for info, -vv for debug logging.")
def main(verbose: int) -> None:
    """Fast CosyVoice inference: build engines, verify parity, speak."""
    logging.basicConfig(level=_log_level(verbose), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _log_level(verbose: int) -> int:
    return logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG


def _more_verbose(ctx: click.Context, param: click.Parameter, verbose: int) -> None:
    """-v / -vv given after the subcommand: lower the root logger's level (never raise it)."""
    if verbose:
        root = logging.getLogger()
        root.setLevel(min(root.getEffectiveLevel(), _log_level(verbose)))


def _add_verbose_option(command: click.Command) -> None:
    """Accept -v / -vv after the subcommand too (``trt-cosy say ... -vv``), in every command."""
    command.params.append(
        click.Option(["-v", "--verbose"], count=True, expose_value=False, callback=_more_verbose,
                     help="-v for info, -vv for debug logging.")
    )
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _add_verbose_option(sub)


@main.command()
@click.option("--model-dir", required=True, type=click.Path(path_type=Path), help="Official release directory.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Engines directory to write (e.g. engines/cosyvoice2/onnxruntime-fp32).")
@click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt", "openvino", "mixed"]), default="auto",
              show_default=True,
              help="auto: tensorrt fp16 where a CUDA GPU and TensorRT are present, else onnxruntime int4 "
                   "(the fastest measured CPU engines); says which in one line.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4"]), default=None,
              help="Default: int4 for onnxruntime (4-bit LLM, int8 flow; fp32 for `trt-cosy verify` parity), "
                   "fp16 for tensorrt, bf16 for openvino. See docs/precision.md.")
@click.option("--force", is_flag=True, help="Rebuild even when the manifest says nothing changed.")
@click.option("--onnx-only", is_flag=True,
              help="TensorRT: write fp16 graphs, profiles and manifest only (no GPU needed); plans come later.")
def build(model_dir: Path, out_dir: Path, backend: str, precision: str | None, force: bool, onnx_only: bool) -> None:
    """Export the official checkpoint to ONNX per stage and build engines for a backend."""
    from .errors import require

    require("torch", "build")
    require("onnx", "build")
    from .build.engines import build_engines
    from .runtime.backend_choice import AUTO, BackendChoice, resolve_backend

    choice = resolve_backend(backend, precision)
    if onnx_only and backend == AUTO:  # --onnx-only writes TensorRT inputs, whatever this machine has
        choice = BackendChoice("tensorrt", precision or "fp16", "--onnx-only writes TensorRT inputs")
    if backend == AUTO:
        _progress(choice.line())
    path = build_engines(model_dir, out_dir, backend=choice.backend, precision=choice.precision, force=force,
                         progress=lambda message: click.echo(message, err=True), onnx_only=onnx_only,
                         backend_reason=choice.reason)
    click.echo(f"engines ready in {path}")


@main.command()
@click.option("--model-dir", required=True, type=click.Path(path_type=Path), help="Official release directory.")
@click.option("--golden", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A golden reference.npz made by the official code.")
@click.option("--backend", type=click.Choice(_BACKENDS), default="torch", show_default=True)
@click.option("--engines", type=click.Path(path_type=Path), default=None,
              help="Engines directory (onnxruntime / tensorrt / openvino backends).")
@click.option("--threads", type=int, default=None, help="CPU threads for the backend.")
def verify(model_dir: Path, golden: Path, backend: str, engines: Path | None, threads: int | None) -> None:
    """Compare every stage with the official outputs in a golden file (CosyVoice 1, 2 or 3); exit 1 on any failure."""
    from .verify import format_table, load_backend, run_verify
    from .verify.golden import GoldenSet

    model = load_backend(backend, model_dir, engines, threads)
    rows = run_verify(model, GoldenSet.load(golden))
    click.echo(format_table(rows))
    if any(row.status == "FAIL" for row in rows):
        precision = _engines_precision(engines)
        if precision in ("int8", "int4"):
            _progress(f"note: {engines} holds {precision} engines; verify's tolerances are those of fp32 engines. "
                      "Check parity on `trt-cosy build --precision fp32` engines; the quality guard of reduced "
                      "precisions is bench/quality_guard.py (docs/precision.md).")
        sys.exit(1)


def _engines_precision(engines: Path | None) -> str | None:
    """The precision an engines directory's manifest records, or None (no engines, unreadable)."""
    if engines is None:
        return None
    from .errors import TrtCosyError
    from .runtime.manifest import Manifest

    try:
        return Manifest.read(engines).precision
    except (TrtCosyError, OSError, ValueError):
        return None


@main.command("make-test-model")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--family", type=click.Choice(["v1", "v2", "v3"]), default="v2", show_default=True,
              help="v1: CosyVoice-300M-SFT layout, v2: CosyVoice2-0.5B, v3: Fun-CosyVoice3-0.5B.")
@click.option("--size", type=click.Choice(["tiny", "full"]), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --out directory.")
def make_test_model(out: Path, family: str, size: str, seed: int, overwrite: bool) -> None:
    """Write a random-weight release directory (official layout) for tests and benchmarks."""
    from .errors import InputError, require

    if out.is_dir() and any(out.iterdir()) and not overwrite:  # before the slow torch import
        raise InputError(f"{out} exists and is not empty; choose another --out or pass --overwrite.")
    require("torch", "build")
    from .build.testmodel import make_test_model as write

    path = write(out, size=size, seed=seed, overwrite=overwrite, family=family)
    click.echo(
        f"wrote {size} random-weight {family} test model to {path} (not a real voice: audio is noise-like)"
    )


_SOURCES = ("huggingface", "modelscope")


def _progress(message: str) -> None:
    click.echo(message, err=True)


def _check_one_of(**options: object) -> None:
    given = [name for name, value in options.items() if value is not None]
    if len(given) > 1:
        raise click.UsageError(f"pass only one of {', '.join('--' + name for name in options)}.")


def _engines_dir(
    engines: Path | None,
    model_dir: Path | None,
    source: str,
    precision: str | None,
    quiet: bool = False,
    backend: str = "auto",
) -> Path:
    """--engines as given; --model-dir built into the cache when needed; neither: the default model."""
    from .download import DEFAULT_MODEL, download_model, prepare_engines

    progress = None if quiet else _progress
    _check_one_of(engines=engines, **{"model-dir": model_dir})
    if engines is not None:
        return engines
    if model_dir is None:
        if progress is not None:
            progress(f"no --engines or --model-dir: using {DEFAULT_MODEL} (downloaded and built on first use)")
        model_dir = download_model(DEFAULT_MODEL, source, progress=progress)
    return prepare_engines(model_dir, progress=progress, precision=precision, backend=backend)


def _engines_or_model_dir(engines: Path | None, model_dir: Path | None, backend: str = "auto") -> Path:
    """`serve` and `bench`: --engines, or engines built into the cache from --model-dir (one is needed)."""
    if engines is None and model_dir is None:
        raise click.UsageError("pass --engines ENGINES (from `trt-cosy build`) or --model-dir RELEASE_DIR.")
    return _engines_dir(engines, model_dir, "huggingface", None, backend=backend)


def _load_tts(
    engines: Path | None,
    model_dir: Path | None,
    source: str,
    threads: int | None,
    precision: str | None,
    quiet: bool = False,
    backend: str = "auto",
):
    from .synthesis import EngineConfig
    from .tts import CosyVoice

    path = _engines_dir(engines, model_dir, source, precision, quiet, backend)
    return CosyVoice.load(path, backend=backend, config=EngineConfig(threads=threads))


def _backend_option():
    """--backend of `say`, `voices`, `serve` and `bench`: which engines --model-dir / the default model
    are built into the cache for (auto: runtime.backend_choice); with --engines, how to load them."""
    return click.option(
        "--backend",
        type=click.Choice(["auto", "onnxruntime", "tensorrt", "openvino", "mixed"]),
        default="auto",
        show_default=True,
        help="auto: tensorrt fp16 where a CUDA GPU and TensorRT are present, else onnxruntime int4; "
        "with --engines, the engines' own backend.",
    )


def _engine_options(command):
    """--engines / --model-dir / --source / --threads / --precision / --backend, shared by `say` and `voices`."""
    options = (
        click.option(
            "--engines",
            type=click.Path(file_okay=False, path_type=Path),
            default=None,
            help="Engines directory from `trt-cosy build`.",
        ),
        click.option(
            "--model-dir",
            type=click.Path(exists=True, file_okay=False, path_type=Path),
            default=None,
            help="Official release directory; engines are built into the cache when needed.",
        ),
        click.option(
            "--source",
            type=click.Choice(_SOURCES),
            default="huggingface",
            show_default=True,
            help="Where the default model is downloaded from (neither --engines nor --model-dir).",
        ),
        click.option(
            "--threads", type=int, default=None, help="CPU threads per graph (default: physical cores)."
        ),
        click.option(
            "--precision",
            type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4"]),
            default=None,
            help="Engines built into the cache for --model-dir / the default model (default: the backend's, "
            "int4 for onnxruntime, fp16 for tensorrt).",
        ),
        _backend_option(),
    )
    for option in reversed(options):
        command = option(command)
    return command


@main.command()
@click.argument("text")
@_engine_options
@click.option(
    "--ref",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Reference recording of the voice (1-30 s).",
)
@click.option("--ref-text", default=None, help="Transcript of --ref (zero-shot); without it: cross-lingual.")
@click.option(
    "--voice",
    "voice_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A voice file from `trt-cosy voices save` (instead of --ref).",
)
@click.option(
    "--speaker",
    default=None,
    help="A preset speaker (CosyVoice-300M-SFT/-Instruct; see `trt-cosy voices list`).",
)
@click.option(
    "--instruct",
    default=None,
    help="How to speak: with --speaker for CosyVoice-300M-Instruct, with --ref/--voice for CosyVoice2/3.",
)
@click.option(
    "-o", "--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Output wav."
)
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Same seed, same audio.")
@click.option("--stream", is_flag=True, help="Stream: write (and --play) audio while it is generated.")
@click.option("--play", is_flag=True, help="Also play the audio as it comes (aplay, paplay or ffplay).")
@click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr (errors are still shown).")
def say(
    text: str,
    engines: Path | None,
    model_dir: Path | None,
    source: str,
    threads: int | None,
    precision: str | None,
    ref: Path | None,
    ref_text: str | None,
    voice_file: Path | None,
    speaker: str | None,
    instruct: str | None,
    out: Path,
    seed: int | None,
    stream: bool,
    play: bool,
    quiet: bool,
    backend: str,
) -> None:
    """Speak TEXT in the voice of --ref, --voice or --speaker into a wav file (written atomically).

    The text is normalised and merged into segments as the official frontend does; segments are
    spoken one after another (with --stream, each in several chunks as the LLM speaks). Ctrl-C or
    SIGTERM stops within about a second and leaves no file.
    """
    from .frontend.voice import Voice
    from .synthesis import AudioPlayer, SynthesisConfig

    _check_one_of(ref=ref, voice=voice_file, speaker=speaker)
    if ref is None and voice_file is None and speaker is None:
        raise click.UsageError(
            "pass --ref ref.wav (with --ref-text for zero-shot), --voice voice.npz or --speaker NAME."
        )
    if ref_text is not None and ref is None:
        raise click.UsageError("--ref-text goes with --ref.")
    config = SynthesisConfig(stream=stream, instruct=instruct)
    voice = Voice.load(voice_file) if voice_file is not None else speaker
    tts = _load_tts(engines, model_dir, source, threads, precision, quiet=quiet, backend=backend)
    if voice is None:
        voice = tts.voice_from_wav(ref, ref_text)
    elif isinstance(voice, str):
        voice = _preset_voice(tts, voice)
    chunks = tts.synthesize(text, voice, seed=seed, config=config)
    player = AudioPlayer.open(tts.sample_rate) if play else None
    if play and player is None:
        _progress("--play: no audio player found (aplay, paplay or ffplay); writing the file only")
    progress = _SynthesisProgress(stream=stream, quiet=quiet)
    try:
        _write_interruptibly(chunks, out, tts.sample_rate, player, progress)
    except BaseException:
        if player is not None:
            player.close(wait=False)
        raise
    if player is not None:
        player.close()  # until everything was played
    click.echo(f"wrote {out}")


def _preset_voice(tts, name: str):
    """``tts``'s preset speaker ``name``, or an error in command-line terms."""
    from .errors import InputError

    if not tts.speakers:
        raise InputError(
            f"this model has no preset speakers (only CosyVoice-300M-SFT and -Instruct have them), so "
            f"--speaker {name} cannot be used; use --ref ref.wav [--ref-text ...] or --voice voice.npz."
        )
    if name not in tts.speakers:
        raise InputError(f"unknown speaker {name!r}; this model has: {', '.join(tts.speakers)}.")
    return tts.preset_voice(name)


_PROGRESS_AFTER_S = 2.0  # synthesis shorter than this prints no progress (unless --stream)
_HEARTBEAT_S = 5.0  # with no new audio for this long, say that work goes on


class _SynthesisProgress:
    """Progress lines of `say` on stderr: per chunk (segment i/n, audio so far, RTF) and a heartbeat."""

    def __init__(self, stream: bool, quiet: bool):
        self._clock = time.perf_counter
        self.stream, self.quiet = stream, quiet
        self.started = self.last_line = self._clock()
        self.audio_s = 0.0
        self.where = "segment 1"

    def chunk(self, chunk) -> None:
        t = chunk.timings
        self.audio_s += chunk.duration
        self.where = f"segment {chunk.segment + 1}/{chunk.segments}"
        if self.quiet or not (self.stream or t["elapsed_s"] >= _PROGRESS_AFTER_S):
            return
        part = f", chunk {chunk.index + 1}" if self.stream else ""
        first = f"first audio {t['first_audio_s']:.2f} s, " if self.stream else ""
        self._line(f"{self.where}{part}: {self.audio_s:.2f} s of audio so far "
                   f"({first}elapsed {t['elapsed_s']:.2f} s, RTF {t['rtf']:.2f})")

    def waiting(self) -> None:
        now = self._clock()
        if not self.quiet and now - self.last_line >= _HEARTBEAT_S:
            self._line(f"still synthesising ({self.where}, {self.audio_s:.2f} s of audio so far, "
                       f"elapsed {now - self.started:.0f} s)")

    def _line(self, message: str) -> None:
        self.last_line = self._clock()
        _progress(message)


def _temp_files(out: Path) -> set[Path]:
    """The temporary files ``write_audio`` makes next to ``out`` (``.<name>.<random>.tmp``)."""
    return set(out.parent.glob(f".{out.name}.*.tmp"))


def _write_interruptibly(chunks, out: Path, sample_rate: int, player, progress: _SynthesisProgress) -> None:
    """``write_audio`` in a worker thread so that Ctrl-C / SIGTERM stop `say` within about a second
    and leave no file, even while a long graph runs (``trt_cosy.interrupts``)."""
    from .interrupts import Interrupted, run_interruptible
    from .synthesis import write_audio

    before = _temp_files(out) if out.parent.is_dir() else set()

    def work(stop) -> Path:
        def on_chunk(chunk) -> None:
            if stop.is_set():
                raise Interrupted()  # write_audio removes its temporary file and closes the synthesis
            if player is not None:
                player.play(chunk)
            progress.chunk(chunk)

        return write_audio(chunks, out, sample_rate, on_chunk=on_chunk)

    def abandon() -> None:
        if player is not None:
            player.close(wait=False)
        for path in _temp_files(out) - before:
            path.unlink(missing_ok=True)

    run_interruptible(work, abandon, on_wait=progress.waiting, name="trt-cosy-say")


@main.group()
def voices() -> None:
    """Make and keep voices (the prompt features of a reference recording) as files."""


@voices.command("save")
@click.option(
    "--ref",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Reference recording (1-30 s).",
)
@click.option("--ref-text", default=None, help="Transcript of --ref (zero-shot); without it: cross-lingual.")
@_engine_options
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Voice file to write (.npz).",
)
def voices_save(
    ref: Path,
    ref_text: str | None,
    engines: Path | None,
    model_dir: Path | None,
    source: str,
    threads: int | None,
    precision: str | None,
    backend: str,
    out: Path,
) -> None:
    """Make a voice from --ref and save it as one file, for `trt-cosy say --voice`."""
    tts = _load_tts(engines, model_dir, source, threads, precision, backend=backend)
    voice = tts.voice_from_wav(ref, ref_text)
    voice.save(out)
    mode = "zero-shot" if voice.prompt_text else "cross-lingual"
    click.echo(f"wrote {mode} voice ({voice.speech_tokens.shape[0]} prompt tokens) to {out}")


@voices.command("list")
@_engine_options
def voices_list(
    engines: Path | None,
    model_dir: Path | None,
    source: str,
    threads: int | None,
    precision: str | None,
    backend: str,
) -> None:
    """Print the model's preset speakers, one per line (for `trt-cosy say --speaker NAME`)."""
    tts = _load_tts(engines, model_dir, source, threads, precision, backend=backend)
    if not tts.speakers:
        _progress(
            "this model has no preset speakers (only CosyVoice-300M-SFT/-Instruct have them); "
            "make voices with `trt-cosy voices save --ref ref.wav`"
        )
    for name in tts.speakers:
        click.echo(name)


@main.command()
@click.argument("name", default="CosyVoice2-0.5B")
@click.option("--source", type=click.Choice(_SOURCES), default="huggingface", show_default=True)
@click.option(
    "--dir",
    "target",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to put the release (default: the trt-cosy cache, $TRT_COSY_CACHE).",
)
def download(name: str, source: str, target: Path | None) -> None:
    """Fetch a release (NAME: CosyVoice2-0.5B or a repository id) with the files inference needs."""
    from .download import download_model

    path = download_model(name, source, target, progress=_progress)
    click.echo(
        f'release ready in {path}; speak with: trt-cosy say "Hello." --model-dir {path} --ref ref.wav -o out.wav'
    )


@main.command()
@click.option("--engines", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Engines directory from `trt-cosy build`.")
@click.option("--model-dir", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Official release directory instead of --engines: engines are built into the cache when needed.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind. Loopback by default; anything else should have --api-key.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--voices-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of stored voices (default: the trt-cosy cache, voices/<model id>).")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads per graph.")
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
@_backend_option()
@ray_serve_options
def serve(engines: Path | None, model_dir: Path | None, host: str, port: int, voices_dir: Path | None,
          threads: int | None, max_concurrent: int, max_queue: int, timeout_s: float, api_key: str | None,
          stream_speech: bool, backend: str) -> None:
    """Serve an OpenAI-compatible speech API (POST /v1/audio/speech) with stored voices."""
    from .errors import require

    for module in ("fastapi", "uvicorn", "python_multipart", "prometheus_client"):
        require(module, "serve")
    from .download import cache_root
    from .server import ServerSettings, run_server
    from .synthesis import EngineConfig
    from .tts import CosyVoice

    engines = _engines_or_model_dir(engines, model_dir, backend)
    # The shared LLM decode loop gets one KV slot per synthesis the server runs at once.
    tts = CosyVoice.load(engines, backend=backend, config=EngineConfig(threads=threads, llm_slots=max_concurrent))
    settings = ServerSettings(
        voices_dir=voices_dir or cache_root() / "voices" / tts.model_id, host=host, port=port,
        max_concurrent=max_concurrent, max_queue=max_queue, request_timeout_s=timeout_s, api_key=api_key,
        stream_speech=stream_speech,
    )
    click.echo(f"serving {tts.model_id} on http://{host}:{port} (voices in {settings.voices_dir})", err=True)
    click.echo(f"playground: http://{host}:{port}/" + ("" if api_key is None else " (API key required)"), err=True)
    run_server(tts, settings)


@main.command()
@click.option("--engines", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Engines directory to measure (trt-cosy build --out).")
@click.option("--model-dir", default=None, type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Official release directory instead of --engines: engines are built into the cache when needed.")
@click.option("--tokens", type=int, default=250, show_default=True, help="Speech tokens per run (25 per second of audio).")
@click.option("--text", default=None, help="Text to tokenise instead of 24 random text tokens.")
@click.option("--stream", is_flag=True,
              help="Also time the first audio of a streaming request (3, 5 and 10 s reference voices).")
@click.option("--runs", type=int, default=3, show_default=True, help="Timed runs (medians and spread).")
@click.option("--warmup", type=int, default=1, show_default=True, help="Untimed runs first.")
@click.option("--threads", type=int, default=None, help="Intra-op threads per session (default: physical cores).")
@click.option("--no-cold-start", is_flag=True, help="Do not time fresh processes from start to ready.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the full report as JSON.")
@click.option("--concurrency", default=None, metavar="N[,N...]",
              help="Instead: N streaming requests at once through one CosyVoice (e.g. 1,2,4,8): aggregate "
                   "decode tokens/s, audio seconds per wall second, time to first audio p50/p95.")
@click.option("--compare-unbatched", is_flag=True,
              help="With --concurrency: also run each round with every request decoding alone.")
def bench(engines: Path | None, model_dir: Path | None, tokens: int, text: str | None, stream: bool, runs: int,
          warmup: int, threads: int | None, no_cold_start: bool, json_out: Path | None, concurrency: str | None,
          compare_unbatched: bool) -> None:
    """Time LLM prefill/decode, flow, HiFT, RTF, first audio, cold start and peak RSS of an engines directory."""
    import json

    from .bench.speed import BenchOptions, format_bench, run_bench

    engines = _engines_or_model_dir(engines, model_dir)
    if concurrency is not None:
        _bench_concurrency(engines, concurrency, text, runs, warmup, threads, compare_unbatched, json_out)
        return

    options = BenchOptions(tokens=tokens, text=text, stream=stream, runs=runs, warmup=warmup, threads=threads,
                           cold_start=not no_cold_start)
    report = run_bench(engines, options, progress=_progress)
    click.echo(format_bench(report))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


def _bench_concurrency(engines: Path, levels: str, text: str | None, runs: int, warmup: int,
                       threads: int | None, compare_unbatched: bool, json_out: Path | None) -> None:
    import json

    from .bench.concurrency import ConcurrencyOptions, format_concurrency, run_concurrency_bench

    try:
        parsed = tuple(int(item) for item in levels.split(","))
    except ValueError:
        raise InputError(f"--concurrency takes positive integers separated by commas, got {levels!r}.") from None
    options = ConcurrencyOptions(levels=parsed, runs=runs, warmup=warmup, threads=threads,
                                 compare_unbatched=compare_unbatched,
                                 **({"text": text} if text is not None else {}))
    report = run_concurrency_bench(engines, options, progress=_progress)
    click.echo(format_concurrency(report))
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


main.add_command(triton_repo)

for _command in main.commands.values():  # keep last: after every command is defined
    _add_verbose_option(_command)


if __name__ == "__main__":  # pragma: no cover
    main()
