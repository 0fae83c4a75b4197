"""Voice conversion (``CosyVoice.convert``, ``trt-cosy convert``): long sources in windows cut at pauses,
bad input, the source forms, the async twin, and the command line with its clean interrupts.

The tiny CosyVoice2 engines have random weights: lengths, join positions and errors are checked, not
sound (tests/test_convert_parity.py checks the numbers against the official code).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile
from _convert_support import load_family
from _support import BLOCK_TORCH, tiny_engines
from click.testing import CliRunner

from trt_cosy import InputError, SynthesisConfig
from trt_cosy.cli import main
from trt_cosy.conversion import SOURCE_RATE, WINDOW_SECONDS, pause_windows, read_source

pytest.importorskip("torch", reason="needs the [build] extra (torch) to build the tiny engines")

ROOT = Path(__file__).resolve().parents[1]
SPEECH = Path(__file__).parent / "data" / "features" / "audio" / "en_16k_mono.wav"  # 4.36 s
TARGET = Path(__file__).parent / "data" / "features" / "audio" / "zh_16k_mono.wav"
SAMPLES_PER_TOKEN = 960  # CosyVoice2: 2 mel frames of 480 samples at 24 kHz per 25 Hz token


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return load_family(tmp_path_factory, "v2")


@pytest.fixture(scope="module")
def target(tts):
    return tts.vc_voice_from_wav(TARGET)


def _speech_with_pauses(seconds: float, pauses_at: list[float]) -> np.ndarray:
    """Tiled speech [N] at 16 kHz with 0.4 s of silence centred on each of ``pauses_at`` (s)."""
    speech, rate = soundfile.read(SPEECH, dtype="float32")
    assert rate == SOURCE_RATE
    total = int(seconds * SOURCE_RATE)
    wav = np.tile(speech, total // speech.size + 1)[:total].copy()
    wav[np.abs(wav) < 1e-3] = 1e-3  # espeak's own silences are no quieter than the rest here
    for at in pauses_at:
        middle = int(at * SOURCE_RATE)
        wav[middle - 3200 : middle + 3200] = 0.0
    return wav


# ----------------------------------------------------------------------------- windows (pure)


def test_pause_windows_cut_in_the_pauses_and_cover_the_source():
    wav = _speech_with_pauses(70.0, [22.0, 47.5])
    windows = pause_windows(wav)
    assert [window.start for window in windows[1:]] == [window.end for window in windows[:-1]]
    assert windows[0].start == 0 and windows[-1].end == wav.size
    cuts = [window.start / SOURCE_RATE for window in windows[1:]]
    assert len(cuts) == 2 and abs(cuts[0] - 22.0) <= 0.2 and abs(cuts[1] - 47.5) <= 0.2, cuts
    assert all(window.end - window.start <= WINDOW_SECONDS * SOURCE_RATE for window in windows)
    assert all(window.start % 640 == 0 for window in windows)  # on whole token periods
    # No pause at all: still windows of at most 30 s; 30 s or less: one window.
    flat = pause_windows(np.ones(70 * SOURCE_RATE, np.float32))
    assert all(w.end - w.start <= WINDOW_SECONDS * SOURCE_RATE for w in flat)
    assert len(pause_windows(wav[: 30 * SOURCE_RATE])) == 1


# ----------------------------------------------------------------------------- long sources


def test_70_s_source_streams_window_by_window_first_audio_before_the_second_window(tts, target, monkeypatch):
    wav = _speech_with_pauses(70.0, [22.0, 47.5])
    tokenised: list[tuple[float, int]] = []  # (time the tokenizer started, window samples)
    tokenize = tts.voice_builder.speech_tokens

    def recording(wav16k):
        tokenised.append((time.perf_counter(), wav16k.shape[0]))
        return tokenize(wav16k)

    monkeypatch.setattr(tts.voice_builder, "speech_tokens", recording)
    chunks, received = [], []
    for chunk in tts.convert((wav, SOURCE_RATE), target, seed=0, config=SynthesisConfig(stream=True)):
        received.append(time.perf_counter())
        chunks.append(chunk)
    windows = pause_windows(wav)
    assert [samples for _, samples in tokenised] == [w.end - w.start for w in windows]
    assert received[0] < tokenised[1][0], "the second window was tokenised before the first audio"
    assert {chunk.segment for chunk in chunks} == {0, 1, 2} and all(chunk.segments == 3 for chunk in chunks)
    assert [chunk.segment for chunk in chunks] == sorted(chunk.segment for chunk in chunks)
    assert chunks[-1].is_last and sum(chunk.is_last for chunk in chunks) == 1
    labels = [next(c.text for c in chunks if c.segment == k) for k in range(3)]
    assert labels == [w.label() for w in windows]
    assert labels[1].startswith("source 2")  # "source 21.92-47.52 s"
    # Each window speaks its own tokens (25 per second): the joins fall where the windows end.
    per_window = [sum(c.samples.size for c in chunks if c.segment == k) for k in range(3)]
    expected = [
        tts.voice_builder.speech_tokens(wav[w.start : w.end]).shape[1] * SAMPLES_PER_TOKEN for w in windows
    ]
    assert per_window == expected
    joins = np.cumsum(per_window)[:-1] / tts.sample_rate
    assert np.allclose(joins, [w.end / SOURCE_RATE for w in windows[:-1]], atol=0.08), joins


def test_source_longer_than_the_limit_is_refused_with_the_limit(tts, target, tmp_path):
    with pytest.raises(InputError, match=r"70 s long; at most 60 s"):
        tts.convert((np.full(70 * SOURCE_RATE, 0.1, np.float32), SOURCE_RATE), target, max_source_seconds=60)
    hour = tmp_path / "hour.flac"  # one hour: refused from the header, before it is read
    soundfile.write(hour, np.zeros(3600 * 8000, np.int16), 8000)
    with pytest.raises(InputError, match=r"3600 s long; at most 1800 s"):
        tts.convert(hour, target, max_source_seconds=1800)


# ----------------------------------------------------------------------------- bad input, source forms


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("vc-sources")
    speech, rate = soundfile.read(SPEECH, dtype="float32")
    paths = {name: folder / f"{name}.wav" for name in ("silent", "short", "tel8k", "stereo48k")}
    soundfile.write(paths["silent"], np.zeros(2 * rate, np.float32), rate)
    soundfile.write(paths["short"], speech[rate : rate + rate // 10], rate)  # 0.1 s
    soundfile.write(paths["tel8k"], speech[::2], 8000)  # 8 kHz mono
    stereo = np.stack([speech, 0.5 * speech], axis=1)
    soundfile.write(paths["stereo48k"], np.repeat(stereo, 3, axis=0), 48000)  # 48 kHz stereo
    paths["corrupt"] = folder / "corrupt.wav"
    paths["corrupt"].write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")
    return paths


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("silent", "is silent"),
        ("short", r"0\.10 s long; voice conversion needs at least 0\.5 s"),
        ("corrupt", "could not read"),
    ],
)
def test_bad_sources_are_refused_at_once_and_leave_no_file(tts, target, sources, name, message, tmp_path):
    with pytest.raises(InputError, match=message):
        tts.convert(sources[name], target)
    with pytest.raises(InputError, match=message):
        tts.convert_to_file(sources[name], tmp_path / "out.wav", target)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("name", "level"), [("tel8k", 1.0), ("stereo48k", 0.75)])
def test_8_khz_and_48_khz_stereo_sources_are_resampled_and_mixed_down(tts, target, sources, name, level):
    # What the tokenizer gets: the 16 kHz speech again (stereo [s, 0.5 s] mixed down to 0.75 s).
    speech, _ = soundfile.read(SPEECH, dtype="float32")
    wav16k = read_source(sources[name])
    assert wav16k.shape == speech.shape
    assert np.corrcoef(wav16k, speech)[0, 1] > 0.97
    assert np.std(wav16k) == pytest.approx(level * np.std(speech), rel=0.05)
    chunks = list(tts.convert(sources[name], target, seed=0))
    seconds = sum(chunk.samples.size for chunk in chunks) / tts.sample_rate
    assert abs(seconds - 4.36) <= 0.05 and np.all(np.isfinite(chunks[0].samples))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("silent", "is silent"),
        ("short", r"0\.10 s long; voice conversion needs at least 0\.5 s"),
        ("corrupt", "could not read"),
        ("tel8k", None),
        ("stereo48k", None),
    ],
)
def test_cli_convert_bad_and_odd_sources(tts, sources, name, message, tmp_path, monkeypatch):
    """`trt-cosy convert`: a bad source is one `error:` line, status 2 and no file (nor a temporary one);
    an 8 kHz or 48 kHz stereo source is converted."""
    from trt_cosy import CosyVoice

    monkeypatch.setattr(CosyVoice, "load", staticmethod(lambda *args, **kwargs: tts))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ["convert", str(sources[name]), "--engines", str(tmp_path), "--ref", str(TARGET)]
    result = CliRunner().invoke(main, [*args, "-o", str(out_dir / "converted.wav"), "--stream"])
    if message is None:
        assert result.exit_code == 0, result.output
        assert soundfile.info(out_dir / "converted.wav").duration == pytest.approx(4.36, abs=0.05)
        return
    assert result.exit_code == 2, result.output
    assert re.search(r"^error: .*" + message, result.output, re.MULTILINE), result.output
    assert "Traceback" not in result.output
    assert list(out_dir.iterdir()) == [], "files left behind"


def test_source_forms_samples_int16_stereo_and_a_voice(tts, target):
    speech, rate = soundfile.read(SPEECH, dtype="int16")
    stereo = np.stack([speech, speech], axis=1)  # [N, 2] int16
    from_file = np.concatenate([c.samples for c in tts.convert(SPEECH, target, seed=3)])
    from_array = np.concatenate([c.samples for c in tts.convert((stereo, rate), target, seed=3)])
    np.testing.assert_allclose(from_array, from_file, atol=1e-5)
    source_voice = tts.voice_from_wav(SPEECH)  # a Voice's reference speech, as its tokens
    (chunk,) = tts.convert(source_voice, target, seed=3)
    assert chunk.samples.size == source_voice.speech_tokens.size * SAMPLES_PER_TOKEN
    for bad, message in [
        ((speech, 4000), "at least 8000 Hz"),
        (([], 16000), "non-empty"),
        ((np.full(16000, np.nan, np.float32), 16000), "NaN"),
        (42, "source must be a path"),
    ]:
        with pytest.raises(InputError, match=message):
            tts.convert(bad, target)
    foreign = dataclasses.replace(source_voice, model_id="v1-0123456789abcdef")
    with pytest.raises(InputError, match="source voice was made for model v1-0123456789abcdef"):
        tts.convert(foreign, target)
    with pytest.raises(InputError, match="instruct does not apply"):
        tts.convert(SPEECH, target, config=SynthesisConfig(instruct="Speak softly."))
    with pytest.raises(InputError, match="voice must be a trt_cosy.Voice"):
        tts.convert(SPEECH, object())


def test_aconvert_gives_the_chunks_convert_gives(tts, target):
    config = SynthesisConfig(stream=True)

    async def collect():
        return [chunk async for chunk in tts.aconvert(SPEECH, target, seed=5, config=config)]

    async_chunks = asyncio.run(collect())
    sync_chunks = list(tts.convert(SPEECH, target, seed=5, config=config))
    assert len(async_chunks) == len(sync_chunks) == 3
    for ours, theirs in zip(async_chunks, sync_chunks, strict=False):
        np.testing.assert_array_equal(ours.samples, theirs.samples)


def test_concurrent_conversions_give_what_each_gives_alone(tts, target, sources):
    jobs = {"a": (SPEECH, 1, True), "b": (sources["stereo48k"], 2, False), "c": (sources["tel8k"], 3, True)}

    def convert(source, seed, stream):
        config = SynthesisConfig(stream=stream)
        return np.concatenate([chunk.samples for chunk in tts.convert(source, target, seed, config)])

    alone = {name: convert(*job) for name, job in jobs.items()}
    together: dict[str, np.ndarray] = {}
    threads = [
        threading.Thread(target=lambda name=name, job=job: together.__setitem__(name, convert(*job)))
        for name, job in jobs.items()
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert together.keys() == alone.keys()
    for name in jobs:
        np.testing.assert_array_equal(together[name], alone[name])


def test_closing_a_conversion_stops_its_worker(tts, target):
    wav = _speech_with_pauses(70.0, [22.0, 47.5])
    chunks = tts.convert((wav, SOURCE_RATE), target, config=SynthesisConfig(stream=True))
    next(chunks)
    chunks.close()
    worker = chunks.request.feed
    assert not worker.alive and worker.cancelled
    assert not any(thread.name == "trt-cosy-llm" and thread.is_alive() for thread in threading.enumerate())


# ----------------------------------------------------------------------------- the command line


def test_cli_convert_with_ref_voice_and_stream(tts, tmp_path_factory, v2_tiny_dir, tmp_path):
    engines = tiny_engines(tmp_path_factory, v2_tiny_dir)
    runner = CliRunner()
    voice_file = tts.vc_voice_from_wav(TARGET).save(tmp_path / "target.npz")
    for target_args, extra in ((["--ref", str(TARGET)], []), (["--voice", str(voice_file)], ["--stream"])):
        out = tmp_path / f"out{len(extra)}.wav"
        args = ["convert", str(SPEECH), "--engines", str(engines), *target_args, "-o", str(out)]
        args += ["--threads", "1"]
        result = runner.invoke(main, args + extra)
        assert result.exit_code == 0, result.output
        audio, rate = soundfile.read(out)
        assert rate == 24000 and abs(audio.size / rate - 4.36) <= 0.05
        if extra:
            assert "segment 1/1, chunk 1" in result.output and "first audio" in result.output
    no_target = ["convert", str(SPEECH), "--engines", str(engines), "-o", str(tmp_path / "x.wav")]
    result = runner.invoke(main, no_target)
    assert result.exit_code == 2 and "--ref target.wav, --voice voice.npz or --speaker" in result.output
    missing = ["convert", str(tmp_path / "missing.wav"), "--engines", str(engines), "--ref", str(TARGET)]
    result = runner.invoke(main, missing + ["-o", str(tmp_path / "y.wav")])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not (tmp_path / "x.wav").exists() and not (tmp_path / "y.wav").exists()


@pytest.mark.slow
def test_cli_convert_runs_without_torch(tmp_path_factory, v2_tiny_dir, tmp_path):
    engines = tiny_engines(tmp_path_factory, v2_tiny_dir)
    out = tmp_path / "converted.wav"
    argv = ["trt-cosy", "convert", str(SPEECH), "--engines", str(engines), "--ref", str(TARGET)]
    argv += ["-o", str(out)]
    code = BLOCK_TORCH + (
        "import sys\nfrom trt_cosy.cli import main\n"
        f"sys.argv = {argv + ['--threads', '1', '--stream', '-q']!r}\n"
        "try:\n    main()\nexcept SystemExit as exc:\n"
        "    assert 'torch' not in sys.modules, 'torch was imported'\n    raise\n"
    )
    command = [sys.executable, "-c", code]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert soundfile.info(out).duration == pytest.approx(4.36, abs=0.05)


@pytest.mark.slow
def test_cli_convert_interrupted_stops_and_leaves_no_file(tmp_path_factory, v2_tiny_dir, tmp_path):
    engines = tiny_engines(tmp_path_factory, v2_tiny_dir)
    source = tmp_path / "long.wav"
    soundfile.write(source, _speech_with_pauses(70.0, [22.0, 47.5]), SOURCE_RATE)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    command = [sys.executable, "-m", "trt_cosy.cli", "convert", str(source), "--engines", str(engines)]
    command += ["--ref", str(TARGET), "-o", str(out_dir / "converted.wav"), "--threads", "1", "--stream"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(path.stat().st_size > 44 for path in out_dir.glob(".converted.wav.*.tmp")):
            assert process.poll() is None, "ended before it could be interrupted: " + process.stderr.read()
            assert time.monotonic() < deadline, "no audio written within 120 s"
            time.sleep(0.05)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    stderr = process.stderr.read()
    assert process.returncode == 130, stderr
    assert "interrupted (SIGINT)" in stderr
    assert list(out_dir.iterdir()) == [], "files left behind"
