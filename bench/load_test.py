"""Bounded load test of the speech server, over loopback only: throughput and latency percentiles.

Either start a server in this process on engines (a free 127.0.0.1 port, a temporary voice store
with one voice made from --ref), or target a running one with --url (127.0.0.1/localhost/::1
only, with --voice naming a stored voice). Every client streams its response, so time to first
audio is measured on the wire. The run stops after --requests requests or --duration seconds,
whichever comes first; requests answered 429/503 are counted, not retried.

    python bench/load_test.py --engines /tmp/tiny-engines --requests 24 --concurrency 4 --max-concurrent 2
    python bench/load_test.py --url http://127.0.0.1:8000 --voice alice --requests 50 --concurrency 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np
import soundfile

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REF = ROOT / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
BYTES_PER_SECOND = 2 * 24000  # 16-bit mono PCM at the CosyVoice2 rate


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    first_audio: list[float] = field(default_factory=list)
    audio_s: float = 0.0
    statuses: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _one_request(client: httpx.Client, body: dict, results: Results) -> None:
    started = time.perf_counter()
    first, size = None, 0
    try:
        with client.stream("POST", "/v1/audio/speech", json=body) as response:
            for piece in response.iter_bytes():
                first = first or time.perf_counter()
                size += len(piece)
            status = response.status_code
    except httpx.HTTPError as exc:
        with results.lock:
            results.failures.append(f"{type(exc).__name__}: {exc}")
        return
    ended = time.perf_counter()
    with results.lock:
        results.statuses[status] = results.statuses.get(status, 0) + 1
        if status == 200:
            results.latencies.append(ended - started)
            results.first_audio.append((first or ended) - started)
            results.audio_s += size / BYTES_PER_SECOND


def run_load(
    url: str, body: dict, requests: int, concurrency: int, duration_s: float
) -> tuple[Results, float]:
    """``requests`` requests from ``concurrency`` clients, none started after ``duration_s``."""
    results = Results()
    counter = iter(range(requests))
    counter_lock = threading.Lock()
    deadline = time.perf_counter() + duration_s

    def client_loop() -> None:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(duration_s + 60)) as client:
            while time.perf_counter() < deadline:
                with counter_lock:
                    if next(counter, None) is None:
                        return
                _one_request(client, body, results)

    started = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - started


def _percentiles(values: list[float]) -> str:
    if not values:
        return "n/a"
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return f"p50 {p50:.3f} s, p90 {p90:.3f} s, p99 {p99:.3f} s, max {max(values):.3f} s"


def report(results: Results, wall_s: float, args: argparse.Namespace) -> dict:
    done = len(results.latencies)
    summary = {
        "requests_ok": done,
        "statuses": results.statuses,
        "transport_failures": len(results.failures),
        "wall_s": round(wall_s, 3),
        "throughput_rps": round(done / wall_s, 3) if wall_s else 0.0,
        "audio_s_per_wall_s": round(results.audio_s / wall_s, 3) if wall_s else 0.0,
        "latency": _percentiles(results.latencies),
        "time_to_first_audio": _percentiles(results.first_audio),
        "concurrency": args.concurrency,
        "max_concurrent": args.max_concurrent,
        "text": args.text,
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {_cpu_count()} cores, Python "
        f"{platform.python_version()}",
    }
    for key, value in summary.items():
        print(f"{key:>22}: {value}")
    for failure in results.failures[:5]:
        print(f"   failure: {failure}")
    return summary


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def _in_process_server(args: argparse.Namespace):
    """A server on the engines in this process, with one voice "bench" made from --ref."""
    from trt_cosy import CosyVoice, EngineConfig
    from trt_cosy.server import ServerSettings, ThreadedServer, create_app

    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=args.threads))
    with tempfile.TemporaryDirectory(prefix="trt-cosy-bench-") as folder:
        ref = Path(folder) / "ref.wav"
        speech, rate = soundfile.read(args.ref, dtype="float32")
        soundfile.write(ref, speech[: int(rate * args.ref_seconds)], rate)
        settings = ServerSettings(
            voices_dir=Path(folder) / "voices",
            max_concurrent=args.max_concurrent,
            max_queue=args.max_queue,
        )
        with ThreadedServer(create_app(tts, settings)) as server:
            deadline = time.monotonic() + 300
            while httpx.get(server.url + "/health").status_code != 200:
                if time.monotonic() > deadline:
                    raise SystemExit("the server did not become ready within 300 s")
                time.sleep(0.05)
            with open(ref, "rb") as stream:
                response = httpx.post(
                    server.url + "/v1/voices",
                    files={"file": ("ref.wav", stream, "audio/wav")},
                    data={"name": "bench", "text": args.ref_text},
                    timeout=120,
                )
            response.raise_for_status()
            yield server.url, "bench"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--engines", type=Path, help="Engines directory: serve it in this process.")
    target.add_argument("--url", help="A running server on loopback, e.g. http://127.0.0.1:8000.")
    parser.add_argument("--voice", default=None, help="Stored voice to use with --url.")
    parser.add_argument("--ref", type=Path, default=DEFAULT_REF, help="Reference wav for --engines.")
    parser.add_argument("--ref-seconds", type=float, default=1.5, help="Seconds of --ref to use.")
    parser.add_argument("--ref-text", default="Hello, this is me.", help="Transcript of the reference.")
    parser.add_argument("--text", default="Hi.", help="What every request says.")
    parser.add_argument("--requests", type=int, default=20, help="Requests in all (the count bound).")
    parser.add_argument("--duration", type=float, default=120.0, help="No request starts after this many s.")
    parser.add_argument("--concurrency", type=int, default=2, help="Clients sending at once.")
    parser.add_argument("--max-concurrent", type=int, default=1, help="Server slots (--engines only).")
    parser.add_argument("--max-queue", type=int, default=8, help="Server queue (--engines only).")
    parser.add_argument("--threads", type=int, default=None, help="ONNX Runtime threads (--engines only).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the summary here.")
    args = parser.parse_args(argv)
    if not 1 <= args.requests <= 10_000 or not 1 <= args.concurrency <= 64 or not 0 < args.duration <= 3600:
        parser.error("bounds: 1-10000 requests, 1-64 clients, a duration of 0-3600 s.")
    if args.url is not None:
        if urlsplit(args.url).hostname not in LOOPBACK:
            parser.error("--url must be a loopback address (127.0.0.1, localhost or ::1).")
        if args.voice is None:
            parser.error("--url needs --voice (a voice stored on that server).")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    with contextlib.ExitStack() as stack:
        if args.url is None:
            url, voice = stack.enter_context(_in_process_server(args))
        else:
            url, voice = args.url.rstrip("/"), args.voice
        body = {
            "model": "tts-1",
            "input": args.text,
            "voice": voice,
            "response_format": "pcm",
            "stream": True,
        }
        results, wall_s = run_load(url, body, args.requests, args.concurrency, args.duration)
    summary = report(results, wall_s, args)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    return 0 if results.latencies and not results.failures else 1


if __name__ == "__main__":
    sys.exit(main())
