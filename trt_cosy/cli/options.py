"""Options and helpers shared by the ``trt-cosy`` commands: progress lines, -v after a subcommand,
the engine options of `say` / `voices` / `serve` / `bench` and how they become an engines directory."""

from __future__ import annotations

import logging
from pathlib import Path

import click

BACKENDS = ("torch", "onnxruntime", "tensorrt", "openvino", "mixed")
SOURCES = ("huggingface", "modelscope")


def echo_progress(message: str) -> None:
    """One progress line on stderr (stdout keeps the command's result)."""
    click.echo(message, err=True)


def log_level(verbose: int) -> int:
    return logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG


def _more_verbose(ctx: click.Context, param: click.Parameter, verbose: int) -> None:
    """-v / -vv given after the subcommand: lower the root logger's level (never raise it)."""
    if verbose:
        root = logging.getLogger()
        root.setLevel(min(root.getEffectiveLevel(), log_level(verbose)))


def add_verbose_option(command: click.Command) -> None:
    """Accept -v / -vv after the subcommand too (``trt-cosy say ... -vv``), in every command."""
    command.params.append(
        click.Option(["-v", "--verbose"], count=True, expose_value=False, callback=_more_verbose,
                     help="-v for info, -vv for debug logging.")
    )
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            add_verbose_option(sub)


def check_one_of(**options: object) -> None:
    given = [name for name, value in options.items() if value is not None]
    if len(given) > 1:
        raise click.UsageError(f"pass only one of {', '.join('--' + name for name in options)}.")


def engines_dir(
    engines: Path | None,
    model_dir: Path | None,
    source: str,
    precision: str | None,
    quiet: bool = False,
    backend: str = "auto",
) -> Path:
    """--engines as given; --model-dir built into the cache when needed; neither: the default model."""
    from ..download import DEFAULT_MODEL, download_model, prepare_engines

    progress = None if quiet else echo_progress
    check_one_of(engines=engines, **{"model-dir": model_dir})
    if engines is not None:
        return engines
    if model_dir is None:
        if progress is not None:
            progress(f"no --engines or --model-dir: using {DEFAULT_MODEL} (downloaded and built on first use)")
        model_dir = download_model(DEFAULT_MODEL, source, progress=progress)
    return prepare_engines(model_dir, progress=progress, precision=precision, backend=backend)


def engines_or_model_dir(engines: Path | None, model_dir: Path | None, backend: str = "auto") -> Path:
    """`serve` and `bench`: --engines, or engines built into the cache from --model-dir (one is needed)."""
    if engines is None and model_dir is None:
        raise click.UsageError("pass --engines ENGINES (from `trt-cosy build`) or --model-dir RELEASE_DIR.")
    return engines_dir(engines, model_dir, "huggingface", None, backend=backend)


def load_tts(
    engines: Path | None,
    model_dir: Path | None,
    source: str,
    threads: int | None,
    precision: str | None,
    quiet: bool = False,
    backend: str = "auto",
):
    from ..synthesis import EngineConfig
    from ..tts import CosyVoice

    path = engines_dir(engines, model_dir, source, precision, quiet, backend)
    return CosyVoice.load(path, backend=backend, config=EngineConfig(threads=threads))


def backend_option():
    """--backend of `say`, `voices`, `serve` and `bench`: which engines --model-dir / the default model
    are built into the cache for (auto: runtime.backend_choice); with --engines, how to load them."""
    return click.option(
        "--backend",
        type=click.Choice(["auto", "onnxruntime", "tensorrt", "openvino", "mixed"]),
        default="auto",
        show_default=True,
        help="auto: tensorrt fp16 where a CUDA GPU and TensorRT are present, else mixed int4 where OpenVINO has "
        "bf16 kernels, else onnxruntime int4; "
        "with --engines, the engines' own backend.",
    )


def engine_options(command):
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
            type=click.Choice(SOURCES),
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
        backend_option(),
    )
    for option in reversed(options):
        command = option(command)
    return command


# The options ``say`` and ``convert`` share: the voice (a recording, a stored voice, a preset speaker),
# the output wav, the seed and quiet.
def ref_option(help: str):
    """``--ref``: a reference recording of the voice (``help`` says what it is to the command)."""
    return click.option(
        "--ref", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None, help=help
    )


def speaker_option(help: str):
    """``--speaker``: a preset speaker of CosyVoice-300M-SFT/-Instruct."""
    return click.option("--speaker", default=None, help=help)


def voice_choice(ref: Path | None, voice_file: Path | None, speaker: str | None, missing: str):
    """The stored voice of ``--voice`` (loaded now, before the engines), or None for ``--ref`` /
    ``--speaker``; ``UsageError`` when more than one or none (``missing`` says what to pass) is given."""
    from ..frontend.voice import Voice

    check_one_of(ref=ref, voice=voice_file, speaker=speaker)
    if ref is None and voice_file is None and speaker is None:
        raise click.UsageError(missing)
    return Voice.load(voice_file) if voice_file is not None else None


voice_file_option = click.option(
    "--voice",
    "voice_file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A voice file from `trt-cosy voices save` (instead of --ref).",
)
out_option = click.option(
    "-o", "--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Output wav."
)
seed_option = click.option("--seed", type=click.IntRange(min=0), default=None, help="Same seed, same audio.")
quiet_option = click.option(
    "-q", "--quiet", is_flag=True, help="No progress lines on stderr (errors are still shown)."
)


def voice_options(ref_help: str, speaker_help: str):
    """``--ref``, ``--voice`` and ``--speaker``: one of them names the voice (``voice_choice``)."""

    def apply(command):
        for option in (speaker_option(speaker_help), voice_file_option, ref_option(ref_help)):
            command = option(command)
        return command

    return apply


def chosen_voice(tts, stored, ref: Path | None, speaker: str | None, from_ref):
    """The voice the options named, once the engines are loaded: ``from_ref(ref)`` for ``--ref``, the
    preset ``speaker`` (an error in command-line terms when the model has none or not that one), else
    ``stored`` (``voice_choice``'s ``--voice``)."""
    if ref is not None:
        return from_ref(ref)
    if speaker is None:
        return stored
    from ..errors import InputError

    if not tts.speakers:
        raise InputError(
            f"this model has no preset speakers (only CosyVoice-300M-SFT and -Instruct have them), so "
            f"--speaker {speaker} cannot be used; use --ref ref.wav [--ref-text ...] or --voice voice.npz."
        )
    if speaker not in tts.speakers:
        raise InputError(f"unknown speaker {speaker!r}; this model has: {', '.join(tts.speakers)}.")
    return tts.preset_voice(speaker)


def output_options(command):
    """``-o/--out``, ``--seed`` and ``-q/--quiet`` (``say``, ``convert``)."""
    for option in (quiet_option, seed_option, out_option):
        command = option(command)
    return command


class CountOrAuto(click.ParamType):
    """A count >= 1, or ``auto``: the number measured on this machine (``trt-cosy tune-threads``)."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or value == "auto" or isinstance(value, int):
            return value
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither a count nor 'auto'.", param, ctx)
        if number < 1:
            self.fail(f"{value!r}: need at least 1.", param, ctx)
        return number


def measured_split(engines: Path, objective: str, option: str):
    """The split ``trt-cosy tune-threads`` measured for ``engines`` on this machine (``thread_plan``), for
    ``option auto``; a usage error saying how to measure it where none was."""
    from ..runtime.thread_plan import planned_split

    choice = planned_split(engines, objective)
    if choice is None:
        raise click.UsageError(
            f"{option} auto: no split of this machine's cores was measured for {engines}; run "
            f"`trt-cosy tune-threads --engines {engines}` here first, or give {option} N.")
    echo_progress(f"{option} auto: measured on this machine: {choice.describe()}")
    return choice
