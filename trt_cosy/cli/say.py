"""`trt-cosy say`: speak a text into a wav file, with progress lines, optional playback and a clean Ctrl-C."""

from __future__ import annotations

import time
from pathlib import Path

import click

from .options import (
    chosen_voice,
    echo_progress,
    engine_options,
    load_tts,
    output_options,
    voice_choice,
    voice_options,
)


@click.command()
@click.argument("text")
@engine_options
@voice_options(
    "Reference recording of the voice (1-30 s).",
    "A preset speaker (CosyVoice-300M-SFT/-Instruct; see `trt-cosy voices list`).",
)
@click.option("--ref-text", default=None, help="Transcript of --ref (zero-shot); without it: cross-lingual.")
@click.option(
    "--instruct",
    default=None,
    help="How to speak: with --speaker for CosyVoice-300M-Instruct, with --ref/--voice for CosyVoice2/3.",
)
@output_options
@click.option("--stream", is_flag=True, help="Stream: write (and --play) audio while it is generated.")
@click.option("--play", is_flag=True, help="Also play the audio as it comes (aplay, paplay or ffplay).")
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
    from ..synthesis import AudioPlayer, SynthesisConfig

    missing = "pass --ref ref.wav (with --ref-text for zero-shot), --voice voice.npz or --speaker NAME."
    voice = voice_choice(ref, voice_file, speaker, missing)
    if ref_text is not None and ref is None:
        raise click.UsageError("--ref-text goes with --ref.")
    config = SynthesisConfig(stream=stream, instruct=instruct)
    tts = load_tts(engines, model_dir, source, threads, precision, quiet=quiet, backend=backend)
    voice = chosen_voice(tts, voice, ref, speaker, lambda path: tts.voice_from_wav(path, ref_text))
    chunks = tts.synthesize(text, voice, seed=seed, config=config)
    player = AudioPlayer.open(tts.sample_rate) if play else None
    if play and player is None:
        echo_progress("--play: no audio player found (aplay, paplay or ffplay); writing the file only")
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
        self._line(
            f"{self.where}{part}: {self.audio_s:.2f} s of audio so far "
            f"({first}elapsed {t['elapsed_s']:.2f} s, RTF {t['rtf']:.2f})"
        )

    def waiting(self) -> None:
        now = self._clock()
        if not self.quiet and now - self.last_line >= _HEARTBEAT_S:
            self._line(
                f"still synthesising ({self.where}, {self.audio_s:.2f} s of audio so far, "
                f"elapsed {now - self.started:.0f} s)"
            )

    def _line(self, message: str) -> None:
        self.last_line = self._clock()
        echo_progress(message)


def _temp_files(out: Path) -> set[Path]:
    """The temporary files ``write_audio`` makes next to ``out`` (``.<name>.<random>.tmp``)."""
    return set(out.parent.glob(f".{out.name}.*.tmp"))


def _write_interruptibly(chunks, out: Path, sample_rate: int, player, progress: _SynthesisProgress) -> None:
    """``write_audio`` in a worker thread so that Ctrl-C / SIGTERM stop `say` within about a second
    and leave no file, even while a long graph runs (``trt_cosy.interrupts``)."""
    from ..interrupts import Interrupted, run_interruptible
    from ..synthesis import write_audio

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
