"""`trt-cosy convert`: voice conversion (official ``inference_vc``) of a recording into a wav file,
with the progress lines and the clean Ctrl-C of `say`."""

from __future__ import annotations

from pathlib import Path

import click

from .options import chosen_voice, engine_options, load_tts, output_options, voice_choice, voice_options
from .say import _SynthesisProgress, _write_interruptibly


@click.command()
@click.argument("source_wav", type=click.Path(dir_okay=False, path_type=Path))
@engine_options
@voice_options(
    "Reference recording of the target voice (1-30 s): the official VC prompt.",
    "A preset speaker (CosyVoice-300M-SFT/-Instruct).",
)
@output_options
@click.option("--stream", is_flag=True, help="Stream: write audio while it is generated.")
def convert(
    source_wav: Path,
    engines: Path | None,
    model_dir: Path | None,
    source: str,
    threads: int | None,
    precision: str | None,
    ref: Path | None,
    voice_file: Path | None,
    speaker: str | None,
    out: Path,
    seed: int | None,
    stream: bool,
    quiet: bool,
    backend: str,
) -> None:
    """Say what SOURCE_WAV says, with its timing and intonation, in the voice of --ref, --voice or
    --speaker (voice conversion), into a wav file written atomically.

    Any rate from 8 kHz, mono or not; a source longer than 30 s is converted in windows cut at
    pauses. Ctrl-C or SIGTERM stops within about a second and leaves no file.
    """
    from ..synthesis import SynthesisConfig

    voice = voice_choice(
        ref,
        voice_file,
        speaker,
        "pass the target voice: --ref target.wav, --voice voice.npz or --speaker NAME.",
    )
    config = SynthesisConfig(stream=stream)
    tts = load_tts(engines, model_dir, source, threads, precision, quiet=quiet, backend=backend)
    voice = chosen_voice(tts, voice, ref, speaker, tts.vc_voice_from_wav)
    chunks = tts.convert(source_wav, voice, seed=seed, config=config)  # the source is checked here
    progress = _SynthesisProgress(stream=stream, quiet=quiet)
    _write_interruptibly(chunks, out, tts.sample_rate, None, progress)
    click.echo(f"wrote {out}")
