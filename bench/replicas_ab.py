"""Two replicas on one machine, side by side: aggregate audio seconds per wall second of concurrent,
non-streamed requests, for each way of running two engines (issue 38).

    python bench/replicas_ab.py --engines ENGINES --rounds 2 --requests 4 --setups workers,taskset,default,ray

Setups (each started fresh every round, rounds interleaved so machine load hits all alike):
  workers  `trt-cosy serve --workers 2` (one port; the documented way)
  ray      `trt-cosy serve --ray --replicas 2` (one port)
  taskset  two `trt-cosy serve --threads 1`, pinned with `taskset -c <cpu>` to one CPU each, two ports
  default  two `trt-cosy serve` with the default threads, unpinned, two ports (trt-cosy before issue 38)

Two clients send --requests requests each (the same texts and seeds in every setup, so every setup
makes the same audio); each client talks to its own port where a setup has two. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
TEXTS = ["Hello there, how are you today?", "The quick brown fox jumps over the lazy dog.",
         "One two three four five six.", "It is a fine day for a walk in the park."]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_voice(engines: Path, folder: Path) -> None:
    from trt_cosy import CosyVoice, EngineConfig

    tts = CosyVoice.load(engines, config=EngineConfig(threads=1))
    tts.voice_from_wav(REF, "Hello, this is me.").save(folder / "alice.npz")


def start(setup: str, engines: Path, voices: Path) -> tuple[list[subprocess.Popen], list[str]]:
    """The processes of ``setup`` and the URLs the two clients use."""
    serve = [sys.executable, "-m", "trt_cosy.cli", "serve", "--engines", str(engines), "--voices-dir", str(voices)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if setup in ("workers", "ray"):
        port = free_port()
        extra = ["--workers", "2"] if setup == "workers" else ["--ray", "--replicas", "2"]
        process = subprocess.Popen([*serve, "--port", str(port), *extra], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        return [process], [url, url]
    processes, urls = [], []
    for cpu in (0, 1):
        port = free_port()
        prefix = ["taskset", "-c", str(cpu)] if setup == "taskset" else []
        threads = ["--threads", "1"] if setup == "taskset" else []
        processes.append(subprocess.Popen([*prefix, *serve, "--port", str(port), *threads], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                          start_new_session=True))
        urls.append(f"http://127.0.0.1:{port}")
    return processes, urls


def wait_ready(urls: list[str], processes: list[subprocess.Popen], timeout_s: float = 600) -> None:
    """Every replica answers: one speech request per client at once until both answered (warms both)."""
    deadline = time.monotonic() + timeout_s
    for url in set(urls):
        while True:
            assert all(process.poll() is None for process in processes), "a server exited"
            assert time.monotonic() < deadline, "not ready"
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    run_clients(urls, 1, seed_base=1000)  # warm-up: one request per client (ray/workers: both replicas)


def run_clients(urls: list[str], requests: int, seed_base: int = 0) -> tuple[float, float, list[str]]:
    """(audio seconds, wall seconds, replica names) of two clients sending ``requests`` each."""
    audio = [0.0, 0.0]
    names: list[str] = []
    errors: list[str] = []

    def client(index: int) -> None:
        with httpx.Client(timeout=600) as http:
            for number in range(requests):
                seed = seed_base + index * 100 + number
                body = {"model": "tts-1", "voice": "alice", "input": TEXTS[(index + number) % len(TEXTS)],
                        "response_format": "pcm", "stream": False, "seed": seed}
                response = http.post(urls[index] + "/v1/audio/speech", json=body)
                if response.status_code != 200:
                    errors.append(f"{response.status_code} {response.text[:200]}")
                    continue
                audio[index] += len(response.content) / 2 / 24000
                names.append(response.headers.get("x-trt-cosy-replica", urls[index]))

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    assert not errors, errors
    return sum(audio), wall, names


def stop(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    for process in processes:
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4, help="requests per client per round")
    parser.add_argument("--setups", default="workers,taskset,default")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    setups = args.setups.split(",")
    results: dict[str, list[dict]] = {setup: [] for setup in setups}
    with tempfile.TemporaryDirectory() as folder:
        voices = Path(folder)
        make_voice(args.engines, voices)
        for round_index in range(args.rounds):
            for setup in setups:
                processes, urls = start(setup, args.engines, voices)
                try:
                    wait_ready(urls, processes)
                    load = os.getloadavg()[0]
                    audio, wall, names = run_clients(urls, args.requests)
                finally:
                    stop(processes)
                row = {"round": round_index, "audio_s": round(audio, 2), "wall_s": round(wall, 2),
                       "audio_per_s": round(audio / wall, 3), "replicas_used": len(set(names)),
                       "load_1min": round(load, 2)}
                results[setup].append(row)
                print(setup, json.dumps(row), flush=True)
    summary = {setup: round(sum(r["audio_per_s"] for r in rows) / len(rows), 3) for setup, rows in results.items()}
    print("mean audio s per s:", json.dumps(summary))
    report = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "engines": str(args.engines), "requests_per_client": args.requests, "rounds": results,
              "mean_audio_per_s": summary}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
