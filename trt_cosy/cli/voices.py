"""`trt-cosy voices save` and `voices list`: voices (prompt features of a recording) as files, preset speakers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from .options import echo_progress, engine_options, load_tts


@click.group()
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
@engine_options
@click.option(
    "-o",
    "--out",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Voice file to write (.npz).",
)
def voices_save(ref: Path, ref_text: str | None, out: Path, **engine: Any) -> None:
    """Make a voice from --ref and save it as one file, for `trt-cosy say --voice`."""
    tts = load_tts(**engine)  # engine: the ``engine_options`` values, by name
    voice = tts.voice_from_wav(ref, ref_text)
    voice.save(out)
    mode = "zero-shot" if voice.prompt_text else "cross-lingual"
    click.echo(f"wrote {mode} voice ({voice.speech_tokens.shape[0]} prompt tokens) to {out}")


@voices.command("list")
@engine_options
def voices_list(**engine: Any) -> None:
    """Print the model's preset speakers, one per line (for `trt-cosy say --speaker NAME`)."""
    tts = load_tts(**engine)
    if not tts.speakers:
        echo_progress(
            "this model has no preset speakers (only CosyVoice-300M-SFT/-Instruct have them); "
            "make voices with `trt-cosy voices save --ref ref.wav`"
        )
    for name in tts.speakers:
        click.echo(name)
