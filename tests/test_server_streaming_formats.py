"""Every response format streams, and OpenAI's server-sent events, on a real uvicorn (loopback, free port).

Decoded with a real decoder (FFmpeg through PyAV) and compared in length with the pcm answer to the same
request and seed; events parsed as OpenAI's clients parse them. Most tests script the engine's chunks over
the tiny torch reference (fast, exact timing control); the length checks run the tiny ONNX engines.
"""

from __future__ import annotations

import base64
import io
import json
import time
from collections.abc import Iterator

import numpy as np
import pytest
from _server_support import (  # noqa: E402  (skips the module without the server extras)
    GOOD,
    SAMPLE_RATE,
    SPEECH,
    HoldsLastChunk,
    RecordingTTS,
    assert_error,
    httpx,
    metric_value,
    running_server,
    scripted_server_fixtures,
    upload_voice,
    wait_ready,
)
from _support import tiny_engines  # noqa: E402

av = pytest.importorskip("av", reason="streamed mp3/opus/aac/flac need PyAV (the [codecs] extra)")

from trt_cosy import AudioChunk, CosyVoice, EngineConfig  # noqa: E402

wavs, torch_tts, alice, voices_dir, scripted = scripted_server_fixtures("formats")

CODECS = ("mp3", "opus", "aac", "flac")
# Codec padding, in samples at the stream's rate: LAME's delay and last frame (< 2 x 1152), AAC's
# priming and last frame (< 2 x 1024); Ogg Opus and FLAC trim to the exact length.
PADDING = {"mp3": 2 * 1152, "aac": 2 * 1024, "opus": 0, "flac": 0}


def decoded(data: bytes) -> tuple[np.ndarray, int]:
    """Mono float32 samples [N] and rate of an encoded stream (FFmpeg's decoders, through PyAV)."""
    with av.open(io.BytesIO(data)) as container:
        frames = [frame for frame in container.decode(audio=0)]
    rate = frames[0].sample_rate
    samples = np.concatenate([frame.to_ndarray().reshape(-1) for frame in frames])  # [N]
    if samples.dtype == np.int16:  # FLAC decodes to 16-bit integers
        return samples.astype(np.float32) / 32768, rate
    return samples.astype(np.float32), rate


def sse_events(lines: Iterator[str]) -> list[dict]:
    """The JSON events of an event stream, as OpenAI's clients read them (``data: `` lines)."""
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def assert_length_matches(name: str, data: bytes, pcm_samples: int) -> None:
    samples, rate = decoded(data)
    expected = pcm_samples * rate // SAMPLE_RATE  # Ogg Opus always decodes at 48 kHz
    assert expected <= samples.shape[0] <= expected + PADDING[name] * rate // SAMPLE_RATE, (
        name,
        samples.shape,
        expected,
    )
    assert np.isfinite(samples).all() and np.abs(samples).max() > 0, name


# ----------------------------------------------------------------------------- scripted engine


class ScriptedWithFailure(RecordingTTS):
    """Scripted chunks; the request fails (RuntimeError) after ``fail_after`` chunks."""

    def __init__(self, tts, fail_after: int):
        super().__init__(tts, scripted_chunks=10)
        self.fail_after = fail_after

    def _scripted(self) -> Iterator[AudioChunk]:
        for index, chunk in enumerate(super()._scripted()):
            if index == self.fail_after:
                raise RuntimeError("the vocoder broke")
            yield chunk


@pytest.mark.parametrize("name", ("pcm", "wav", *CODECS))
def test_every_format_streams_in_events_and_as_audio(scripted, voices_dir, name):
    with running_server(scripted, voices_dir, warmup=False) as url:
        wait_ready(url)
        body = {**GOOD, "response_format": name, "seed": 1}
        audio = httpx.post(url + SPEECH, json=body, timeout=60)
        with httpx.stream(
            "POST", url + SPEECH, json={**body, "stream_format": "sse"}, timeout=60
        ) as response:
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["cache-control"] == "no-cache" and response.headers["x-request-id"]
            events = sse_events(response.iter_lines())
    assert audio.status_code == 200 and audio.headers["x-request-id"], audio.text
    assert [event["type"] for event in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1), events
    assert events[-1]["type"] == "speech.audio.done", events[-1]
    usage = events[-1]["usage"]
    assert (
        usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    )
    joined = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
    assert all(record["config"].stream for record in scripted.requests), "the engine streamed"
    pcm_samples = 3 * SAMPLE_RATE // 10  # the script: three 0.1 s chunks
    if name == "pcm":
        assert audio.content == joined and len(joined) == 2 * pcm_samples
    elif name == "wav":
        assert audio.content == joined and len(joined) == 44 + 2 * pcm_samples
    else:
        assert len(events) >= 3, "deltas as the chunks are encoded, not one at the end"
        for data in (audio.content, joined):
            assert_length_matches(name, data, pcm_samples)


@pytest.mark.parametrize("name", CODECS)
def test_compressed_formats_send_audio_before_the_synthesis_ends(torch_tts, voices_dir, name):
    holding = HoldsLastChunk(torch_tts, chunks=8)
    with running_server(holding, voices_dir, warmup=False) as url:
        wait_ready(url)
        received = b""
        with httpx.stream(
            "POST", url + SPEECH, json={**GOOD, "response_format": name}, timeout=60
        ) as response:
            assert response.status_code == 200
            for piece in response.iter_bytes():
                received += piece
                holding.client_had_audio.set()
    assert holding.held == [True]
    assert_length_matches(name, received, 8 * SAMPLE_RATE // 10)


@pytest.mark.parametrize("name", CODECS)
def test_the_first_chunks_head_is_encoded_alone_and_carries_audio(name):
    """The first bytes leave after a short head of the first chunk is encoded, and they already hold
    decodable audio (not just a container header), whatever the codec's frame and delay."""
    from trt_cosy.server.audio_stream import FIRST_PIECE_S, first_pieces
    from trt_cosy.server.streaming_encoders import open_encoder

    samples = (0.3 * np.sin(np.arange(2 * SAMPLE_RATE) * 0.05)).astype(np.float32)  # 2 s: [48000]
    chunk = AudioChunk(samples, SAMPLE_RATE, 0, False, {}, "")
    encoder = open_encoder(name, SAMPLE_RATE)
    head, rest = first_pieces(encoder, chunk)
    assert head.shape == (int(FIRST_PIECE_S * SAMPLE_RATE),) and np.array_equal(
        np.concatenate([head, rest]), samples
    )
    first = encoder.encode(head)
    heard, rate = decoded(first)
    assert heard.shape[0] * SAMPLE_RATE // rate >= SAMPLE_RATE // 20, (
        name,
        heard.shape,
    )  # 50 ms of audio at least
    whole = first + encoder.encode(rest) + encoder.finish()
    assert_length_matches(name, whole, samples.shape[0])
    assert encoder.cpu_s > 0
    pcm = open_encoder("pcm", SAMPLE_RATE)
    assert first_pieces(pcm, chunk) == [samples]  # nothing to gain for pcm


def test_encoding_cpu_is_counted_by_format(scripted, voices_dir):
    with running_server(scripted, voices_dir, warmup=False) as url:
        wait_ready(url)
        for name in ("mp3", "pcm"):
            response = httpx.post(url + SPEECH, json={**GOOD, "response_format": name}, timeout=60)
            assert response.status_code == 200, response.text
        metrics = httpx.get(url + "/metrics").text
    mp3 = metric_value(metrics, "trt_cosy_encode_cpu_seconds_total", format="mp3")
    pcm = metric_value(metrics, "trt_cosy_encode_cpu_seconds_total", format="pcm")
    assert 0 < mp3 < 5 and 0 <= pcm < mp3, (mp3, pcm)


def test_sse_reports_a_failure_midway_as_an_error_event(torch_tts, voices_dir):
    failing = ScriptedWithFailure(torch_tts, fail_after=2)
    with running_server(failing, voices_dir, warmup=False) as url:
        wait_ready(url)
        body = {**GOOD, "response_format": "mp3", "stream_format": "sse"}
        with httpx.stream("POST", url + SPEECH, json=body, timeout=60) as response:
            assert response.status_code == 200
            events = sse_events(response.iter_lines())
        after = httpx.post(url + SPEECH, json={**body, "input": "Hello again."}, timeout=60)
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "error", events
    assert events[-1]["error"]["code"] == "synthesis_failed" and "done" not in str(events)
    assert failing.requests[0]["closed"] and not failing.requests[0]["finished"]
    assert after.status_code == 200  # the failure left the server as it was


def test_sse_client_that_leaves_stops_the_synthesis(torch_tts, voices_dir):
    """100 chunks of 0.1 s each: the client reads one event and closes; the engine stops at its next
    chunk (well within a second), not after 10 s."""
    slow = RecordingTTS(torch_tts, scripted_chunks=100, delay_s=0.1)
    with running_server(slow, voices_dir, warmup=False) as url:
        wait_ready(url)
        body = {**GOOD, "response_format": "opus", "stream_format": "sse"}
        with httpx.stream("POST", url + SPEECH, json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    break
            left_at = time.perf_counter()
        record = slow.requests[0]
        deadline = time.monotonic() + 10
        while not record["closed"] and time.monotonic() < deadline:
            time.sleep(0.01)
    assert record["closed"] and not record["finished"], record
    after_leaving = [stamp for stamp in record["times"] if stamp > left_at]
    assert len(after_leaving) <= 5, f"{len(after_leaving)} chunks made after the client left"


def test_openai_fields_with_their_defaults_are_accepted(scripted, voices_dir):
    with running_server(scripted, voices_dir, warmup=False) as url:
        wait_ready(url)
        for extra in (
            {"speed": 1.0},
            {"instructions": ""},
            {"stream_format": "audio"},
            {"stream_format": "audio", "response_format": "mp3", "speed": 1.0},
        ):
            response = httpx.post(url + SPEECH, json={**GOOD, **extra}, timeout=60)
            assert response.status_code == 200, (extra, response.text)
        unknown = httpx.post(url + SPEECH, json={**GOOD, "response_format": "ogg-vorbis"}, timeout=60)
        assert "aac" in assert_error(unknown, 400, "unsupported_format")["message"]


def test_openai_sdk_streams_every_format(scripted, voices_dir):
    openai = pytest.importorskip("openai")
    with running_server(scripted, voices_dir, warmup=False) as url:
        wait_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-unused", max_retries=0, timeout=60)
        for name in CODECS:
            with client.audio.speech.with_streaming_response.create(
                model="gpt-4o-mini-tts", voice="alice", input="Hello there.", response_format=name
            ) as response:
                assert response.headers["x-request-id"] and response.http_request.method == "POST"
                data = b"".join(response.iter_bytes())
            assert_length_matches(name, data, 3 * SAMPLE_RATE // 10)


# ----------------------------------------------------------------------------- real engines


@pytest.fixture(scope="module")
def ort_served(tmp_path_factory, v2_tiny_dir, wavs):
    tts = CosyVoice.load(tiny_engines(tmp_path_factory, v2_tiny_dir), config=EngineConfig(threads=1))
    with running_server(tts, tmp_path_factory.mktemp("ort-voices"), warmup=False) as url:
        wait_ready(url)
        assert upload_voice(url, "alice", wavs["ref"]).status_code == 201
        yield url


@pytest.mark.slow
def test_streamed_formats_have_the_length_of_pcm_for_the_same_seed(ort_served):
    url = ort_served
    body = {"model": "tts-1", "input": "Hello there, how are you?", "voice": "alice", "seed": 7}
    pcm = httpx.post(url + SPEECH, json={**body, "response_format": "pcm"}, timeout=120)
    assert pcm.status_code == 200, pcm.text
    pcm_samples = len(pcm.content) // 2
    for name in CODECS:
        streamed = httpx.post(url + SPEECH, json={**body, "response_format": name}, timeout=120)
        assert streamed.status_code == 200, streamed.text
        assert_length_matches(name, streamed.content, pcm_samples)
    with httpx.stream(
        "POST", url + SPEECH, json={**body, "response_format": "flac", "stream_format": "sse"}, timeout=120
    ) as response:
        events = sse_events(response.iter_lines())
    assert events[-1]["type"] == "speech.audio.done" and events[-1]["usage"]["output_tokens"] > 0, events[-1]
    flac = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
    samples, _ = decoded(flac)
    expected = np.frombuffer(pcm.content, "<i2").astype(np.float32) / 32767  # [N]
    assert samples.shape == expected.shape  # lossless: the very samples of pcm
    assert np.abs(samples - expected).max() <= 1.5 / 32767


@pytest.mark.slow
def test_an_sse_client_that_leaves_stops_the_real_engine_within_a_second(ort_served):
    """The tiny engines speak a long text for many seconds; the client reads one delta and hangs up: the
    synthesis (LLM thread, flow, vocoder) has stopped and freed its slot within a second."""
    url = ort_served
    text = "Hello there, how are you? " * 6
    body = {
        "model": "gpt-4o-mini-tts",
        "input": text,
        "voice": "alice",
        "response_format": "mp3",
        "stream_format": "sse",
        "seed": 3,
    }

    def cancelled() -> float:
        metrics = httpx.get(url + "/metrics", timeout=10).text
        return metric_value(metrics, "trt_cosy_syntheses_cancelled_total", reason="disconnect")

    before = cancelled()
    with httpx.stream("POST", url + SPEECH, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                assert json.loads(line[6:])["type"] == "speech.audio.delta"
                break
        left_at = time.perf_counter()
    while cancelled() == before and time.perf_counter() - left_at < 10:
        time.sleep(0.02)
    stopped_after = time.perf_counter() - left_at
    assert cancelled() == before + 1, "the synthesis ran on after the client left"
    assert stopped_after <= 1.0, f"the synthesis stopped {stopped_after:.2f} s after the client left"
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert metric_value(metrics, "trt_cosy_active_requests") == 0
    after = httpx.post(url + SPEECH, json={**body, "input": "Hi.", "stream_format": "audio"}, timeout=120)
    assert after.status_code == 200 and after.content  # the next request is served as usual


def test_without_pyav_aac_names_the_extra_and_the_others_come_whole(scripted, voices_dir, monkeypatch):
    from trt_cosy.server import audio_encoding

    monkeypatch.setattr(audio_encoding, "pyav_available", lambda: False)
    with running_server(scripted, voices_dir, warmup=False) as url:
        wait_ready(url)
        aac = httpx.post(url + SPEECH, json={**GOOD, "response_format": "aac"}, timeout=60)
        message = assert_error(aac, 400, "unsupported_format")["message"]
        assert "pip install 'trt-cosy[codecs]'" in message, message
        flac = httpx.post(url + SPEECH, json={**GOOD, "response_format": "flac"}, timeout=60)
        with httpx.stream(
            "POST", url + SPEECH, json={**GOOD, "response_format": "flac", "stream_format": "sse"}, timeout=60
        ) as response:
            events = sse_events(response.iter_lines())
    assert flac.status_code == 200 and "content-length" in flac.headers  # one complete file (libsndfile)
    import soundfile

    audio, rate = soundfile.read(io.BytesIO(flac.content), dtype="float32")
    assert rate == SAMPLE_RATE and audio.shape == (3 * SAMPLE_RATE // 10,)
    assert [event["type"] for event in events] == ["speech.audio.delta", "speech.audio.done"]
    assert base64.b64decode(events[0]["audio"]) == flac.content


def test_speed_and_instructions_reach_the_engine(scripted, voices_dir):
    with running_server(scripted, voices_dir, warmup=False) as url:
        wait_ready(url)
        fast = httpx.post(url + SPEECH, json={**GOOD, "speed": 1.5, "response_format": "mp3"}, timeout=60)
        styled = httpx.post(
            url + SPEECH,
            json={**GOOD, "instructions": "Speak cheerfully.", "stream_format": "sse"},
            timeout=60,
        )
        simple = httpx.post(
            url + "/tts",
            json={"text": "Hi.", "voice": "alice", "instructions": "Whisper.", "speed": 0.5},
            timeout=60,
        )
        too_fast = httpx.post(url + SPEECH, json={**GOOD, "speed": 4.5}, timeout=60)
    assert fast.status_code == styled.status_code == simple.status_code == 200, (fast.text, simple.text)
    configs = [record["config"] for record in scripted.requests]
    assert (configs[0].speed, configs[0].stream, configs[0].instruct) == (1.5, False, None)
    assert (configs[1].speed in (None, 1.0), configs[1].stream, configs[1].instruct) == (
        True,
        True,
        "Speak cheerfully.",
    )
    assert (configs[2].speed, configs[2].instruct) == (0.5, "Whisper.")
    assert_error(too_fast, 400, "invalid_speed")
