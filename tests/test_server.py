"""The HTTP server on real uvicorn (loopback, a free port) with the tiny ONNX Runtime engines.

Real audio end to end: OpenAI's request shape (and the OpenAI client when installed), streaming
that delivers bytes before the synthesis ends, concurrent clients, every response format, and
voices that survive a restart. The helpers shared with the other server tests are in tests/_server_support.py.
"""

from __future__ import annotations

import io
import itertools
import struct
import threading
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
from _server_support import (  # noqa: E402
    SAMPLE_RATE,
    RecordingTTS,
    assert_error,
    metric_value,
    running_server,
    upload_voice,
    wait_ready,
)
from _support import reference_wavs, tiny_engines  # noqa: E402

from trt_cosy import AudioChunk, CosyVoice, EngineConfig, SynthesisConfig  # noqa: E402
from trt_cosy.server.voices_store import VoiceStore  # noqa: E402

OPENAI_HEADERS = {  # what the OpenAI Python client sends besides its platform headers
    "Authorization": "Bearer sk-unused",
    "Content-Type": "application/json",
    "Accept": "application/octet-stream",
}


# ----------------------------------------------------------------------------- helpers


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
    # stream: false, the schedule /tts uses by default, so that the two give the same samples.
    body = {"model": "tts-1", "input": "Hi.", "voice": {"id": "alice"}, "seed": 5, "stream": False}
    pcm = httpx.post(url + "/v1/audio/speech", json={**body, "response_format": "pcm"}, timeout=60)
    again = httpx.post(
        url + "/tts", json={"text": "Hi.", "voice": "alice", "format": "pcm", "seed": 5}, timeout=60
    )
    assert pcm.status_code == again.status_code == 200, (pcm.text, again.text)
    assert pcm.content == again.content and len(pcm.content) % 2 == 0
    expected = np.frombuffer(pcm.content, "<i2").astype(np.float32) / 32767  # expected: [N]
    listing = httpx.post(url + "/tts", json={"text": "Hi.", "voice": "alice", "format": "ogg-vorbis"})
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
def test_streaming_sends_audio_before_the_synthesis_ends(served, monkeypatch):
    url, recording, voices_dir = served
    first_bytes = threading.Event()
    seed = multi_chunk_seed(recording.tts, LONG_INPUT, voices_dir)
    held = hold_last_chunk_until(recording, monkeypatch, first_bytes, seed)
    body = {
        "model": "tts-1",
        "input": LONG_INPUT,
        "voice": "alice",
        "response_format": "wav",
        "stream": True,
    }
    pieces = []
    with httpx.stream(
        "POST", url + "/v1/audio/speech", json=body, headers=OPENAI_HEADERS, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"] == "audio/wav"
        for piece in response.iter_bytes():
            first_bytes.set()
            pieces.append(piece)
    record = recording.requests[-1]
    assert getattr(record["config"], "stream", True), record["config"]
    assert record["finished"] and len(record["times"]) >= 2, record
    # The client held audio before the engine released the last chunk.
    assert held == {"client_had_bytes": True}, held
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
    url, recording, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-unused", max_retries=0, timeout=60)
    assert [model.id for model in client.models.list().data] == ["cosyvoice2"]
    speech = client.audio.speech.create(model="tts-1", voice="alice", input="Hi.", response_format="wav")
    audio, rate = decode(speech.content)
    assert rate == SAMPLE_RATE and audio.shape[0] > 0
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alice", input="Hi.", response_format="pcm", extra_body={"stream": False}
    ) as response:
        data = b"".join(response.iter_bytes())
    assert len(data) > 0 and len(data) % 2 == 0
    assert not getattr(recording.requests[-1]["config"], "stream", False)  # stream: false turns it off
    with pytest.raises(openai.NotFoundError, match="voice 'nobody' does not exist"):
        client.audio.speech.create(model="tts-1", voice="nobody", input="Hi.")


@pytest.mark.slow
def hold_last_chunk_until(recording, monkeypatch, event: threading.Event, seed: int | None = None) -> dict:
    """Make ``recording`` hold each request's last chunk until ``event`` is set (at most 20 s); the
    returned dict gets ``client_had_bytes`` (whether it was set in time). A server that did not stream
    could deliver nothing before the end, so the hold times out: streaming is shown without a race."""
    held: dict = {}
    synthesize = recording.synthesize

    default_seed = seed

    def holding_last_chunk(text, voice, seed=None, config=None):
        if seed is None:  # the client sent none: ``default_seed`` (one whose speech streams in chunks)
            seed = default_seed
        chunks = synthesize(text, voice, seed, config)

        def hold() -> Iterator[AudioChunk]:
            try:
                for chunk in chunks:
                    if chunk.is_last:
                        held["client_had_bytes"] = event.wait(20)
                    yield chunk
            finally:
                chunks.close()

        return hold()

    monkeypatch.setattr(recording, "synthesize", holding_last_chunk)
    return held


_SEEDS: dict[tuple[str, str], list[int]] = {}  # (text, voice) -> [the seed found], for the module's server


def multi_chunk_seed(tts, text: str, voices_dir, voice_name: str = "alice") -> int:
    """The first seed for which ``text`` in the stored voice streams in at least two chunks on these engines.

    The random tiny LLM may sample a stop token (6562/6563, which stop before the minimum length, as in the
    official code) within the first chunk's tokens in about 1.5 % of unseeded requests; that request then
    has one chunk, and a test that holds the last chunk until the client has bytes cannot tell streaming
    from not. Choosing the seed (here, in the test, before the request) makes the engine's output fixed and
    the precondition checked, not hoped."""
    store = VoiceStore(voices_dir, tts.model_id)
    store.load()
    voice = store.get(voice_name).voice
    for seed in _SEEDS.setdefault((text, voice_name), []) or range(20):
        chunks = tts.synthesize(text, voice, seed, SynthesisConfig(stream=True))
        try:
            if len(list(itertools.islice(chunks, 2))) == 2:  # a second chunk exists: stop there
                _SEEDS[text, voice_name] = [seed]
                return seed
        finally:
            chunks.close()
    raise AssertionError(f"no seed in 0..19 streams {text!r} in two chunks")


# Long enough that the LLM's minimum length (2 speech tokens per text token: 43 text tokens with the test
# tokenizer, so at least 86 speech tokens) passes the first streaming chunk (25 tokens + at most 24 of prompt
# pad + 3 of look-ahead), so a streamed reply always has at least two chunks; short enough that the random
# tiny LLM, which speaks to its maximum (20 speech tokens per text token), says at most 34 s.
LONG_INPUT = "Good morning, and welcome to a streamed reply: this sentence is long on purpose."


def test_openai_python_client_streams_pcm_by_default(served, monkeypatch):
    """No extra fields, as OpenAI's own API: the first pcm bytes arrive before the synthesis ends.

    The engine holds its last chunk until the client has received bytes (at most 20 s): a server that
    did not stream could deliver nothing before the end, so the hold would time out. No timing race."""
    openai = pytest.importorskip("openai")
    url, recording, voices_dir = served
    first_bytes = threading.Event()
    seed = multi_chunk_seed(recording.tts, LONG_INPUT, voices_dir)
    held = hold_last_chunk_until(recording, monkeypatch, first_bytes, seed)
    client = openai.OpenAI(base_url=url + "/v1", api_key="sk-unused", max_retries=0, timeout=60)
    pieces = []
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alice", response_format="pcm", input=LONG_INPUT
    ) as response:
        for piece in response.iter_bytes():
            first_bytes.set()
            pieces.append(piece)
    record = recording.requests[-1]
    assert record["config"].stream, record["config"]
    assert record["finished"] and len(record["times"]) >= 2, record
    assert held == {"client_had_bytes": True}, held
    data = b"".join(pieces)
    assert len(data) >= SAMPLE_RATE and len(data) % 2 == 0


@pytest.mark.slow
def test_server_setting_turns_default_streaming_off(ort_tts, wavs, tmp_path):
    recording = RecordingTTS(ort_tts)
    with running_server(recording, tmp_path, stream_speech=False, warmup=False) as url:
        wait_ready(url)
        assert upload_voice(url, "alice", wavs["ref"]).status_code == 201
        body = {"model": "tts-1", "input": "Hi.", "voice": "alice", "response_format": "pcm", "seed": 1}
        plain = httpx.post(url + "/v1/audio/speech", json=body, timeout=60)
        asked = httpx.post(url + "/v1/audio/speech", json={**body, "stream": True}, timeout=60)
    assert plain.status_code == asked.status_code == 200, (plain.text, asked.text)
    assert [bool(record["config"].stream) for record in recording.requests] == [False, True]


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
