"""Admission by expected work (issue 31) on a real `trt-cosy serve`, over loopback only.

Starts `trt-cosy serve --engines ENGINES` in a subprocess on a free 127.0.0.1 port (a temporary voice
store with one voice from a 1.5 s reference), then runs one scenario with non-streamed `/tts` requests
and prints each request's status, seconds, audio and `Retry-After`, with the server's refusal reasons
(its access log) and admission metrics. Run it once with and once with `--no-work-admission` to compare.

    burst: --requests N copies of a --sentences-sentence text sent at once (the issue: 8 x 40 sentences,
           --max-concurrent 8 --max-queue 8 --timeout 300). --teach sends one alone first.
    mix:   --long copies of a --long-sentences text and --short x "Hello.", arrivals --gap-s apart,
           long ones first; reports the shorts' p50 / p95 latency.
    lone:  --runs requests of a --sentences text one after the other (a lone request on an idle server).

    python bench/admission_bench.py --engines /tmp/tiny-engines burst --requests 8 --sentences 40 --timeout 300
    python bench/admission_bench.py --engines /tmp/tiny-engines --no-work-admission mix --timeout 100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import soundfile

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
REFERENCE_TEXT = "Hello, this is me."
SHORT = "Hello."
# Eight sentences of about 80 characters; a text of N sentences cycles through them.
SENTENCES = (
    "The morning train left the station slowly while the fog still covered the hills.",
    "She opened the old wooden box and found a letter written by her grandmother.",
    "Every evening the children played football in the narrow street behind the bakery.",
    "The museum will close early today because the workers are repairing the roof.",
    "He forgot his umbrella at the office and walked home through the heavy rain.",
    "Our neighbours planted tomatoes, beans and sunflowers in their small garden.",
    "The pilot announced that the flight would land twenty minutes ahead of schedule.",
    "After the concert the musicians packed their instruments and drove to the coast.",
)
WAV_HEADER = 44


def text_of(sentences: int) -> str:
    return " ".join(SENTENCES[index % len(SENTENCES)] for index in range(sentences))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serving(args: argparse.Namespace, log_path: Path) -> Iterator[str]:
    """`trt-cosy serve` in a subprocess with one stored voice ``alice``; yields its URL."""
    port = _free_port()
    voices = Path(tempfile.mkdtemp(prefix="trt-cosy-admission-voices-"))
    command = [sys.executable, "-m", "trt_cosy.cli", "serve", "--engines", str(args.engines)]
    command += ["--port", str(port), "--voices-dir", str(voices), "--timeout", str(args.timeout)]
    command += ["--max-concurrent", str(args.max_concurrent), "--max-queue", str(args.max_queue)]
    command += ["--no-stream-default", "-v"]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.no_work_admission:
        command.append("--no-work-admission")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise SystemExit(f"the server exited ({process.returncode}); see {log_path}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the server was not ready within 300 s; see {log_path}")
            time.sleep(0.2)
        speech, rate = soundfile.read(REFERENCE, dtype="float32")
        ref = voices / "ref.wav"
        soundfile.write(ref, speech[rate // 2 : 2 * rate], rate)
        with open(ref, "rb") as stream:
            answer = httpx.post(
                url + "/v1/voices",
                files={"file": (ref.name, stream, "audio/wav")},
                data={"name": "alice", "text": REFERENCE_TEXT},
                timeout=120,
            )
        answer.raise_for_status()
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        for path in sorted(voices.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        voices.rmdir()


def post(url: str, text: str, seed: int, client_timeout_s: float) -> dict:
    started = time.perf_counter()
    response = httpx.post(
        url + "/tts", json={"text": text, "voice": "alice", "seed": seed}, timeout=client_timeout_s
    )
    seconds = time.perf_counter() - started
    result = {"status": response.status_code, "seconds": round(seconds, 2)}
    if response.status_code == 200:
        result["audio_s"] = round((len(response.content) - WAV_HEADER) / 2 / 24000, 1)
    else:
        with contextlib.suppress(ValueError, KeyError):
            result["code"] = response.json()["error"]["code"]
        if "retry-after" in response.headers:
            result["retry_after"] = int(response.headers["retry-after"])
    return result


def server_figures(url: str, log_path: Path) -> dict:
    metrics = httpx.get(url + "/metrics", timeout=30).text
    wanted = re.compile(
        r"^trt_cosy_(admission_refused_total|work_estimate_ratio_(sum|count)|queue_seconds_(sum|count)"
        r"|seconds_per_speech_token|speech_text_ratio)\b"
    )
    lines = [line for line in metrics.splitlines() if wanted.match(line)]
    log = log_path.read_text(encoding="utf-8", errors="replace")
    reasons = re.findall(r"refused: [a-z_]+", log)
    return {"metrics": lines, "refusals_logged": {r: reasons.count(r) for r in sorted(set(reasons))}}


def burst(url: str, args: argparse.Namespace) -> dict:
    text = text_of(args.sentences)
    out: dict = {"text_chars": len(text)}
    client_s = 2 * args.timeout + 120
    if args.teach:
        out["alone"] = post(url, text, 0, client_s)
    started = time.perf_counter()
    with ThreadPoolExecutor(args.requests) as pool:
        results = list(pool.map(lambda seed: post(url, text, seed, client_s), range(1, args.requests + 1)))
    out["wall_s"] = round(time.perf_counter() - started, 1)
    out["requests"] = results
    return out


def mix(url: str, args: argparse.Namespace) -> dict:
    long_text = text_of(args.long_sentences)
    items = [(long_text, "long")] * args.long + [(SHORT, "short")] * args.short
    client_s = 2 * args.timeout + 120
    if args.teach:
        post(url, long_text, 0, client_s)

    def ask(indexed: tuple[int, tuple[str, str]]) -> dict:
        index, (text, kind) = indexed
        time.sleep(args.gap_s * index)
        return {"kind": kind, **post(url, text, index + 1, client_s)}

    with ThreadPoolExecutor(len(items)) as pool:
        results = list(pool.map(ask, enumerate(items)))
    shorts = [r["seconds"] for r in results if r["kind"] == "short" and r["status"] == 200]
    out: dict = {"requests": results}
    if shorts:
        out["short_p50_s"] = round(float(np.percentile(shorts, 50)), 2)
        out["short_p95_s"] = round(float(np.percentile(shorts, 95)), 2)
    return out


def lone(url: str, args: argparse.Namespace) -> dict:
    text = text_of(args.sentences) if args.sentences else SHORT
    post(url, text, 0, 2 * args.timeout + 120)  # the first request also warms the voice's caches
    results = [post(url, text, seed, 2 * args.timeout + 120) for seed in range(1, args.runs + 1)]
    seconds = [r["seconds"] for r in results]
    return {"requests": results, "median_s": round(statistics.median(seconds), 2)}


def summary(results: list[dict]) -> dict:
    by_status: dict[int, list[float]] = {}
    for result in results:
        by_status.setdefault(result["status"], []).append(result["seconds"])
    return {status: (len(seconds), min(seconds), max(seconds)) for status, seconds in sorted(by_status.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--no-work-admission", action="store_true")
    parser.add_argument("--max-concurrent", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    scenarios = parser.add_subparsers(dest="scenario", required=True)
    for name in ("burst", "mix", "lone"):
        sub = scenarios.add_parser(name)
        sub.add_argument("--timeout", type=float, default=300.0)
        sub.add_argument("--teach", action="store_true", help="one long request alone first")
        if name == "burst":
            sub.add_argument("--requests", type=int, default=8)
            sub.add_argument("--sentences", type=int, default=40)
        elif name == "mix":
            sub.add_argument("--long", type=int, default=4)
            sub.add_argument("--long-sentences", type=int, default=8)
            sub.add_argument("--short", type=int, default=20)
            sub.add_argument("--gap-s", type=float, default=0.05)
        else:
            sub.add_argument("--runs", type=int, default=3)
            sub.add_argument("--sentences", type=int, default=0, help="0: 'Hello.'")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trt-cosy-admission-") as folder:
        log_path = Path(folder) / "server.log"
        with serving(args, log_path) as url:
            began = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
            load_before = os.getloadavg()[0]
            result = {"scenario": args.scenario, "work_admission": not args.no_work_admission}
            result.update(globals()[args.scenario](url, args))
            result.update(server_figures(url, log_path))
        result.update(
            started=began,
            load_before=round(load_before, 2),
            load_after=round(os.getloadavg()[0], 2),
            machine=platform.processor() or platform.machine(),
            args={k: str(v) for k, v in vars(args).items()},
        )
    text = json.dumps(result, indent=1)
    print(text)
    print("by status (count, min s, max s):", summary(result["requests"]), file=sys.stderr)
    if args.json is not None:
        args.json.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    threading.current_thread().name = "admission-bench"
    main()
