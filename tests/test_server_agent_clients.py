"""The voice-agent frameworks' OpenAI adapters, replayed against a real uvicorn (loopback, a free port).

Each replay sends exactly what the adapter sends, through the OpenAI SDK as the adapter calls it, and reads
the answer as the adapter reads it (read from their sources, the versions named below):

- LiveKit Agents, ``livekit-plugins-openai`` 1.8.9 ``tts.py``: ``AsyncOpenAI(max_retries=0)`` on an
  ``httpx2.AsyncClient`` with ``Timeout(connect=15, read=5, write=5, pool=5)``; per request
  ``input, model, voice, response_format="mp3", speed=1.0`` (``instructions`` only when set),
  ``stream_format="sse"`` for every model but tts-1/tts-1-hd, ``timeout=Timeout(30, connect=...)``. An
  event stream (by its Content-Type) is parsed line by line: ``speech.audio.delta`` base64 ``audio`` (or
  ``delta``), ``speech.audio.done`` ``usage``; else the bytes are decoded as mp3. It logs a warning when the
  answer has no ``x-request-id``.
- Pipecat, ``pipecat-ai`` 1.14.0 ``services/openai/tts.py``: ``AsyncOpenAI(api_key, base_url)`` (the SDK's
  defaults); the voice must be one of OpenAI's 13 names (checked in the client); per request ``input, model
  ("gpt-4o-mini-tts"), voice, response_format="pcm"`` and ``instructions`` / ``speed`` only when set; the
  body is read with ``iter_bytes(chunk_size)`` as 24 kHz 16-bit PCM.

The engine is scripted (exact timing control); the decoders are real (FFmpeg through PyAV).
"""

from __future__ import annotations

import asyncio
import base64
import io
import json

import numpy as np
import pytest
from _server_support import (  # noqa: E402  (skips the module without the server extras)
    SAMPLE_RATE,
    SPEECH,
    HoldsLastChunk,
    RecordingTTS,
    httpx,
    running_server,
    scripted_server_fixtures,
    wait_ready,
)

openai = pytest.importorskip("openai")
httpx2 = pytest.importorskip("httpx2", reason="the OpenAI SDK's and LiveKit's HTTP client")
av = pytest.importorskip("av", reason="streamed mp3 needs PyAV (the [codecs] extra)")

wavs, torch_tts, alice, voices_dir, scripted = scripted_server_fixtures("agents")

PIPECAT_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "cedar",
    "coral",
    "echo",
    "fable",
    "marin",
    "nova",
    "onyx",
    "sage",
    "shimmer",
    "verse",
)


def mp3_samples(data: bytes) -> int:
    with av.open(io.BytesIO(data)) as container:
        return sum(frame.samples for frame in container.decode(audio=0))


async def livekit_synthesize(
    base_url: str,
    text: str,
    voice: str,
    model: str = "cosyvoice2",
    read_timeout_s: float = 30.0,
    on_audio=None,
) -> dict:
    """LiveKit's ``ChunkedStream._run``, its request and its parsing, with its clients and timeouts."""
    client = openai.AsyncClient(
        max_retries=0,
        api_key="sk-livekit",
        base_url=base_url,
        http_client=httpx2.AsyncClient(
            timeout=httpx2.Timeout(connect=15.0, read=5.0, write=5.0, pool=5.0),
            follow_redirects=True,
            limits=httpx2.Limits(max_connections=50, max_keepalive_connections=50, keepalive_expiry=120),
        ),
    )
    audio = bytearray()
    usage: dict = {}
    try:
        async with client.audio.speech.with_streaming_response.create(
            input=text,
            model=model,
            voice=voice,
            response_format="mp3",
            speed=1.0,
            instructions=openai.omit,
            stream_format="audio" if model in ("tts-1", "tts-1-hd") else "sse",
            timeout=httpx2.Timeout(read_timeout_s, connect=10.0),
        ) as stream:
            media_type = stream.headers.get("content-type", "").split(";")[0].strip().lower()
            request_id = stream.request_id
            if media_type != "text/event-stream":
                async for chunk in stream.iter_bytes():
                    audio += chunk
                    if on_audio is not None:
                        on_audio()
            else:
                async for line in stream.iter_lines():
                    if not line or not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if event.get("type") == "speech.audio.delta":
                        audio += base64.b64decode(event.get("delta", "") or event.get("audio", ""))
                        if on_audio is not None:
                            on_audio()
                    elif event.get("type") == "speech.audio.done":
                        usage = event.get("usage", {})
    finally:
        await client.close()
    return {"media_type": media_type, "request_id": request_id, "audio": bytes(audio), "usage": usage}


async def pipecat_run_tts(
    base_url: str, text: str, voice: str, speed: float | None = None, on_audio=None
) -> bytes:
    """Pipecat's ``OpenAITTSService.run_tts``: the voice check, the request and the PCM reading."""
    if voice not in PIPECAT_VOICES:
        raise ValueError(f"OpenAI TTS voice {voice!r} is not supported")
    client = openai.AsyncOpenAI(api_key="sk-pipecat", base_url=base_url)
    params = {"input": text, "model": "gpt-4o-mini-tts", "voice": voice, "response_format": "pcm"}
    if speed:
        params["speed"] = speed
    pcm = bytearray()
    try:
        async with client.audio.speech.with_streaming_response.create(**params) as response:
            assert response.status_code == 200
            async for chunk in response.iter_bytes(4800):  # pipecat's chunk_size at 24 kHz
                if chunk:
                    pcm += chunk
                    if on_audio is not None:
                        on_audio()
    finally:
        await client.close()
    return bytes(pcm)


def test_livekit_defaults_get_streamed_mp3_in_events(torch_tts, voices_dir):
    """model other than tts-1 (so stream_format sse), mp3: the first audio arrives while the engine still
    holds its last chunk, and the events decode to the whole answer."""
    holding = HoldsLastChunk(torch_tts, chunks=8)
    with running_server(holding, voices_dir, warmup=False) as url:
        wait_ready(url)
        answer = asyncio.run(
            livekit_synthesize(url + "/v1", "Hello there.", "alice", on_audio=holding.client_had_audio.set)
        )
    assert holding.held == [True], "no audio reached LiveKit before the synthesis ended"
    assert answer["media_type"] == "text/event-stream" and answer["request_id"]
    assert answer["usage"]["input_tokens"] > 0
    samples = mp3_samples(answer["audio"])
    assert 8 * SAMPLE_RATE // 10 <= samples <= 8 * SAMPLE_RATE // 10 + 2 * 1152


def test_livekit_with_tts_1_gets_streamed_mp3_bytes(scripted, voices_dir):
    with running_server(scripted, voices_dir, warmup=False) as url:
        wait_ready(url)
        answer = asyncio.run(livekit_synthesize(url + "/v1", "Hello there.", "alice", model="tts-1"))
    assert answer["media_type"] == "audio/mpeg" and answer["request_id"]
    assert scripted.requests[-1]["config"].stream  # the engine streamed
    assert 3 * SAMPLE_RATE // 10 <= mp3_samples(answer["audio"]) <= 3 * SAMPLE_RATE // 10 + 2 * 1152


def test_a_long_livekit_answer_beats_its_read_timeout(torch_tts, voices_dir):
    """LiveKit's 30 s read timeout against a long answer, scaled down: chunks every 0.25 s for 6 s under a
    2 s read timeout. Streamed, every read gets bytes in time; the same answer as one complete file (what
    mp3 was before) times out, which shows the check can fail."""
    slow = RecordingTTS(torch_tts, scripted_chunks=24, delay_s=0.25)
    with running_server(slow, voices_dir, warmup=False) as url:
        wait_ready(url)
        answer = asyncio.run(livekit_synthesize(url + "/v1", "Hello there.", "alice", read_timeout_s=2.0))
        assert 24 * SAMPLE_RATE // 10 <= mp3_samples(answer["audio"])
        with pytest.raises(httpx.ReadTimeout):
            body = {"model": "tts-1", "input": "Hello there.", "voice": "alice", "stream": False}
            httpx.post(url + SPEECH, json=body, timeout=httpx.Timeout(2.0, connect=10.0))


def test_pipecat_with_an_openai_voice_name_gets_streamed_pcm(torch_tts, voices_dir):
    holding = HoldsLastChunk(torch_tts, chunks=8)
    with running_server(holding, voices_dir, warmup=False, default_voice="alice") as url:
        wait_ready(url)
        pcm = asyncio.run(
            pipecat_run_tts(url + "/v1", "Hello there.", "alloy", on_audio=holding.client_had_audio.set)
        )
    assert holding.held == [True], "no audio reached Pipecat before the synthesis ended"
    expected = np.full(8 * SAMPLE_RATE // 10, round(0.1 * 32767), np.int16)  # the script's samples
    np.testing.assert_array_equal(np.frombuffer(pcm, "<i2"), expected)


def test_pipecat_speed_and_an_unmapped_voice(scripted, voices_dir):
    with running_server(scripted, voices_dir, warmup=False) as url:
        wait_ready(url)
        with pytest.raises(openai.NotFoundError, match="--default-voice"):
            asyncio.run(pipecat_run_tts(url + "/v1", "Hello there.", "alloy"))
    with running_server(scripted, voices_dir, warmup=False, voice_aliases={"nova": "alice"}) as url:
        wait_ready(url)
        pcm = asyncio.run(pipecat_run_tts(url + "/v1", "Hello there.", "nova", speed=1.2))
    assert len(pcm) == 2 * 3 * SAMPLE_RATE // 10
    assert scripted.requests[-1]["config"].speed == 1.2


# ----------------------------------------------------------------------------- the real LiveKit plugin
# livekit-plugins-openai installs beside the test extras without changing any of their packages, so [test]
# has it and the plugin itself is driven here. Pipecat is not: pipecat-ai 1.14 pins soundfile~=0.13.1 and
# soxr~=1.0.0, older than the ones trt-cosy's extras install; its request is replayed above, and
# examples/agents/pipecat_tts.py drives it in its own environment.


async def livekit_plugin_synthesize(base_url: str, text: str, voice: str, on_audio=None) -> dict:
    """``openai.TTS(...).synthesize(text)`` of livekit-plugins-openai with its defaults (mp3, and
    ``stream_format: "sse"`` for a model other than tts-1), as an agent calls it."""
    plugin = pytest.importorskip(
        "livekit.plugins.openai",
        reason="LiveKit's OpenAI plugin (livekit-plugins-openai, in the [test] extra)",
    )
    tts = plugin.TTS(base_url=base_url, api_key="sk-livekit", model="cosyvoice2", voice=voice)
    samples, request_ids, rates = 0, set(), set()
    try:
        async for event in tts.synthesize(text):
            samples += event.frame.samples_per_channel
            request_ids.add(event.request_id)
            rates.add(event.frame.sample_rate)
            if on_audio is not None:
                on_audio()
    finally:
        await tts.aclose()
    return {"samples": samples, "request_ids": request_ids, "rates": rates}


def test_the_livekit_plugin_with_its_defaults_hears_audio_before_the_synthesis_ends(torch_tts, voices_dir):
    holding = HoldsLastChunk(torch_tts, chunks=8)
    with running_server(holding, voices_dir, warmup=False) as url:
        wait_ready(url)
        heard = asyncio.run(
            livekit_plugin_synthesize(
                url + "/v1", "Hello there.", "alice", on_audio=holding.client_had_audio.set
            )
        )
    assert holding.held == [True], "no audio reached the LiveKit plugin before the synthesis ended"
    assert holding.requests[0]["config"].stream  # the engine streamed (sse, mp3)
    assert (
        heard["rates"] == {SAMPLE_RATE} and len(heard["request_ids"]) == 1 and "" not in heard["request_ids"]
    )
    # decoded by LiveKit's own mp3 decoder: the script's 0.8 s, give or take LAME's delay and last frame
    assert 8 * SAMPLE_RATE // 10 - 2 * 1152 <= heard["samples"] <= 8 * SAMPLE_RATE // 10 + 2 * 1152, heard


def test_a_long_answer_reaches_the_livekit_plugin_whole(torch_tts, voices_dir):
    """A long answer (60 chunks, one every 0.1 s) through the plugin's mp3 events, unchanged timeouts: all
    of it arrives, once (the plugin retries on a timeout, which would synthesise it again)."""
    slow = RecordingTTS(torch_tts, scripted_chunks=60, delay_s=0.1)
    with running_server(slow, voices_dir, warmup=False) as url:
        wait_ready(url)
        heard = asyncio.run(livekit_plugin_synthesize(url + "/v1", "Hello there. " * 16, "alice"))
    assert len(slow.requests) == 1 and slow.requests[0]["finished"]
    assert 6 * SAMPLE_RATE - 2 * 1152 <= heard["samples"] <= 6 * SAMPLE_RATE + 2 * 1152, heard
