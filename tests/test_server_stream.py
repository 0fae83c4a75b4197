"""``WS /v1/audio/speech/stream`` (text in while audio comes out) against a real uvicorn on 127.0.0.1,
driven by a real client library (``websockets``): pieces of 3-5 words every 150 ms get audio back
before the last piece is sent, then the done message with counts; bad messages get a clean close code
and message; the key, the concurrency slots (429) and a client that leaves behave as on the HTTP
routes, and the server keeps serving the others. The engine is the tiny CosyVoice2 on ONNX Runtime."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
from _server_support import running_server, wait_ready  # noqa: F401  (skips without the server extras)
from _streaming_support import load_tiny_ort, make_tiny_voice

from trt_cosy import CosyVoice

websockets = pytest.importorskip("websockets", reason="the WebSocket client (the [serve] extra)")
from websockets.exceptions import ConnectionClosed, InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

KEY = "stream-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PATH = "/v1/audio/speech/stream"
PIECES = [
    "Hello there, my friend.",
    "This sentence is written",
    "a few words at a time",
    "by a chat model that",
    "thinks while it talks,",
    "and the speech should start",
    "long before it is done.",
    "Here are some more words",
    "to keep it going for",
    "a little while longer.",
]


@pytest.fixture(scope="module")
def url(tmp_path_factory, v2_tiny_dir):
    tts = load_tiny_ort(tmp_path_factory, v2_tiny_dir)
    voices = tmp_path_factory.mktemp("stream-voices")
    make_tiny_voice(tts, tmp_path_factory).save(voices / "alice.npz")
    # The tiny random model never says eos, so a request speaks its 20 tokens per text id: 4 keeps it short.
    config = tts.model.config
    short = dataclasses.replace(config, llm=dataclasses.replace(config.llm, max_token_text_ratio=4.0))
    short_tts = CosyVoice(
        dataclasses.replace(tts.model, config=short),
        tts.tokenizer,
        tts.voice_builder,
        tts.normalizer,
        tts.engine_config,
    )
    settings = dict(
        api_key=KEY, max_concurrent=1, max_queue=0, max_input_chars=600, body_timeout_s=3.0, warmup=False
    )
    with running_server(short_tts, voices, **settings) as server_url:
        wait_ready(server_url)
        yield "ws" + server_url.removeprefix("http")


def _start(ws, voice: str = "alice", **extra) -> dict:
    ws.send(json.dumps({"type": "start", "voice": voice, "format": "pcm", "seed": 1, **extra}))
    return json.loads(ws.recv(timeout=30))


def _started_when_free(url: str, timeout_s: float = 30.0):
    """A connection whose start was accepted. The one slot may still be held by a client that just
    left (freed when the server sees it go; on a loaded machine a new client can come first and be
    refused with 4429): retry until it is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        ws = connect(url + PATH, additional_headers=AUTH, open_timeout=30)
        reply = _start(ws)
        if reply["type"] == "started":
            return ws
        ws.close()
        assert time.monotonic() < deadline, f"the slot stayed busy for {timeout_s} s: {reply}"


def _closed_with(ws) -> tuple[dict | None, int, str]:
    """(the error message, close code, close reason) once the server closes."""
    error = None
    try:
        while True:
            frame = ws.recv(timeout=60)
            if isinstance(frame, str) and json.loads(frame).get("type") == "error":
                error = json.loads(frame)["error"]
    except ConnectionClosed as closed:
        return error, closed.rcvd.code, closed.rcvd.reason


def _speak(url: str, pieces: list[str], delay: float = 0.15) -> dict:
    """Stream ``pieces`` every ``delay`` s; returns the done message, audio bytes and times."""
    with connect(url + PATH, additional_headers=AUTH, open_timeout=30) as ws:
        started = _start(ws)
        assert started == {"type": "started", "sample_rate": 24000, "format": "pcm", "voice": "alice"}
        sent: list[float] = []
        first_audio = threading.Event()
        held: list[bool] = []

        def send_text():
            for index, piece in enumerate(pieces):
                if index == len(pieces) - 1:  # waits for audio (60 s at most): no race with the load
                    held.append(first_audio.wait(60))
                ws.send(json.dumps({"type": "text", "text": piece + " "}))
                sent.append(time.monotonic())
                time.sleep(delay)
            ws.send(json.dumps({"type": "end"}))

        sender = threading.Thread(target=send_text)
        sender.start()
        audio, arrivals, done = bytearray(), [], None
        while done is None:
            frame = ws.recv(timeout=120)
            if isinstance(frame, bytes):
                audio += frame
                arrivals.append(time.monotonic())
                first_audio.set()
            else:
                done = json.loads(frame)
        sender.join(30)
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
        assert closed.value.rcvd.code == 1000
    return {"done": done, "audio": bytes(audio), "arrivals": arrivals, "sent": sent, "held": held}


def test_audio_comes_while_text_is_still_sent_then_the_counts(url):
    result = _speak(url, PIECES)
    done, audio, arrivals, sent = result["done"], result["audio"], result["arrivals"], result["sent"]
    assert done["type"] == "done"
    assert result["held"] == [True] and arrivals[0] < sent[-1]  # audio before the last piece went out
    assert done["text_pieces"] == len(PIECES) and done["text_chars"] == sum(len(p) + 1 for p in PIECES)
    assert done["chunks"] >= 2 and done["chunks"] == len(arrivals)
    assert len(audio) % 2 == 0 and done["audio_seconds"] == pytest.approx(len(audio) / 2 / 24000, abs=1e-3)
    assert 0 < done["first_audio_s"] < done["elapsed_s"]
    for key in ("longest_gap_s", "playback_stall_s", "longest_stall_s", "after_last_text_s"):
        assert done[key] >= 0


@pytest.mark.parametrize(
    "case, close_code, error_code",
    [
        ("unknown voice", 4404, "voice_not_found"),
        ("not json", 1007, "invalid_json"),
        ("binary", 1003, "binary_frame"),
        ("text after end", 4400, "text_after_end"),
        ("too much text", 4413, "input_too_long"),
        ("unknown type", 4400, "unknown_type"),
        ("sample rate", 4400, "unsupported_sample_rate"),
    ],
)
def test_bad_messages_get_a_clean_close_and_the_server_goes_on(url, case, close_code, error_code):
    with connect(url + PATH, additional_headers=AUTH, open_timeout=30) as ws:
        if case == "unknown voice":
            ws.send(json.dumps({"type": "start", "voice": "nobody"}))
        elif case == "not json":
            ws.send("hello")
        elif case == "binary":
            _start(ws)
            ws.send(b"\x00\x01")
        elif case == "text after end":
            _start(ws)
            ws.send(json.dumps({"type": "text", "text": PIECES[0]}))
            ws.send(json.dumps({"type": "end"}))
            ws.send(json.dumps({"type": "text", "text": "one more"}))
        elif case == "too much text":
            _start(ws)
            ws.send(json.dumps({"type": "text", "text": "word " * 200}))
        elif case == "unknown type":
            _start(ws)
            ws.send(json.dumps({"type": "speak", "text": "hi"}))
        else:
            ws.send(json.dumps({"type": "start", "voice": "alice", "sample_rate": 16000}))
        error, code, reason = _closed_with(ws)
    assert code == close_code, (code, reason, error)
    assert error is not None and error["code"] == error_code and error["message"] and reason
    # the slot is free again and others are served
    with connect(url + PATH, additional_headers=AUTH, open_timeout=30) as ws:
        assert _start(ws)["type"] == "started"
        ws.send(json.dumps({"type": "text", "text": "Hi there."}))
        ws.send(json.dumps({"type": "end"}))
        frames = []
        while not (frames and isinstance(frames[-1], str)):
            frames.append(ws.recv(timeout=120))
        assert json.loads(frames[-1])["type"] == "done" and any(isinstance(f, bytes) for f in frames)


def test_the_key_the_slots_and_a_client_that_leaves(url):
    with pytest.raises(InvalidStatus) as refused:
        with connect(url + PATH, open_timeout=30):
            pass
    assert refused.value.response.status_code == 403  # closed before the handshake: no key
    with connect(url + PATH, subprotocols=[f"bearer.{KEY}"], open_timeout=30) as browser_like:
        assert browser_like.subprotocol == f"bearer.{KEY}"  # a browser's key, echoed as it must be
        assert _start(browser_like)["type"] == "started"
    with pytest.raises(InvalidStatus):
        with connect(url + PATH, subprotocols=["bearer.wrong"], open_timeout=30):
            pass
    with _started_when_free(url) as first:  # holds the only slot (max_concurrent 1, no queue)
        with connect(url + PATH, additional_headers=AUTH, open_timeout=30) as second:
            second.send(json.dumps({"type": "start", "voice": "alice"}))
            error, code, _ = _closed_with(second)
        assert code == 4429 and error["code"] == "server_overloaded"
        first.send(json.dumps({"type": "text", "text": PIECES[0]}))
    # the first client left mid-stream: its slot is freed
    _started_when_free(url).close()


def test_a_silent_client_is_closed_after_the_idle_timeout(url):
    with _started_when_free(url) as ws:  # the test before's last client may still hold the slot
        error, code, _ = _closed_with(ws)  # sends nothing for body_timeout_s (3 s)
    assert code == 4408 and error["code"] == "idle_timeout"
