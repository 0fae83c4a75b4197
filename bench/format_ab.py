"""Streamed response formats through the server, side by side: first byte and total time of the same request
(text, voice, seed) in pcm and in each compressed format (issue 35).

    python bench/format_ab.py --engines ENGINES --threads 2 --rounds 4 --out runs.jsonl [--formats pcm,mp3,...]
    python bench/format_ab.py --report runs.jsonl [more.jsonl ...]

``trt-cosy serve`` runs in a child process (as a client meets it: the client's own work is not in the
server's process) on a loopback port, with one voice uploaded from the first ``--ref-seconds`` (5) s of
tests/data/features/audio/en_16k_mono.wav. Each round sends the request once per format, one at a time, in
an order rotated every round so that machine drift hits every format alike, with ``stream: true`` (the
OpenAI route). Per request: the time from sending to the first body byte and to the last, the bytes, and
the CPU seconds the server spent encoding it (``trt_cosy_encode_cpu_seconds`` of ``GET /metrics``).

``--out`` appends one JSON line per request (with a batch id), so several runs, each short enough for a
shared machine's lock, add up to one ranking: ``--report`` reads them all and prints per format the medians
(min-max) over the rounds, and against pcm of the same round the first byte's difference (ms) and the
total's ratio. The same seed makes the same audio in every format, so the engine's work is the same and
what differs is the encoder.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import soundfile

AUDIO = Path(__file__).resolve().parents[1] / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
REF_TEXT = "The quick brown fox jumps over the lazy dog, then rests quietly by the river."
# One short sentence: a random-weight model speaks to its token limit (20 speech tokens per text token), so a
# longer text makes minutes of noise per request.
TEXT = "Thanks for calling."
VOICE = "alice"
_ENCODE_CPU = re.compile(r'^trt_cosy_encode_cpu_seconds_total\{format="([a-z0-9]+)"\} (\S+)$', re.M)


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
    body = {
        "model": "tts-1",
        "input": text,
        "voice": VOICE,
        "response_format": fmt,
        "stream": True,
        "seed": seed,
    }
    started = time.perf_counter()
    first, size = None, 0
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=600) as response:
        response.raise_for_status()
        for piece in response.iter_bytes():
            if piece and first is None:
                first = time.perf_counter() - started
            size += len(piece)
    return first if first is not None else float("nan"), time.perf_counter() - started, size


def encode_cpu(url: str) -> dict[str, float]:
    """CPU seconds the server has spent encoding, by format, so far."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return {fmt: float(value) for fmt, value in _ENCODE_CPU.findall(text)}


def wait_until_ready(url: str, server: subprocess.Popen, timeout_s: float = 900.0) -> None:
    """Wait for ``GET /health`` to say 200 (the server's warm-up has run)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"trt-cosy serve exited with {server.returncode}; see its log")
        try:
            if httpx.get(url + "/health", timeout=30).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} was not ready after {timeout_s:.0f} s")
        time.sleep(0.5)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_batch(args: argparse.Namespace, formats: list[str]) -> list[dict]:
    batch = uuid.uuid4().hex[:8]
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="trt-cosy-format-ab-") as folder:
        samples, rate = soundfile.read(AUDIO, dtype="float32")
        reference = Path(folder) / "ref.wav"
        soundfile.write(reference, samples[: int(args.ref_seconds * rate)], rate)
        voices = Path(folder) / "voices"
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "trt_cosy.cli",
            "serve",
            "--engines",
            str(args.engines),
            "--port",
            str(port),
            "--voices-dir",
            str(voices),
        ]
        if args.threads:
            command += ["--threads", str(args.threads)]
        with open(Path(folder) / "serve.log", "wb") as log:
            server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
            url = f"http://127.0.0.1:{port}"
            try:
                wait_until_ready(url, server)
                with open(reference, "rb") as stream:
                    httpx.post(
                        url + "/v1/voices",
                        files={"file": ("ref.wav", stream, "audio/wav")},
                        data={"name": VOICE, "text": REF_TEXT},
                        timeout=120,
                    ).raise_for_status()
                timed_request(url, "pcm", args.seed, args.text)  # warm-up: sessions, voice prefix
                for fmt in formats[1:]:
                    timed_request(url, fmt, args.seed, "Hi.")  # each encoder opened once
                for round_index in range(args.rounds):
                    shift = round_index % len(formats)
                    for fmt in formats[shift:] + formats[:shift]:
                        before = encode_cpu(url).get(fmt, 0.0)
                        first, total, size = timed_request(url, fmt, args.seed, args.text)
                        record = {
                            "batch": batch,
                            "round": round_index,
                            "format": fmt,
                            "first_s": first,
                            "total_s": total,
                            "bytes": size,
                            "encode_cpu_s": encode_cpu(url).get(fmt, 0.0) - before,
                            "at": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                        }
                        records.append(record)
                        print(json.dumps(record), flush=True)
                        if args.out is not None:  # at once: a batch cut short keeps its rounds
                            with open(args.out, "a") as stream:
                                stream.write(json.dumps(record) + "\n")
            finally:
                server.terminate()
                try:
                    server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
    return records


def _spread(values: list[float], scale: float = 1.0, digits: int = 3) -> str:
    scaled = [value * scale for value in values]
    return f"{statistics.median(scaled):.{digits}f} ({min(scaled):.{digits}f}-{max(scaled):.{digits}f})"


def report(records: list[dict]) -> None:
    """Per format: medians (min-max) over the rounds, and against pcm of the same round."""
    rounds: dict[tuple[str, int], dict[str, dict]] = {}
    for record in records:
        rounds.setdefault((record["batch"], record["round"]), {})[record["format"]] = record
    complete = [row for row in rounds.values() if "pcm" in row]
    formats = sorted({fmt for row in complete for fmt in row}, key=lambda fmt: (fmt != "pcm", fmt))
    print(f"{len(complete)} rounds in {len({key[0] for key in rounds})} batch(es)")
    print(
        "| format | first byte s | total s | first byte - pcm's, ms | total / pcm's | encode CPU ms "
        "| encode CPU / total | bytes |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for fmt in formats:
        rows = [(row[fmt], row["pcm"]) for row in complete if fmt in row]
        mine = [row for row, _ in rows]
        delta = [row["first_s"] - pcm["first_s"] for row, pcm in rows]
        ratio = [row["total_s"] / pcm["total_s"] for row, pcm in rows]
        share = [row["encode_cpu_s"] / row["total_s"] for row in mine]
        print(
            f"| {fmt} | {_spread([r['first_s'] for r in mine], 1, 2)} | {_spread([r['total_s'] for r in mine], 1, 2)} "
            f"| {_spread(delta, 1000, 0)} | {_spread(ratio)} | {_spread([r['encode_cpu_s'] for r in mine], 1000, 0)} "
            f"| {_spread(share, 100, 2)} % | {statistics.median([r['bytes'] for r in mine]):.0f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", default="pcm,mp3,opus,aac,flac")
    parser.add_argument("--ref-seconds", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument(
        "--out", type=Path, default=None, help="append each request's figures here (JSON lines)"
    )
    parser.add_argument(
        "--report",
        type=Path,
        nargs="+",
        default=None,
        help="no run: the table over the JSON lines of these files",
    )
    args = parser.parse_args()
    if args.report:
        report(
            [
                json.loads(line)
                for path in args.report
                for line in path.read_text().splitlines()
                if line.strip()
            ]
        )
        return
    if args.engines is None:
        parser.error("--engines is needed (or --report)")
    formats = args.formats.split(",")
    if formats[0] != "pcm":
        parser.error("--formats must start with pcm (the reference)")
    print(f"CPU: {cpu_model()}; threads {args.threads or 'default'}; engines {args.engines}")
    records = run_batch(args, formats)
    if args.out is not None:
        records = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
    report(records)


if __name__ == "__main__":
    main()
