"""Streamed response formats through the server, side by side: first byte and total time of the same request
(text, voice, seed) in pcm and in each compressed format (issue 35).

    python bench/format_ab.py --engines ENGINES --threads 2 --rounds 3 [--formats pcm,mp3,opus,aac,flac]

The engines are served on a loopback port (``ThreadedServer``) with one stored voice made from the first
``--ref-seconds`` (5) s of tests/data/features/audio/en_16k_mono.wav; each round sends the request once per
format, one at a time, in an order rotated every round so that machine drift hits every format alike, with
``stream: true`` (the OpenAI route). Per request: the time from sending to the first body byte, and to the
last. Reported per format: medians (min-max) over the rounds, and against pcm of the same round the first
byte's difference (ms) and the total's ratio. The same seed makes the same audio in every format, so the
engine's work is the same and what differs is the encoder.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import soundfile

from trt_cosy import CosyVoice, EngineConfig
from trt_cosy.server import ServerSettings, ThreadedServer, create_app

AUDIO = Path(__file__).resolve().parents[1] / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
REF_TEXT = "The quick brown fox jumps over the lazy dog, then rests quietly by the river."
# One short sentence: a random-weight model speaks to its token limit (20 speech tokens per text token), so a
# longer text makes minutes of noise per request.
TEXT = "Thanks for calling."


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def timed_request(url: str, fmt: str, seed: int, text: str) -> tuple[float, float, int]:
    """(seconds to the first body byte, seconds to the last, bytes) of one streamed request."""
    body = {"model": "tts-1", "input": text, "voice": "alice", "response_format": fmt, "stream": True, "seed": seed}
    started = time.perf_counter()
    first, size = None, 0
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=600) as response:
        response.raise_for_status()
        for piece in response.iter_bytes():
            if piece and first is None:
                first = time.perf_counter() - started
            size += len(piece)
    return first if first is not None else float("nan"), time.perf_counter() - started, size


def wait_until_ready(url: str, timeout_s: float = 600.0) -> None:
    """Wait for ``GET /health`` to say 200 (the server's warm-up has run)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(url + "/health", timeout=30).status_code != 200:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} was not ready after {timeout_s:.0f} s")
        time.sleep(0.5)


def _spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    scaled = [value * scale for value in values]
    return f"{statistics.median(scaled):.{digits}f} ({min(scaled):.{digits}f}-{max(scaled):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", default="pcm,mp3,opus,aac,flac")
    parser.add_argument("--ref-seconds", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--json", action="store_true", help="print the per-request figures as JSON too")
    args = parser.parse_args()
    formats = args.formats.split(",")
    if formats[0] != "pcm":
        parser.error("--formats must start with pcm (the reference)")
    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=args.threads))
    print(f"CPU: {cpu_model()}; threads {args.threads or 'default'}; engines {args.engines}")
    samples, rate = soundfile.read(AUDIO, dtype="float32")
    with tempfile.TemporaryDirectory(prefix="trt-cosy-format-ab-") as folder:
        reference = Path(folder) / "ref.wav"
        soundfile.write(reference, samples[: int(args.ref_seconds * rate)], rate)
        tts.voice_from_wav(reference, REF_TEXT).save(Path(folder) / "alice.npz")
        settings = ServerSettings(voices_dir=Path(folder))
        with ThreadedServer(create_app(tts, settings)) as server:
            wait_until_ready(server.url)
            timed_request(server.url, "pcm", args.seed, args.text)  # warm-up: sessions, voice prefix
            results: dict[str, list[tuple[float, float, int]]] = {fmt: [] for fmt in formats}
            for round_index in range(args.rounds):
                shift = round_index % len(formats)
                for fmt in formats[shift:] + formats[:shift]:
                    results[fmt].append(timed_request(server.url, fmt, args.seed, args.text))
    print("| format | first byte s | total s | first byte - pcm's, ms | total / pcm's | bytes |")
    print("|---|---|---|---|---|---|")
    pcm = results["pcm"]
    for fmt in formats:
        rows = results[fmt]
        delta = [row[0] - base[0] for row, base in zip(rows, pcm, strict=True)]
        ratio = [row[1] / base[1] for row, base in zip(rows, pcm, strict=True)]
        print(
            f"| {fmt} | {_spread([r[0] for r in rows])} | {_spread([r[1] for r in rows])} | "
            f"{_spread(delta, 1000, 0)} | {_spread(ratio)} | {statistics.median([r[2] for r in rows]):.0f} |"
        )
    if args.json:
        print(json.dumps({fmt: [list(row) for row in rows] for fmt, rows in results.items()}))


if __name__ == "__main__":
    main()
