"""``trt-cosy serve --workers 2``: two pinned server processes behind one port (``server/workers``).

A real ``trt-cosy serve`` process on a free port serves the tiny engines: its workers are pinned to
disjoint CPUs, connections go to an idle worker, OpenAI-client answers equal the single-process
server's, and SIGTERM stops every process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("python_multipart")
openai = pytest.importorskip("openai", reason="the OpenAI client is needed (pip install openai)")

from _server_support import running_server, wait_ready  # noqa: E402
from _support import REF_TEXT, reference_wavs, tiny_engines  # noqa: E402
from triton_support import free_ports  # noqa: E402

from trt_cosy import CosyVoice, EngineConfig  # noqa: E402
from trt_cosy.server.workers import WORKER_HEADER  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEXTS = ["Hello there.", "How are you today?", "One two three.", "Fine, thanks."]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, v2_tiny_dir) -> Path:
    return tiny_engines(tmp_path_factory, v2_tiny_dir)


@pytest.fixture(scope="module")
def voices(engines, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("worker-voices")
    wavs = reference_wavs(tmp_path_factory.mktemp("worker-wavs"))
    tts = CosyVoice.load(engines, config=EngineConfig(threads=1))
    tts.voice_from_wav(wavs["ref"], REF_TEXT).save(folder / "alice.npz")
    return folder


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(item) for item in text.split()]


@pytest.fixture(scope="module")
def workers_url(engines, voices):
    """``trt-cosy serve --workers 2 --threads 1`` on a free port; yields (url, parent process)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two pinned workers need two CPUs in this process's affinity mask")
    (port,) = free_ports(1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "trt_cosy.cli", "serve", "--engines", str(engines), "--voices-dir",
               str(voices), "--port", str(port), "--workers", "2", "--threads", "1"]
    parent = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(parent.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any("all 2 workers ready" in line for line in log):
            assert parent.poll() is None, "".join(log)
            assert time.monotonic() < deadline, "the workers did not become ready:\n" + "".join(log)
            time.sleep(0.2)
        wait_ready(url)
        yield url, parent
    finally:
        if parent.poll() is None:
            parent.send_signal(signal.SIGTERM)
            try:
                parent.wait(60)
            except subprocess.TimeoutExpired:
                for child in _children(parent.pid):
                    os.kill(child, signal.SIGKILL)
                parent.kill()
                parent.wait(10)


def _send_health(connection: socket.socket) -> None:
    connection.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")


def _worker_of(connection: socket.socket) -> str:
    """The worker header of the answer on ``connection``."""
    data = b""
    while b"\r\n\r\n" not in data:
        piece = connection.recv(65536)
        assert piece, data
        data += piece
    headers = dict(
        line.split(": ", 1) for line in data.split(b"\r\n\r\n")[0].decode().split("\r\n")[1:]
    )
    return {key.lower(): value for key, value in headers.items()}[WORKER_HEADER]


@pytest.mark.slow
def test_two_workers_are_pinned_apart_and_take_connections_in_turn(workers_url):
    url, parent = workers_url
    port = int(url.rsplit(":", 1)[1])
    # A worker that holds a connection which has sent nothing yet takes no more: the second open
    # connection goes to the other worker, whichever took the first. The first sends its request only
    # after the second is answered: answered at once, it would free its worker, which on a loaded machine
    # could then take the second before the other worker is scheduled at all.
    first = socket.create_connection(("127.0.0.1", port), timeout=120)
    second = socket.create_connection(("127.0.0.1", port), timeout=120)
    try:
        _send_health(second)
        second_worker = _worker_of(second)
        _send_health(first)
        names = {_worker_of(first), second_worker}
    finally:
        first.close()
        second.close()
    assert len(names) == 2, names
    pids = sorted(int(name.split("@")[0]) for name in names)
    assert set(pids) <= set(_children(parent.pid))  # (multiprocessing's resource tracker is a child too)
    masks = [os.sched_getaffinity(pid) for pid in pids]
    assert [len(mask) for mask in masks] == [1, 1] and not masks[0] & masks[1], masks  # --threads 1: one core each
    assert masks[0] | masks[1] <= os.sched_getaffinity(0)


@pytest.mark.slow
def test_two_workers_answer_like_the_single_process_server(workers_url, engines, voices, tmp_path):
    url, _ = workers_url
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=180)
    jobs = [(TEXTS[index % len(TEXTS)], index) for index in range(4)]

    def speak(job):
        text, seed = job
        response = client.audio.speech.with_raw_response.create(
            model="tts-1", voice="alice", input=text, response_format="pcm", extra_body={"seed": seed})
        return response.content, response.headers[WORKER_HEADER]

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(speak, jobs))
    assert all(len(audio) > 2000 for audio, _ in answers)

    single = CosyVoice.load(engines, config=EngineConfig(threads=1))
    with running_server(single, voices) as local_url:
        wait_ready(local_url)
        local = openai.OpenAI(base_url=local_url + "/v1", api_key="unused", max_retries=0, timeout=180)
        for (text, seed), (audio, worker) in zip(jobs, answers, strict=True):
            expected = local.audio.speech.with_raw_response.create(
                model="tts-1", voice="alice", input=text, response_format="pcm", extra_body={"seed": seed}).content
            assert audio == expected, (text, seed, worker)


@pytest.mark.slow
def test_sigterm_stops_every_worker(workers_url):
    _, parent = workers_url
    children = _children(parent.pid)
    assert len(children) >= 2
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(60) == 0
    for child in children:
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child}").exists() and _zombie_or_alive(child):
            assert time.monotonic() < deadline, f"child {child} still runs"
            time.sleep(0.1)


def _zombie_or_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
