"""The HTTP server on real uvicorn (loopback, a free port) with the tiny ONNX Runtime engines.

Real audio end to end: OpenAI's request shape (and the OpenAI client when installed), streaming
that delivers bytes before the synthesis ends, concurrent clients, every response format, and
voices that survive a restart. The helpers here are shared with tests/test_server_limits.py.
"""

from __future__ import annotations

import contextlib
import io
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("python_multipart")
pytest.importorskip(
    "prometheus_client", reason="the server's metrics need prometheus-client (the [serve] extra)"
)
httpx = pytest.importorskip("httpx")

# Shared fixtures and helpers of the API tests (tests/ is on sys.path under pytest's default import mode).
from _support import tiny_engines  # noqa: E402
from test_tts import REF_TEXT, reference_wavs  # noqa: E402

from trt_cosy import AudioChunk, CosyVoice, EngineConfig  # noqa: E402
from trt_cosy.server import ServerSettings, ThreadedServer, create_app  # noqa: E402

SAMPLE_RATE = 24000
OPENAI_HEADERS = {  # what the OpenAI Python client sends besides its platform headers
    "Authorization": "Bearer sk-unused",
    "Content-Type": "application/json",
    "Accept": "application/octet-stream",
}


# ----------------------------------------------------------------------------- shared helpers


class RecordingTTS:
    """Wraps a TTS engine: every request's chunks are timed and its closing is recorded.

    With ``scripted_chunks`` set, synthesis does not run the models: after the real input checks it
    yields that many 0.1 s chunks, each after ``delay_s`` and only while ``gate`` is set.
    """

    def __init__(self, tts, scripted_chunks: int | None = None, delay_s: float = 0.0):
        self.tts = tts
        self.sample_rate = tts.sample_rate
        self.model_id = tts.model_id
        self.scripted_chunks = scripted_chunks
        self.delay_s = delay_s
        self.gate = threading.Event()
        self.gate.set()
        self.requests: list[dict] = []

    def voice_from_wav(self, path, text=None):
        return self.tts.voice_from_wav(path, text)

    def synthesize(self, text, voice, seed=None, config=None):
        chunks = self.tts.synthesize(text, voice, seed, config)  # the real checks, at once
        record = {"times": [], "closed": False, "finished": False, "config": config}
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


def decode(data: bytes) -> tuple[np.ndarray, int]:
    audio, rate = soundfile.read(io.BytesIO(data), dtype="float32")
    return audio, rate


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def wavs(tmp_path_factory) -> dict[str, Path]:
    return reference_wavs(tmp_path_factory.mktemp("server-wavs"))


@pytest.fixture(scope="module")
def ort_tts(tmp_path_factory, v2_tiny_dir) -> CosyVoice:
    return CosyVoice.load(tiny_engines(tmp_path_factory, v2_tiny_dir), config=EngineConfig(threads=1))


@pytest.fixture(scope="module")
def served(ort_tts, wavs, tmp_path_factory):
    """One server for the module: (url, recording tts, voices dir) with the voice "alice" stored."""
    voices_dir = tmp_path_factory.mktemp("served-voices")
    recording = RecordingTTS(ort_tts)
    with running_server(recording, voices_dir, max_concurrent=2) as url:
        wait_ready(url)
        assert upload_voice(url, "alice", wavs["ref"]).status_code == 201
        yield url, recording, voices_dir


# ----------------------------------------------------------------------------- tests


@pytest.mark.slow
def test_openai_request_shape_gets_a_wav(served):
    url, _, _ = served
    body = {"model": "tts-1", "input": "Hi.", "voice": "alice", "response_format": "wav", "speed": 1.0}
    response = httpx.post(url + "/v1/audio/speech", json=body, headers=OPENAI_HEADERS, timeout=60)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "audio/wav"
    audio, rate = decode(response.content)
    assert rate == SAMPLE_RATE and audio.ndim == 1 and audio.shape[0] > SAMPLE_RATE // 10, audio.shape
    assert np.isfinite(audio).all() and np.abs(audio).max() > 0


@pytest.mark.slow
def test_same_seed_same_audio_and_every_format_decodes(served):
    url, _, _ = served
    body = {"model": "tts-1", "input": "Hi.", "voice": {"id": "alice"}, "seed": 5}
    pcm = httpx.post(url + "/v1/audio/speech", json={**body, "response_format": "pcm"}, timeout=60)
    again = httpx.post(
        url + "/tts", json={"text": "Hi.", "voice": "alice", "format": "pcm", "seed": 5}, timeout=60
    )
    assert pcm.status_code == again.status_code == 200, (pcm.text, again.text)
    assert pcm.content == again.content and len(pcm.content) % 2 == 0
    expected = np.frombuffer(pcm.content, "<i2").astype(np.float32) / 32767  # expected: [N]
    listing = httpx.post(url + "/tts", json={"text": "Hi.", "voice": "alice", "format": "aac"})
    served_formats = assert_error(listing, 400, "unsupported_format")[
        "message"
    ]  # "... use one of wav, pcm, ..."
    for name in ("wav", "flac", "mp3", "opus"):
        if name not in served_formats:
            continue  # this libsndfile has no encoder for it
        response = httpx.post(url + "/v1/audio/speech", json={**body, "response_format": name}, timeout=60)
        assert response.status_code == 200, response.text
        audio, rate = decode(response.content)
        assert rate == SAMPLE_RATE, name
        if name in ("wav", "flac"):  # lossless: the same samples as pcm
            error = np.abs(audio - expected).max()
            assert audio.shape == expected.shape and error <= 1.5 / 32767, (name, error)
        else:
            assert abs(audio.shape[0] - expected.shape[0]) < SAMPLE_RATE // 5, (
                name,
                audio.shape,
                expected.shape,
            )


@pytest.mark.slow
def test_streaming_sends_audio_before_the_synthesis_ends(served):
    url, recording, _ = served
    body = {
        "model": "tts-1",
        "input": "Good morning.",
        "voice": "alice",
        "response_format": "wav",
        "stream": True,
    }
    pieces, first_at = [], None
    with httpx.stream(
        "POST", url + "/v1/audio/speech", json=body, headers=OPENAI_HEADERS, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "audio/wav"
        for piece in response.iter_bytes():
            first_at = first_at or time.perf_counter()
            pieces.append(piece)
    record = recording.requests[-1]
    assert getattr(record["config"], "stream", True), record["config"]
    assert record["finished"] and len(record["times"]) >= 2, record
    # The client held audio before the engine had produced the last chunk.
    assert first_at < record["times"][-1], (first_at, record["times"])
    data = b"".join(pieces)
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    assert struct.unpack("<I", data[4:8])[0] == struct.unpack("<I", data[40:44])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", data[24:28])[0] == SAMPLE_RATE
    assert (len(data) - 44) % 2 == 0 and len(data) - 44 >= SAMPLE_RATE  # 16-bit samples, >= 0.5 s


@pytest.mark.slow
def test_concurrent_clients_all_get_their_audio(served):
    url, _, _ = served
    seeds = (1, 2, 3)
    results: dict[int, httpx.Response] = {}

    def speak(seed: int) -> None:
        body = {"model": "tts-1", "input": "Hi.", "voice": "alice", "response_format": "pcm", "seed": seed}
        results[seed] = httpx.post(url + "/v1/audio/speech", json=body, timeout=120)

    threads = [threading.Thread(target=speak, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(results[seed].status_code == 200 for seed in seeds), [r.text for r in results.values()]
    assert len({results[seed].content for seed in seeds}) == 3  # each client got its own audio
    alone = httpx.post(
        url + "/v1/audio/speech",
        json={"model": "tts-1", "input": "Hi.", "voice": "alice", "response_format": "pcm", "seed": 2},
        timeout=60,
    )
    assert alone.content == results[2].content  # concurrency does not change a seeded request
    metrics = httpx.get(url + "/metrics").text
    assert (
        metric_value(metrics, "trt_cosy_active_requests")
        == metric_value(metrics, "trt_cosy_queue_depth")
        == 0
    )
    assert metric_value(metrics, "trt_cosy_http_requests_total", path="/v1/audio/speech", status="200") >= 4


@pytest.mark.slow
def test_openai_python_client_streaming_and_not(served):
    openai = pytest.importorskip("openai")
    url, _, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-unused", max_retries=0, timeout=60)
    assert [model.id for model in client.models.list().data] == ["cosyvoice2"]
    speech = client.audio.speech.create(model="tts-1", voice="alice", input="Hi.", response_format="wav")
    audio, rate = decode(speech.content)
    assert rate == SAMPLE_RATE and audio.shape[0] > 0
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alice", input="Hi.", response_format="pcm", extra_body={"stream": True}
    ) as response:
        data = b"".join(response.iter_bytes())
    assert len(data) > 0 and len(data) % 2 == 0
    with pytest.raises(openai.NotFoundError, match="voice 'nobody' does not exist"):
        client.audio.speech.create(model="tts-1", voice="nobody", input="Hi.")


@pytest.mark.slow
def test_uploaded_voice_survives_a_restart(ort_tts, wavs, tmp_path):
    with running_server(ort_tts, tmp_path) as url:
        wait_ready(url)
        created = upload_voice(url, "bob", wavs["ref"])
        assert created.status_code == 201, created.text
        assert created.json()["mode"] == "zero-shot" and created.json()["prompt_text"]
        cross = upload_voice(url, "carol", wavs["ref"], text=None)
        assert cross.status_code == 201 and cross.json()["mode"] == "cross-lingual"
        before = httpx.post(
            url + "/tts", json={"text": "Hi.", "voice": "bob", "format": "pcm", "seed": 3}, timeout=60
        )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bob.npz", "carol.npz"]
    with running_server(ort_tts, tmp_path) as url:
        wait_ready(url)
        listed = httpx.get(url + "/v1/voices").json()["data"]
        assert [voice["id"] for voice in listed] == ["bob", "carol"]
        after = httpx.post(
            url + "/tts", json={"text": "Hi.", "voice": "bob", "format": "pcm", "seed": 3}, timeout=60
        )
    assert before.status_code == after.status_code == 200
    assert before.content == after.content  # the stored prompt features are reused, not recomputed
