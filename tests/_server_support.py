"""Helpers of the HTTP server tests: a recording (optionally scripted) TTS, a real uvicorn on a free port,
and checks of OpenAI-shaped errors and Prometheus metrics (test_server*, test_playground, test_ray_serve).

Needs the server extras: the guards below (those of tests/test_server.py, which every server test file
imported before these helpers moved here) skip the importing test module when one is missing.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("python_multipart")
pytest.importorskip(
    "prometheus_client", reason="the server's metrics need prometheus-client (the [serve] extra)"
)
httpx = pytest.importorskip("httpx")

from _support import REF_TEXT, reference_wavs, tiny_release  # noqa: E402
from _tts_support import make_torch_tts  # noqa: E402

from trt_cosy import AudioChunk  # noqa: E402
from trt_cosy.server import ServerSettings, ThreadedServer, create_app  # noqa: E402

SAMPLE_RATE = 24000
SPEECH = "/v1/audio/speech"
GOOD = {"model": "tts-1", "input": "Hello there.", "voice": "alice"}


class RecordingTTS:
    """Wraps a TTS engine: every request's chunks are timed and its closing is recorded.

    With ``scripted_chunks`` set, synthesis does not run the models: after the real input checks it
    yields that many 0.1 s chunks, each after ``delay_s`` and only while ``gate`` is set.
    """

    def __init__(self, tts, scripted_chunks: int | None = None, delay_s: float = 0.0):
        self.tts = tts
        self.sample_rate = tts.sample_rate
        self.model_id = tts.model_id
        self.family = tts.family
        self.tokenizer = getattr(tts, "tokenizer", None)  # the SSE usage counts the input's text tokens
        self.scripted_chunks = scripted_chunks
        self.delay_s = delay_s
        self.gate = threading.Event()
        self.gate.set()
        self.requests: list[dict] = []

    def voice_from_wav(self, path, text=None):
        return self.tts.voice_from_wav(path, text)

    def synthesize(self, text, voice, seed=None, config=None):
        chunks = self.tts.synthesize(text, voice, seed, config)  # the real checks, at once
        record = {"times": [], "closed": False, "finished": False, "config": config, "voice": voice}
        self.requests.append(record)
        if self.scripted_chunks is not None:
            chunks.close()
            chunks = self._scripted()
        return self._recorded(chunks, record)

    def _scripted(self) -> Iterator[AudioChunk]:
        count = self.scripted_chunks
        for index in range(count):
            if not self.gate.wait(30):
                raise RuntimeError("test gate never opened")
            time.sleep(self.delay_s)
            samples = np.full(SAMPLE_RATE // 10, 0.1, np.float32)  # samples: [2400]
            yield AudioChunk(samples, SAMPLE_RATE, index, index == count - 1, {}, "")

    @staticmethod
    def _recorded(chunks: Iterator[AudioChunk], record: dict) -> Iterator[AudioChunk]:
        try:
            for chunk in chunks:
                record["times"].append(time.perf_counter())
                yield chunk
            record["finished"] = True
        finally:
            record["closed"] = True
            chunks.close()


@contextlib.contextmanager
def running_server(tts, voices_dir: Path, **settings) -> Iterator[str]:
    """A real uvicorn on 127.0.0.1 with a free port serving ``create_app(tts, ...)``; yields its URL."""
    app = create_app(tts, ServerSettings(voices_dir=voices_dir, **settings))
    with ThreadedServer(app) as server:
        yield server.url


def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(url + "/health").status_code != 200:
        assert time.monotonic() < deadline, httpx.get(url + "/health").text
        time.sleep(0.02)


def assert_error(response, status: int, code: str | None = None) -> dict:
    """The response is ``status`` with OpenAI's error body; returns the error object."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], error
    assert error["type"] and "code" in error, error
    if code is not None:
        assert error["code"] == code, error
    return error


def upload_voice(url: str, name: str, wav: Path, text: str | None = REF_TEXT, query: str = ""):
    data = {"name": name} if text is None else {"name": name, "text": text}
    with open(wav, "rb") as stream:
        return httpx.post(
            f"{url}/v1/voices{query}", files={"file": (wav.name, stream, "audio/wav")}, data=data, timeout=60
        )


def metric_value(text: str, sample: str, **labels: str) -> float:
    """One sample of a Prometheus exposition, parsed with prometheus_client's parser; 0 when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == sample and found.labels == labels:
                return found.value
    return 0.0


def scripted_server_fixtures(label: str):
    """The fixtures of server tests whose synthesis is scripted over the tiny torch reference; assign them
    at module level: ``wavs, torch_tts, alice, voices_dir, scripted = scripted_server_fixtures("auth")``.

    ``wavs``, ``torch_tts`` and ``alice`` (a zero-shot voice) are module-scoped; ``voices_dir`` is a fresh
    folder holding ``alice.npz`` and ``scripted`` a ``RecordingTTS`` yielding three 0.1 s chunks, per test.
    """
    @pytest.fixture(scope="module")
    def wavs(tmp_path_factory) -> dict[str, Path]:
        return reference_wavs(tmp_path_factory.mktemp(f"{label}-wavs"))

    @pytest.fixture(scope="module")
    def torch_tts(tmp_path_factory, v2_tiny_dir):
        return make_torch_tts(tiny_release(tmp_path_factory, v2_tiny_dir))

    @pytest.fixture(scope="module")
    def alice(torch_tts, wavs):
        return torch_tts.voice_from_wav(wavs["ref"], "Hello, this is me.")

    @pytest.fixture
    def voices_dir(tmp_path, alice) -> Path:
        alice.save(tmp_path / "alice.npz")
        return tmp_path

    @pytest.fixture
    def scripted(torch_tts) -> RecordingTTS:
        return RecordingTTS(torch_tts, scripted_chunks=3)

    return wavs, torch_tts, alice, voices_dir, scripted


def serve_without_serving(monkeypatch, tts, cache: Path) -> list[tuple]:
    """`trt-cosy serve` up to the server: ``CosyVoice.load`` returns ``tts``, the trt-cosy cache is ``cache``,
    and ``run_server`` records ``(tts, settings)`` in the returned list instead of serving."""
    from trt_cosy.server import runner
    from trt_cosy.tts import CosyVoice

    served: list[tuple] = []
    monkeypatch.setattr(CosyVoice, "load", classmethod(lambda cls, path, backend="auto", config=None: tts))
    monkeypatch.setattr(runner, "run_server", lambda tts, settings: served.append((tts, settings)))
    monkeypatch.setenv("TRT_COSY_CACHE", str(cache))
    return served


class HoldsLastChunk(RecordingTTS):
    """Scripted chunks; the last waits until ``client_had_audio`` is set (at most 20 s), and
    ``held`` records whether it was. A server that encoded only at the end could deliver nothing
    before it, so the hold would time out: streaming is shown without a race."""

    def __init__(self, tts, chunks: int):
        super().__init__(tts, scripted_chunks=chunks)
        self.client_had_audio = threading.Event()
        self.held: list[bool] = []

    def _scripted(self) -> Iterator[AudioChunk]:
        for chunk in super()._scripted():
            if chunk.is_last:
                self.held.append(self.client_had_audio.wait(20))
            yield chunk
