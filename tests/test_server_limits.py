"""The HTTP server's limits and errors on real uvicorn (loopback), with scripted synthesis.

The engine is the tiny torch reference (fast to load) whose input checks and voice making are
real; synthesis yields scripted chunks whose pace the test controls (``RecordingTTS``), so
overload, timeouts and disconnects are deterministic.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest
import soundfile

httpx = pytest.importorskip("httpx")

from _server_support import (  # noqa: E402  (skips this module without the server extras)
    GOOD,
    SPEECH,
    assert_error,
    metric_value,
    running_server,
    scripted_server_fixtures,
    serve_without_serving,
    upload_voice,
    wait_ready,
)

from trt_cosy.frontend.voice import Voice  # noqa: E402

wavs, torch_tts, alice, voices_dir, scripted = scripted_server_fixtures("limits")


def _gauge(url: str, name: str) -> float:
    return metric_value(httpx.get(url + "/metrics").text, name)


def _post_in_thread(url: str, body: dict) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(httpx.post(url, json=body, timeout=30)), daemon=True)
    thread.start()
    return thread, out


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# ----------------------------------------------------------------------------- bad input


BAD_BODIES = [
    ("malformed json", b'{"input": "Hi", "voice": ', 400, "invalid_request"),
    ("not an object", b'["Hi", "alice"]', 400, "invalid_request"),
    ("input not a string", json.dumps({**GOOD, "input": 5}).encode(), 400, "invalid_request"),
    ("voice not a string", json.dumps({**GOOD, "voice": ["alice"]}).encode(), 400, "invalid_request"),
    ("stream not a bool", json.dumps({**GOOD, "stream": "yes"}).encode(), 400, "invalid_request"),
    ("speed not a number", json.dumps({**GOOD, "speed": "fast"}).encode(), 400, "invalid_request"),
    ("seed negative", json.dumps({**GOOD, "seed": -1}).encode(), 400, "invalid_request"),
    ("missing input", json.dumps({"model": "tts-1", "voice": "alice"}).encode(), 400, "invalid_request"),
    ("unknown field", json.dumps({**GOOD, "pitch": 2}).encode(), 400, "invalid_request"),
    ("empty input", json.dumps({**GOOD, "input": "   "}).encode(), 400, "invalid_input"),
    ("punctuation only", json.dumps({**GOOD, "input": "?!..."}).encode(), 400, "invalid_input"),
    ("huge input", json.dumps({**GOOD, "input": "word " * 1000}).encode(), 400, "input_too_long"),
    ("unknown voice", json.dumps({**GOOD, "voice": "nobody"}).encode(), 404, "voice_not_found"),
    ("unknown format", json.dumps({**GOOD, "response_format": "vorbis"}).encode(), 400, "unsupported_format"),
    ("speed out of range", json.dumps({**GOOD, "speed": 9.0}).encode(), 400, "invalid_speed"),
    ("unknown stream_format", json.dumps({**GOOD, "stream_format": "ws"}).encode(), 400, "invalid_request"),
    ("long instructions", json.dumps({**GOOD, "instructions": "x" * 1001}).encode(), 400, "instructions_too_long"),
    ("body too large", json.dumps({**GOOD, "input": "a" * 300_000}).encode(), 413, "body_too_large"),
]


def test_bad_requests_get_a_json_4xx_and_the_server_stays_up(scripted, voices_dir):
    with running_server(scripted, voices_dir, max_input_chars=2000) as url:
        wait_ready(url)
        for label, body, status, code in BAD_BODIES:
            response = httpx.post(url + SPEECH, content=body, headers={"Content-Type": "application/json"})
            error = assert_error(response, status, code)
            assert label and error["type"] == "invalid_request_error", (label, error)
        no_type = httpx.post(url + SPEECH, content=json.dumps(GOOD).encode())  # curl -d without -H
        assert "Content-Type: application/json" in assert_error(no_type, 400)["message"]
        assert_error(httpx.post(url + "/tts", json={"text": "Hi.", "voice": 3}), 400, "invalid_request")
        assert_error(httpx.get(url + SPEECH), 405)
        assert_error(httpx.get(url + "/v2/nothing"), 404, "not_found")
        assert httpx.post(url + SPEECH, json=GOOD).status_code == 200
        metrics = httpx.get(url + "/metrics").text
    assert scripted.requests and all(record["closed"] for record in scripted.requests)
    assert (
        metric_value(metrics, "trt_cosy_http_errors_total", path="/v1/audio/speech", code="invalid_request")
        == 11  # 10 in BAD_BODIES and the one without a content type
    )
    assert metric_value(metrics, "trt_cosy_http_requests_total", path="/v1/audio/speech", status="200") == 1


def test_chunked_body_over_the_limit_is_refused_while_it_arrives(scripted, voices_dir):
    with running_server(scripted, voices_dir, max_json_bytes=1000) as url:
        wait_ready(url)

        def body():
            yield b'{"input": "'
            for _ in range(100):
                yield b"a" * 100
            yield b'", "voice": "alice"}'

        response = httpx.post(url + SPEECH, content=body(), headers={"Content-Type": "application/json"})
        assert_error(response, 413, "body_too_large")


def test_health_and_requests_wait_for_warm_up(scripted, voices_dir):
    scripted.gate.clear()  # the warm-up synthesis blocks until the gate opens
    with running_server(scripted, voices_dir) as url:
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "warming_up", health.text
        not_ready = httpx.post(url + SPEECH, json=GOOD)
        assert_error(not_ready, 503, "not_ready")
        assert health.headers["retry-after"] == not_ready.headers["retry-after"] == "5"
        assert _gauge(url, "trt_cosy_ready") == 0
        scripted.gate.set()
        wait_ready(url)
        assert httpx.get(url + "/health").json()["status"] == "ok"
        assert _gauge(url, "trt_cosy_ready") == 1


# ----------------------------------------------------------------------------- load


def test_overload_is_answered_429_at_once_and_queued_requests_complete(scripted, voices_dir):
    with running_server(scripted, voices_dir, max_concurrent=1, max_queue=1) as url:
        wait_ready(url)
        scripted.gate.clear()
        running, running_out = _post_in_thread(url + SPEECH, GOOD)
        _wait_for(lambda: _gauge(url, "trt_cosy_active_requests") == 1)
        queued, queued_out = _post_in_thread(url + SPEECH, GOOD)
        _wait_for(lambda: _gauge(url, "trt_cosy_queue_depth") == 1)
        started = time.perf_counter()
        refused = httpx.post(url + SPEECH, json=GOOD, timeout=5)
        assert time.perf_counter() - started < 2.0
        assert_error(refused, 429, "server_overloaded")
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.headers["retry-after"] == "2"
        scripted.gate.set()
        running.join(30)
        queued.join(30)
        assert running_out[0].status_code == queued_out[0].status_code == 200
        assert httpx.post(url + SPEECH, json=GOOD).status_code == 200


def test_queue_wait_and_synthesis_are_bounded_by_the_request_timeout(scripted, voices_dir):
    with running_server(scripted, voices_dir, max_concurrent=1, request_timeout_s=0.5) as url:
        wait_ready(url)
        scripted.gate.clear()
        # Not streamed: the 504 is the answer (a stream that began with 200 would just end early).
        first, first_out = _post_in_thread(url + SPEECH, {**GOOD, "stream": False})
        _wait_for(lambda: _gauge(url, "trt_cosy_active_requests") == 1)
        queue_timeout = httpx.post(url + SPEECH, json=GOOD, timeout=10)
        assert_error(queue_timeout, 503, "queue_timeout")
        assert queue_timeout.headers["retry-after"] == "2"
        time.sleep(0.3)  # the first request's time runs out while its first chunk is blocked
        scripted.gate.set()
        first.join(30)
        assert_error(first_out[0], 504, "timeout")
        record = scripted.requests[-2]  # [-1] is the queued request's, never started
        assert record["closed"] and not record["finished"] and len(record["times"]) == 1, record


def test_client_disconnect_stops_the_synthesis(scripted, voices_dir):
    with running_server(scripted, voices_dir) as url:
        wait_ready(url)
        scripted.scripted_chunks, scripted.delay_s = 40, 0.05
        body = {**GOOD, "response_format": "pcm", "stream": True}
        with httpx.stream("POST", url + SPEECH, json=body, timeout=30) as response:
            assert response.status_code == 200
            next(response.iter_bytes())
        record = scripted.requests[-1]
        _wait_for(lambda: record["closed"])
        assert not record["finished"] and len(record["times"]) < 40, len(record["times"])
        # Non-streaming: the client gives up waiting; the server notices between chunks.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + SPEECH, json={**GOOD, "response_format": "wav", "stream": False}, timeout=0.5)
        record = scripted.requests[-1]
        _wait_for(lambda: record["closed"])
        assert not record["finished"] and len(record["times"]) < 40, len(record["times"])
        metrics = httpx.get(url + "/metrics").text
        assert metric_value(metrics, "trt_cosy_syntheses_cancelled_total", reason="disconnect") == 2
        assert metric_value(metrics, "trt_cosy_active_requests") == 0
        scripted.scripted_chunks, scripted.delay_s = 3, 0.0
        assert httpx.post(url + SPEECH, json=GOOD).status_code == 200  # the slot was given back


def test_raw_socket_hangup_mid_stream_frees_the_slot(scripted, voices_dir):
    with running_server(scripted, voices_dir, max_concurrent=1, max_queue=0) as url:
        wait_ready(url)
        scripted.scripted_chunks, scripted.delay_s = 40, 0.05
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({**GOOD, "response_format": "wav", "stream": True}).encode()
        head = f"POST {SPEECH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        with socket.create_connection((host, int(port)), timeout=10) as client:
            client.sendall(head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            assert client.recv(64).startswith(b"HTTP/1.1 200")
        record = scripted.requests[-1]
        _wait_for(lambda: record["closed"])
        assert not record["finished"]
        scripted.scripted_chunks, scripted.delay_s = 3, 0.0
        assert httpx.post(url + SPEECH, json=GOOD).status_code == 200


# ----------------------------------------------------------------------------- voices


def test_voice_uploads_are_validated(scripted, voices_dir, wavs, tmp_path_factory):
    folder = tmp_path_factory.mktemp("uploads")
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, 20 * 16000).astype(np.float32)  # noise: [320000]
    paths = {name: folder / f"{name}.wav" for name in ("long", "big", "huge")}
    soundfile.write(paths["long"], noise[: 3 * 16000], 16000)  # 3 s, 96 KB
    soundfile.write(paths["big"], noise[: 8 * 16000], 16000)  # 256 KB: over the file limit
    soundfile.write(paths["huge"], noise, 16000)  # 640 KB: over the body limit
    with running_server(scripted, voices_dir, max_upload_bytes=200_000, max_upload_seconds=2.5) as url:
        wait_ready(url)
        long = assert_error(upload_voice(url, "long", paths["long"]), 400, "audio_too_long")
        assert "at most 2.5 s" in long["message"], long
        assert_error(upload_voice(url, "big", paths["big"]), 413, "file_too_large")
        assert_error(upload_voice(url, "huge", paths["huge"]), 413, "body_too_large")
        assert_error(upload_voice(url, "junk", wavs["unreadable"]), 400, "invalid_audio")
        assert_error(upload_voice(url, "short", wavs["short"]), 400, "invalid_audio")
        assert_error(upload_voice(url, "silent", wavs["silent"]), 400, "invalid_audio")
        for name in ("../escape", ".hidden", "a b", "x" * 65, "", "ünï"):
            assert_error(upload_voice(url, name, wavs["ref"]), 400), name
        assert_error(httpx.post(url + "/v1/voices", data={"name": "nofile"}), 400, "invalid_request")
        assert_error(upload_voice(url, "alice", wavs["ref"]), 409, "voice_exists")
        replaced = upload_voice(url, "alice", wavs["ref"], text=None, query="?overwrite=true")
        assert replaced.status_code == 201 and replaced.json()["mode"] == "cross-lingual", replaced.text
        assert_error(httpx.delete(url + "/v1/voices/..%2Falice"), 404)
        assert_error(httpx.delete(url + "/v1/voices/nobody"), 404, "voice_not_found")
        assert httpx.get(url + "/v1/voices/alice").json()["mode"] == "cross-lingual"
        assert httpx.delete(url + "/v1/voices/alice").json()["deleted"] is True
        assert_error(httpx.post(url + SPEECH, json=GOOD), 404, "voice_not_found")
        assert httpx.get(url + "/v1/voices").json() == {"object": "list", "data": []}
    assert sorted(voices_dir.iterdir()) == []  # no temp files, no staging folders


def test_corrupt_and_foreign_voice_files_are_skipped_at_start(scripted, voices_dir, alice, caplog):
    (voices_dir / "broken.npz").write_bytes(b"not a zip")
    (voices_dir / "notes.txt").write_text("hello", encoding="utf-8")
    foreign = Voice(
        **{**{key: getattr(alice, key) for key in alice.__dataclass_fields__}, "model_id": "v2-other"}
    )
    foreign.save(voices_dir / "foreign.npz")
    (voices_dir / ".staging-crash").mkdir()  # left by a crash in the middle of an upload
    with caplog.at_level("WARNING"), running_server(scripted, voices_dir) as url:
        wait_ready(url)
        assert [voice["id"] for voice in httpx.get(url + "/v1/voices").json()["data"]] == ["alice"]
    assert "skipping voice file" in caplog.text and "made for model v2-other" in caplog.text
    assert not (voices_dir / ".staging-crash").exists()


def test_metrics_are_valid_prometheus_text(scripted, voices_dir):
    with running_server(scripted, voices_dir) as url:
        wait_ready(url)
        assert (
            httpx.post(url + SPEECH, json={**GOOD, "response_format": "pcm", "stream": True}).status_code
            == 200
        )
        response = httpx.get(url + "/metrics")
        openmetrics = httpx.get(url + "/metrics", headers={"Accept": "application/openmetrics-text"})
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    assert metric_value(text, "trt_cosy_http_requests_total", path="/v1/audio/speech", status="200") == 1
    assert metric_value(text, "trt_cosy_http_request_duration_seconds_count", path="/v1/audio/speech") == 1
    assert metric_value(text, "trt_cosy_time_to_first_audio_seconds_count") == 1
    assert metric_value(text, "trt_cosy_rtf_count") == 1
    assert metric_value(text, "trt_cosy_queue_depth") == metric_value(text, "trt_cosy_active_requests") == 0
    assert metric_value(text, "trt_cosy_audio_seconds_total") == pytest.approx(0.3)  # 3 scripted 0.1 s chunks
    assert metric_value(text, "trt_cosy_ready") == 1
    from prometheus_client import parser

    families = {family.name: family for family in parser.text_string_to_metric_families(text)}
    assert families["trt_cosy_http_request_duration_seconds"].type == "histogram"
    assert families["trt_cosy_time_to_first_audio_seconds"].type == "histogram"
    assert families["trt_cosy_http_requests"].type == "counter"
    assert families["trt_cosy_http_errors"].type == "counter"
    # A scraper that asks for OpenMetrics gets it (content negotiation by the library).
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert openmetrics.text.rstrip().endswith("# EOF")


def test_serve_command_binds_loopback_with_the_given_limits(torch_tts, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from trt_cosy.cli import main

    served = serve_without_serving(monkeypatch, torch_tts, tmp_path / "cache")
    result = CliRunner().invoke(
        main, ["serve", "--engines", str(tmp_path), "--max-queue", "3", "--max-segment-tokens", "50"]
    )
    assert result.exit_code == 0, result.output
    tts, settings = served[0]
    assert (
        tts is torch_tts and settings.host == "127.0.0.1" and settings.port == 8000 and settings.is_loopback
    )
    assert (
        settings.max_queue == 3 and settings.max_segment_tokens == 50 and settings.voices_dir == tmp_path / "cache" / "voices" / torch_tts.model_id
    )
    missing = CliRunner().invoke(main, ["serve", "--engines", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
