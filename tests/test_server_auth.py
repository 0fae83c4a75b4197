"""The server's API key (``--api-key`` / ``TRT_COSY_API_KEY``) and its access log, on real uvicorn (loopback).

Synthesis is scripted (``RecordingTTS`` over the tiny torch reference, as in tests/test_server_limits.py):
what is under test is who gets in and what is logged, not the audio.
"""

from __future__ import annotations

import logging
import re

import pytest

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
from fastapi import WebSocket  # noqa: E402  (module level: FastAPI resolves the string annotations here)

from trt_cosy.errors import InputError  # noqa: E402
from trt_cosy.server import ServerSettings  # noqa: E402

KEY = "tc-7Hq2_secret-key"
WITH_KEY = {"Authorization": f"Bearer {KEY}"}
ACCESS_LOGGER = "trt_cosy.server.access_log"

# Every route the app has (and one it has not): all need the key.
GUARDED = [
    ("GET", "/v1/models", None),
    ("GET", "/v1/voices", None),
    ("GET", "/v1/voices/alice", None),
    ("DELETE", "/v1/voices/alice", None),
    ("POST", "/v1/voices", None),
    ("POST", SPEECH, GOOD),
    ("POST", "/tts", {"text": "Hi.", "voice": "alice"}),
    ("GET", "/metrics", None),
    ("GET", "/docs", None),
    ("GET", "/openapi.json", None),
    ("GET", "/no/such/route", None),
    ("HEAD", "/v1/voices", None),
    ("PUT", "/health", None),
]


wavs, torch_tts, alice, voices_dir, scripted = scripted_server_fixtures("auth")


def _request(url: str, method: str, path: str, body: dict | None, headers: dict | None = None):
    return httpx.request(method, url + path, json=body, headers=headers or {}, timeout=30)


def _assert_refused(response, code: str) -> None:
    if response.request.method == "HEAD":  # no body to read
        assert response.status_code == 401, response.status_code
    else:
        assert_error(response, 401, code)
    assert response.headers["www-authenticate"].startswith('Bearer realm="trt-cosy"'), response.headers


def test_api_key_guards_every_route_but_health_and_the_page(scripted, voices_dir):
    with running_server(scripted, voices_dir, api_key=KEY, max_json_bytes=1000) as url:
        wait_ready(url)
        assert httpx.get(url + "/health").status_code == 200  # open: load balancers probe it
        page = httpx.get(url + "/")
        assert page.status_code == 200 and "<title>trt-cosy playground</title>" in page.text
        for method, path, body in GUARDED:
            _assert_refused(_request(url, method, path, body), "missing_api_key")
            wrong = _request(url, method, path, body, {"Authorization": "Bearer not-the-key"})
            _assert_refused(wrong, "invalid_api_key")
            assert 'error="invalid_token"' in wrong.headers["www-authenticate"]
            _assert_refused(_request(url, method, path, body, {"Authorization": KEY}), "invalid_api_key")
            basic = {"Authorization": "Basic dXNlcjpwYXNz"}
            _assert_refused(_request(url, method, path, body, basic), "invalid_api_key")
        missing = assert_error(httpx.get(url + "/v1/models"), 401)["message"]
        assert "Authorization: Bearer <key>" in missing and "--api-key" in missing, missing
        # The key is checked before the body is read: a stranger's large body gets 401, not 413.
        big = {**GOOD, "input": "a" * 5000}
        assert_error(httpx.post(url + SPEECH, json=big), 401, "missing_api_key")
        assert_error(httpx.post(url + SPEECH, json=big, headers=WITH_KEY), 413, "body_too_large")
        # With the key everything works, and the refused DELETEs removed nothing.
        assert [voice["id"] for voice in httpx.get(url + "/v1/voices", headers=WITH_KEY).json()["data"]] == [
            "alice"
        ]
        lowercase = {"Authorization": f"bearer {KEY}"}  # the scheme is case-insensitive (RFC 9110)
        assert httpx.post(url + SPEECH, json=GOOD, headers=lowercase).status_code == 200
        assert httpx.get(url + "/docs", headers=WITH_KEY).status_code == 200
        metrics = httpx.get(url + "/metrics", headers=WITH_KEY).text
    refused = metric_value(
        metrics, "trt_cosy_http_errors_total", path="/v1/audio/speech", code="missing_api_key"
    )
    assert refused == 2  # GUARDED's speech request and the large body
    assert metric_value(metrics, "trt_cosy_http_requests_total", path="/v1/audio/speech", status="401") == 5


def test_the_key_is_compared_in_constant_time(scripted, voices_dir, monkeypatch):
    from trt_cosy.server import auth

    compared: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def spy(left, right):
        compared.append((left, right))
        return real(left, right)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    with running_server(scripted, voices_dir, api_key=KEY) as url:
        wait_ready(url)
        assert httpx.get(url + "/v1/models", headers=WITH_KEY).status_code == 200
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer x"}).status_code == 401
    # Both calls compared fixed-length digests (no length leak), never the raw key.
    assert len(compared) == 2 and all(len(left) == len(right) == 32 for left, right in compared)
    assert all(KEY.encode() not in (left, right) for left, right in compared)


def test_openai_client_sends_the_key(scripted, voices_dir, wavs):
    openai = pytest.importorskip("openai")
    with running_server(scripted, voices_dir, api_key=KEY) as url:
        wait_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
        assert [model.id for model in client.models.list().data] == ["cosyvoice2"]
        speech = client.audio.speech.create(model="tts-1", voice="alice", input="Hi.", response_format="pcm")
        assert len(speech.content) == 3 * 2400 * 2  # three scripted 0.1 s chunks of 16-bit samples
        # Voice uploads (multipart, outside the OpenAI client) send the same header.
        created = upload_voice(url, "bob", wavs["ref"], query="", text=None)
        assert_error(created, 401, "missing_api_key")
        with open(wavs["ref"], "rb") as stream:
            created = httpx.post(
                url + "/v1/voices",
                files={"file": ("ref.wav", stream, "audio/wav")},
                data={"name": "bob"},
                headers=WITH_KEY,
                timeout=60,
            )
        assert created.status_code == 201, created.text
        stranger = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError, match="the API key is not the server's"):
            stranger.audio.speech.create(model="tts-1", voice="alice", input="Hi.")
        with pytest.raises(openai.AuthenticationError) as refused:
            stranger.models.list()
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_settings_check_the_key_and_keep_it_out_of_repr(tmp_path):
    for bad in ("", "two words", "tab\there", "ключ", 42):
        with pytest.raises(InputError, match="api_key must be"):
            ServerSettings(voices_dir=tmp_path, api_key=bad)
    settings = ServerSettings(voices_dir=tmp_path, api_key=KEY)
    assert settings.api_key == KEY and KEY not in repr(settings)


def test_serve_takes_the_key_from_the_option_or_the_environment(torch_tts, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from trt_cosy.cli import main

    served = serve_without_serving(monkeypatch, torch_tts, tmp_path / "cache")
    monkeypatch.delenv("TRT_COSY_API_KEY", raising=False)
    base = ["serve", "--engines", str(tmp_path)]
    results = [CliRunner().invoke(main, base)]
    results.append(CliRunner().invoke(main, [*base, "--api-key", KEY]))
    monkeypatch.setenv("TRT_COSY_API_KEY", "from-the-environment")
    results.append(CliRunner().invoke(main, base))
    results.append(CliRunner().invoke(main, [*base, "--api-key", "the-option-wins"]))
    assert all(result.exit_code == 0 for result in results), [result.output for result in results]
    assert [settings.api_key for _, settings in served] == [None, KEY, "from-the-environment", "the-option-wins"]
    assert "playground: http://127.0.0.1:8000/" in results[0].output
    assert "TRT_COSY_API_KEY" in CliRunner().invoke(main, ["serve", "--help"]).output


@pytest.mark.parametrize(
    ("host", "api_key", "warned"),
    [("0.0.0.0", None, True), ("0.0.0.0", KEY, False), ("127.0.0.1", None, False), ("::1", None, False)],
)
def test_binding_beyond_loopback_without_a_key_warns(
    host, api_key, warned, scripted, voices_dir, monkeypatch, caplog
):
    import uvicorn

    from trt_cosy.server import runner

    started: list = []

    class NoServer:  # run_server's uvicorn.Server, stopped before it binds anything
        def __init__(self, config):
            started.append(config)

        def run(self):
            pass

    monkeypatch.setattr(uvicorn, "Server", NoServer)
    with caplog.at_level(logging.WARNING, logger="trt_cosy.server.runner"):
        runner.run_server(scripted, ServerSettings(voices_dir=voices_dir, host=host, api_key=api_key))
    assert started and started[0].host == host
    assert ("without an API key" in caplog.text) is warned, caplog.text
    if warned:
        assert "--api-key" in caplog.text and "TRT_COSY_API_KEY" in caplog.text


def test_every_request_gets_one_access_line(scripted, voices_dir, caplog):
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER), running_server(scripted, voices_dir) as url:
        wait_ready(url)
        caplog.clear()
        streamed = httpx.post(url + SPEECH, json={**GOOD, "response_format": "pcm", "stream": True})
        missing = httpx.get(url + "/v1/voices/..%2Fescape", headers={"X-Request-Id": "client-id-7"})
        bad = httpx.post(url + SPEECH, content=b"{not json", headers={"Content-Type": "application/json"})
        health = httpx.get(url + "/health?probe=1", headers={"X-Request-Id": "bad id with spaces"})
    lines = [record.getMessage() for record in caplog.records if record.name == ACCESS_LOGGER]
    pattern = re.compile(r'^127\.0\.0\.1 "(\w+) (\S+)" (\d{3}) (\d+)B (\d+\.\d{3})s id=(\S+)$')
    parsed = [pattern.match(line) for line in lines]
    assert all(parsed) and len(parsed) == 4, lines
    assert [match.group(1, 2, 3) for match in parsed] == [
        ("POST", SPEECH, "200"),
        ("GET", "/v1/voices/..%2Fescape", "404"),  # as sent: percent-encoded
        ("POST", SPEECH, "400"),
        ("GET", "/health", "200"),
    ]
    assert int(parsed[0].group(4)) == len(streamed.content) == 3 * 2400 * 2  # counted to the last byte
    assert int(parsed[2].group(4)) == len(bad.content) and bad.json()["error"]["code"] == "invalid_request"
    assert all(float(match.group(5)) < 30 for match in parsed)
    # Every answer names its request: the client's own id when it sent a sane one, else a fresh one.
    ids = [response.headers["x-request-id"] for response in (streamed, missing, bad, health)]
    assert [match.group(6) for match in parsed] == ids
    assert ids[1] == "client-id-7" and ids[3] != "bad id with spaces" and len(set(ids)) == 4
    assert re.fullmatch(r"[0-9a-f]{32}", ids[0]) and re.fullmatch(r"[0-9a-f]{32}", ids[3])


def test_websockets_need_the_key_too(scripted, voices_dir):
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from trt_cosy.server import create_app

    app = create_app(scripted, ServerSettings(voices_dir=voices_dir, api_key=KEY, warmup=False))

    @app.websocket("/test-socket")  # the app has no websocket route yet; a future one is guarded as well
    async def echo(socket: WebSocket) -> None:
        await socket.accept()
        await socket.send_text("in")
        await socket.close()

    with TestClient(app) as client:
        with pytest.raises(WebSocketDisconnect) as refused, client.websocket_connect("/test-socket"):
            pass
        assert refused.value.code == 1008 and "API key" in refused.value.reason
        with client.websocket_connect("/test-socket", headers=WITH_KEY) as socket:
            assert socket.receive_text() == "in"
