"""The web playground (``GET /``) in a real headless Chromium, against a real server on 127.0.0.1.

The tiny ONNX Runtime engines synthesise real (noise-like) audio. The page is driven with playwright
over the system Chromium (Debian's ``chromium`` package; ``TRT_COSY_CHROMIUM`` names another binary):
``playwright install`` is never needed. The test skips with the reason when either is missing.

A screenshot is taken after the page has spoken: into the test's temp folder, or where
``TRT_COSY_PLAYGROUND_SCREENSHOT`` says (the README's picture)::

    TRT_COSY_PLAYGROUND_SCREENSHOT=docs/playground.png python3 -m pytest -q tests/test_playground.py
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("python_multipart")
httpx = pytest.importorskip("httpx")
sync_api = pytest.importorskip(
    "playwright.sync_api",
    reason="the browser test drives Chromium with playwright (pip install playwright; no `playwright install`)",
)

from _server_support import SAMPLE_RATE, RecordingTTS, running_server, wait_ready  # noqa: E402
from _support import REF_TEXT, reference_wavs, tiny_engines  # noqa: E402

from trt_cosy import CosyVoice, EngineConfig  # noqa: E402

KEY = "playground-key-1"
TIMEOUT_MS = 90_000  # a loaded 2-core machine: synthesis and Chromium share it


def _chromium() -> str | None:
    named = os.environ.get("TRT_COSY_CHROMIUM")
    if named:
        return named
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def wavs(tmp_path_factory) -> dict[str, Path]:
    return reference_wavs(tmp_path_factory.mktemp("playground-wavs"))


@pytest.fixture(scope="module")
def ort_tts(tmp_path_factory, v2_tiny_dir) -> CosyVoice:
    return CosyVoice.load(tiny_engines(tmp_path_factory, v2_tiny_dir), config=EngineConfig(threads=1))


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    if executable is None:
        pytest.skip("no Chromium installed (apt-get install chromium, or set TRT_COSY_CHROMIUM)")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=executable,
            args=["--disable-gpu", "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required"],
        )
        yield launched
        launched.close()


def _api_message(url: str, body: dict, headers: dict) -> str:
    """What the API itself answers to ``body``: the message the page must show word for word."""
    response = httpx.post(url + "/v1/audio/speech", json=body, headers=headers, timeout=60)
    assert response.status_code >= 400, response.status_code
    return response.json()["error"]["message"]


def _shown_error(page) -> str:
    page.wait_for_selector("#error:not([hidden])", timeout=TIMEOUT_MS)
    return page.text_content("#error")


@pytest.mark.slow
def test_playground_uploads_a_voice_streams_speech_and_shows_api_errors(browser, ort_tts, wavs, tmp_path):  # noqa: F811
    with running_server(ort_tts, tmp_path / "voices", api_key=KEY) as url:
        wait_ready(url)
        page = browser.new_page(viewport={"width": 900, "height": 1000})
        page.set_default_timeout(TIMEOUT_MS)
        requests: list[str] = []
        page.on("request", lambda request: requests.append(request.url))
        console: list[str] = []
        page.on("console", lambda message: console.append(message.text))

        # The page loads without a key; its API calls say what the server answers without one.
        page.goto(url + "/")
        assert page.title() == "trt-cosy playground"
        page.wait_for_selector("#health.ok")
        missing = httpx.get(url + "/v1/voices").json()["error"]["message"]
        assert _shown_error(page) == missing and "Authorization: Bearer" in missing

        # The key, typed in: the (empty) voice list loads.
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        # The error is cleared as the refresh starts, before its answer comes: wait for the list itself.
        page.wait_for_function(
            "() => document.getElementById('voice').textContent.startsWith('no stored voices yet')"
        )
        assert page.is_hidden("#error")

        # Upload a voice: file + transcript -> POST /v1/voices, then it is selected.
        page.fill("#upload-name", "alice")
        page.set_input_files("#upload-file", str(wavs["ref"]))
        page.fill("#upload-text", REF_TEXT)
        page.click("#upload")
        page.wait_for_function(
            "() => document.getElementById('status').textContent.startsWith('stored voice alice')"
        )
        assert page.input_value("#voice") == "alice"
        stored = httpx.get(url + "/v1/voices/alice", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert stored["mode"] == "zero-shot" and stored["prompt_text"], stored

        # Speak: the streamed PCM reaches the AudioContext chunk by chunk, then the <audio> element.
        # long enough for several streamed chunks, with flow and vocoder work between them: a browser slowed
        # by a loaded machine may read two chunks' bytes at once, but not all of them
        page.fill("#text", "Good morning, this is the playground. It speaks while it renders, one chunk at a time.")
        page.click("#speak")
        page.wait_for_function("() => window.playground.done === true")
        heard = page.evaluate("() => ({...window.playground})")
        assert heard["error"] is None, heard
        assert heard["sampleRate"] == SAMPLE_RATE
        assert heard["samples"] > SAMPLE_RATE // 2 and heard["bytes"] == 2 * heard["samples"], heard
        assert heard["chunks"] >= 2, heard  # scheduled for playback chunk by chunk as the bytes arrived,
        assert heard["firstAudioMs"] < heard["totalMs"] / 2, heard  # long before the stream ended
        assert heard["contextState"] == "running", heard
        page.wait_for_function("() => document.getElementById('player').duration > 0")
        duration = page.evaluate("() => document.getElementById('player').duration")
        assert duration == pytest.approx(heard["samples"] / SAMPLE_RATE, abs=0.01)
        assert "s of audio" in page.text_content("#stats")
        screenshot = Path(os.environ.get("TRT_COSY_PLAYGROUND_SCREENSHOT") or tmp_path / "playground.png")
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=True)
        assert screenshot.stat().st_size > 10_000

        # Bad input: empty text is refused by the API, and the page shows the API's own words.
        page.fill("#text", "")
        page.click("#speak")
        expected = _api_message(
            url,
            {"model": "tts-1", "input": "", "voice": "alice", "response_format": "pcm", "stream": True},
            {"Authorization": f"Bearer {KEY}"},
        )
        assert _shown_error(page) == expected
        assert page.evaluate("() => window.playground.error") == expected

        # The instructions box goes into the request: over-long instructions get the API's refusal.
        page.fill("#text", "Hello.")
        page.fill("#instructions", "Speak slowly. " * 80)
        page.click("#speak")
        expected = _api_message(
            url,
            {"model": "tts-1", "input": "Hello.", "voice": "alice", "response_format": "pcm", "stream": True,
             "instructions": ("Speak slowly. " * 80).strip()},
            {"Authorization": f"Bearer {KEY}"},
        )
        assert "instructions" in expected
        page.wait_for_function(  # the previous error is still shown until this answer replaces it
            "expected => document.getElementById('error').textContent === expected", arg=expected
        )
        page.fill("#instructions", "")

        # A wrong key: the voice list refresh shows the API's refusal.
        page.fill("#api-key", "not-the-key")
        page.dispatch_event("#api-key", "change")
        wrong = httpx.get(url + "/v1/voices", headers={"Authorization": "Bearer not-the-key"})
        page.wait_for_function(
            "expected => document.getElementById('error').textContent === expected",
            arg=wrong.json()["error"]["message"],
        )
        page.close()
    # Nothing but this server (and the page's own blob: audio) was asked for anything.
    assert requests and all(request.startswith((url + "/", "blob:")) for request in requests), requests
    assert not [line for line in console if "Content Security Policy" in line], console


@pytest.mark.slow
def test_playground_stop_ends_the_stream_and_the_synthesis(browser, ort_tts, wavs, tmp_path):
    voices = tmp_path / "voices"
    voices.mkdir()
    ort_tts.voice_from_wav(wavs["ref"], REF_TEXT).save(voices / "alice.npz")
    slow = RecordingTTS(ort_tts, scripted_chunks=50, delay_s=0.2)  # a 10 s stream of 0.1 s chunks
    with running_server(slow, voices, warmup=False) as url:
        wait_ready(url)
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(url + "/")
        page.wait_for_function("() => document.getElementById('voice').value === 'alice'")
        page.click("#speak")
        page.wait_for_function("() => window.playground.chunks >= 1")
        page.click("#stop")
        page.wait_for_function("() => document.getElementById('status').textContent === 'stopped'")
        record = slow.requests[-1]
        deadline = time.monotonic() + 30
        while not record["closed"]:  # the server notices the closed stream at its next chunk
            assert time.monotonic() < deadline, record
            time.sleep(0.05)
        assert not record["finished"] and len(record["times"]) < 50, len(record["times"])
        stopped = page.evaluate("() => ({...window.playground})")
        assert stopped["done"] is False and stopped["error"] is None and stopped["chunks"] >= 1, stopped
        assert page.is_enabled("#speak") and not page.is_enabled("#stop")
        page.close()
