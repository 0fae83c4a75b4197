"""The HTTP app as a Ray Serve deployment (``trt_cosy.serving.ray_app``): a local Ray bound to 127.0.0.1,
2 replicas, concurrent OpenAI-client requests (streamed and not). Both replicas must answer (the
``X-Trt-Cosy-Replica`` header names each), and every answer must equal the single-process server's."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("python_multipart")
ray = pytest.importorskip("ray", reason="Ray Serve is needed (pip install 'trt-cosy[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is needed (pip install 'trt-cosy[ray]')")
openai = pytest.importorskip("openai", reason="the OpenAI client is needed (pip install openai)")

from _server_support import running_server, wait_ready  # noqa: E402
from _support import REF_TEXT, reference_wavs, tiny_engines  # noqa: E402
from triton_support import free_ports  # noqa: E402

from trt_cosy import CosyVoice, EngineConfig  # noqa: E402
from trt_cosy.serving.ray_app import REPLICA_HEADER, RayServeOptions, deployment_for  # noqa: E402

TEXTS = ["Hello there.", "How are you today?", "One two three.", "Fine, thanks."]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, v2_tiny_dir) -> Path:
    return tiny_engines(tmp_path_factory, v2_tiny_dir)


@pytest.fixture(scope="module")
def voices(engines, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("ray-voices")
    wavs = reference_wavs(tmp_path_factory.mktemp("ray-wavs"))
    tts = CosyVoice.load(engines, config=EngineConfig(threads=1))
    tts.voice_from_wav(wavs["ref"], REF_TEXT).save(folder / "alice.npz")
    return folder


@pytest.fixture(scope="module")
def ray_url(engines, voices):
    """Two replicas behind Ray Serve's proxy on 127.0.0.1; yields the base URL."""
    root = str(Path(__file__).resolve().parent.parent)  # replicas import this checkout's trt_cosy
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")]))
    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False,
             object_store_memory=200 * 1024 * 1024, runtime_env={"env_vars": {"PYTHONPATH": path}},
             log_to_driver=False)
    try:
        (port,) = free_ports(1)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = RayServeOptions(engines=engines, voices_dir=voices, port=port, threads=1, replicas=2,
                                  settings={"warmup": False})
        serve.run(deployment_for(options), name="trt_cosy", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_ready(url)
        _wait_for_replicas(url, 2)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def _wait_for_replicas(url: str, count: int, timeout_s: float = 180.0) -> None:
    """Until the proxy routes to ``count`` replicas: ``serve.run`` returns once every replica runs, but the
    proxy learns of them later (a long poll), and on a loaded machine a burst sent before that all goes to
    the one it knows. Concurrent health checks, so that its power-of-two-choices router spreads them."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=30) as client, ThreadPoolExecutor(4) as pool:
        while len(seen) < count:
            assert time.monotonic() < deadline, f"only replicas {seen} answered within {timeout_s:.0f} s"
            answers = list(pool.map(lambda _: client.get(url + "/health"), range(4)))
            seen |= {answer.headers[REPLICA_HEADER] for answer in answers if answer.status_code == 200}
            time.sleep(0.2)


@pytest.mark.slow
def test_replicas_are_pinned_to_disjoint_cores(ray_url):
    """Each replica claimed its own slot of the machine's plan (threads=1: one core each) before loading."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two pinned replicas need two CPUs in this process's affinity mask")
    import httpx

    seen: set[str] = set()
    with httpx.Client(timeout=60) as client, ThreadPoolExecutor(4) as pool:
        for _ in range(15):  # concurrent, as in _wait_for_replicas: one at a time may all go to one replica
            answers = list(pool.map(lambda _: client.get(ray_url + "/health"), range(4)))
            seen |= {answer.headers[REPLICA_HEADER] for answer in answers}
            if len(seen) == 2:
                break
    assert len(seen) == 2, seen
    masks = [os.sched_getaffinity(int(name.split("@")[0])) for name in sorted(seen)]
    assert [len(mask) for mask in masks] == [1, 1] and not masks[0] & masks[1], masks


def _speak(client, text: str, seed: int, stream: bool) -> tuple[bytes, str]:
    body = dict(model="tts-1", voice="alice", input=text, response_format="pcm")
    if stream:
        extra = {"seed": seed, "stream": True}
        with client.audio.speech.with_streaming_response.create(**body, extra_body=extra) as response:
            return b"".join(response.iter_bytes()), response.headers[REPLICA_HEADER]
    response = client.audio.speech.with_raw_response.create(**body, extra_body={"seed": seed})
    return response.content, response.headers[REPLICA_HEADER]


@pytest.mark.slow
def test_two_replicas_serve_the_openai_route_like_the_single_process_server(ray_url, engines, voices, tmp_path):
    client = openai.OpenAI(base_url=ray_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    jobs = [(TEXTS[index % len(TEXTS)], index, index % 2 == 0) for index in range(8)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: _speak(client, *job), jobs))
    replicas = {replica for _, replica in answers}
    assert len(replicas) == 2, replicas  # both replicas answered
    assert all(len(audio) > 2000 for audio, _ in answers)

    single = CosyVoice.load(engines, config=EngineConfig(threads=1))
    local_voices = tmp_path / "voices"
    local_voices.mkdir()
    (local_voices / "alice.npz").write_bytes((voices / "alice.npz").read_bytes())
    with running_server(single, local_voices) as url:
        wait_ready(url)
        local = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for (text, seed, stream), (audio, replica) in zip(jobs, answers, strict=True):
            body = dict(model="tts-1", voice="alice", input=text, response_format="pcm")
            extra = {"seed": seed, "stream": True} if stream else {"seed": seed}
            with local.audio.speech.with_streaming_response.create(**body, extra_body=extra) as response:
                expected = b"".join(response.iter_bytes())
            assert audio == expected, (text, seed, stream, replica)


def test_ray_back_pressure_is_tied_to_each_replica_admission(engines):
    """Ray sends a replica at most what its app holds (running + its own queue, which admission by
    expected work fills only with what can finish), and requests that find every replica full wait at
    the proxy only up to the app's queue length; Ray answers the rest 503 at once."""
    deployment = deployment_for(RayServeOptions(engines=engines, max_concurrent=2, max_queue=3))._bound_deployment
    assert (deployment.max_ongoing_requests, deployment.max_queued_requests) == (5, 3)
