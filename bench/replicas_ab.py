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

Reported per round: audio seconds per wall second, and audio seconds per CPU second of every process of
the setup (the servers and all their descendants: Ray's raylet and replicas, the workers). On a machine
that other jobs load, the wall figure depends on how much CPU the scheduler gave the setup (a setup with
more runnable threads gets a larger share); the CPU figure is what the setup did with the CPU it got.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
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


def start(setup: str, engines: Path, voices: Path, timeout_s: float) -> tuple[list[subprocess.Popen], list[str]]:
    """The processes of ``setup`` and the URLs the two clients use."""
    serve = [sys.executable, "-m", "trt_cosy.cli", "serve", "--engines", str(engines), "--voices-dir", str(voices),
             "--timeout", f"{timeout_s:g}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if setup in ("workers", "ray"):
        port = free_port()
        extra = ["--workers", "2"] if setup == "workers" else ["--ray", "--replicas", "2"]
        process = subprocess.Popen([*serve, "--port", str(port), *extra], env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        return [process], [url, url]
    processes, urls = [], []
    for cpu in (0, 1):
        port = free_port()
        prefix = ["taskset", "-c", str(cpu)] if setup == "taskset" else []
        threads = ["--threads", "1"] if setup == "taskset" else []
        processes.append(subprocess.Popen([*prefix, *serve, "--port", str(port), *threads], env=env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
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
    while True:  # warm-up: one request per client (ray/workers: both replicas), until none is still warming
        try:
            run_clients(urls, 1, seed_base=1000)
            return
        except AssertionError as error:
            assert "503" in str(error) and time.monotonic() < deadline, error
            time.sleep(2)


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


def _tree_cpu_s(roots: list[int]) -> tuple[float, int]:
    """(user + system CPU seconds, sessions) of ``roots`` and all their living descendants (children's
    reaped time included through cutime/cstime). With the kernel's autogroup scheduling each session is
    one scheduling group: under load, a setup spread over more sessions gets more CPU."""
    parent_of: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent_of[int(entry)] = int(fields[1])
        stats[int(entry)] = fields
    members = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, parent in parent_of.items():
            if parent in members and pid not in members:
                members.add(pid)
                grew = True
    ticks = os.sysconf("SC_CLK_TCK")
    # fields after ")": state ppid pgrp session ... utime=[11] stime=[12] cutime=[13] cstime=[14]
    cpu = sum(sum(int(stats[pid][index]) for index in (11, 12, 13, 14)) for pid in members if pid in stats)
    return cpu / ticks, len({stats[pid][3] for pid in members if pid in stats})


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM to each server command (it stops its workers / its local Ray), then wait."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
    time.sleep(5)  # let what the servers started finish exiting before the next setup


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=4, help="requests per client per round")
    parser.add_argument("--setups", default="workers,taskset,default")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="every server's --timeout: full-size engines on a small machine need more than the "
                             "default where a fresh server's warm-up estimate refuses the first request (413)")
    args = parser.parse_args()
    setups = args.setups.split(",")
    results: dict[str, list[dict]] = {setup: [] for setup in setups}
    with tempfile.TemporaryDirectory() as folder:
        voices = Path(folder)
        make_voice(args.engines, voices)
        for round_index in range(args.rounds):
            for setup in setups:
                processes, urls = start(setup, args.engines, voices, args.timeout)
                try:
                    wait_ready(urls, processes)
                    load = os.getloadavg()[0]
                    roots = [process.pid for process in processes]
                    cpu_before, _ = _tree_cpu_s(roots)
                    audio, wall, names = run_clients(urls, args.requests)
                    cpu_after, sessions = _tree_cpu_s(roots)
                    cpu = cpu_after - cpu_before
                finally:
                    stop(processes)
                row = {"round": round_index, "audio_s": round(audio, 2), "wall_s": round(wall, 2),
                       "audio_per_s": round(audio / wall, 3), "cpu_s": round(cpu, 2),
                       "audio_per_cpu_s": round(audio / cpu, 3) if cpu > 0 else None,
                       "replicas_used": len(set(names)), "sessions": sessions,
                       "load_1min": round(load, 2)}
                results[setup].append(row)
                print(setup, json.dumps(row), flush=True)
    summary = {setup: {key: round(statistics.median(r[key] for r in rows), 3)
                       for key in ("audio_per_s", "audio_per_cpu_s")} for setup, rows in results.items()}
    print("medians:", json.dumps(summary))
    report = {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "engines": str(args.engines), "requests_per_client": args.requests, "timeout_s": args.timeout,
              "rounds": results,
              "medians": summary}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
