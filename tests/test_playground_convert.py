"""The playground's voice-conversion mode (``GET /``, "Convert speech"): the page serves it, the request
it sends to ``POST /v1/audio/conversions`` works against a real server, and (with Chromium) a chosen
source file is converted and played as it streams (see test_playground.py for the browser setup); the
route's ``speed`` field (the official speed path)."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("python_multipart")
httpx = pytest.importorskip("httpx")

from _server_support import SAMPLE_RATE, running_server, wait_ready  # noqa: E402
from _support import REF_TEXT, reference_wavs, tiny_engines  # noqa: E402

from trt_cosy import CosyVoice, EngineConfig  # noqa: E402

TIMEOUT_MS = 90_000


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return reference_wavs(tmp_path_factory.mktemp("playground-convert-wavs"))


@pytest.fixture(scope="module")
def server(tmp_path_factory, v2_tiny_dir, wavs):
    """A real server on 127.0.0.1 with one stored voice ``alice``; yields its URL."""
    tts = CosyVoice.load(tiny_engines(tmp_path_factory, v2_tiny_dir), config=EngineConfig(threads=1))
    voices = tmp_path_factory.mktemp("playground-convert-voices")
    tts.voice_from_wav(wavs["ref"], REF_TEXT).save(voices / "alice.npz")
    with running_server(tts, voices, warmup=False) as url:
        wait_ready(url)
        yield url


def test_page_has_the_conversion_mode_and_its_request_works(server, wavs):
    page = httpx.get(server + "/").text
    for needed in (
        'id="mode-convert"',
        'id="convert-panel"',
        'id="source-file"',
        'id="record"',
        '"/v1/audio/conversions"',
        'form.append("response_format", "pcm")',
        'form.append("stream", "true")',
    ):
        assert needed in page, needed
    # exactly the multipart form the page sends (convert()), streamed back as 16-bit PCM
    form = {"voice": "alice", "response_format": "pcm", "stream": "true"}
    with (
        open(wavs["ref"], "rb") as source,
        httpx.stream(
            "POST",
            server + "/v1/audio/conversions",
            data=form,
            files={"file": ("recording.wav", source, "audio/wav")},
            timeout=120,
        ) as response,
    ):
        assert response.status_code == 200, response.read()
        assert response.headers["x-sample-rate"] == str(SAMPLE_RATE)
        body = b"".join(response.iter_bytes())
    assert len(body) % 2 == 0 and len(body) // 2 > SAMPLE_RATE // 2  # a 1.5 s source: over 0.5 s of audio


@pytest.mark.slow
def test_playground_converts_a_chosen_source_while_it_streams(server, wavs):
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="the browser test drives Chromium with playwright"
    )
    from test_playground import _chromium

    executable = _chromium()
    if executable is None:
        pytest.skip("no Chromium installed (apt-get install chromium, or set TRT_COSY_CHROMIUM)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable,
            args=["--disable-gpu", "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required"],
        )
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(server + "/")
        page.wait_for_function("() => document.getElementById('voice').value === 'alice'")
        assert page.is_hidden("#convert-panel")
        page.click("#mode-convert")
        assert page.is_visible("#convert-panel") and page.is_hidden("#speak-panel")
        page.click("#convert")  # nothing chosen yet: the page says what to do
        page.wait_for_selector("#error:not([hidden])")
        assert "choose or record a source" in page.text_content("#error")
        page.set_input_files("#source-file", str(wavs["ref"]))
        page.click("#convert")
        page.wait_for_function("() => window.playground.done === true")
        heard = page.evaluate("() => ({...window.playground})")
        assert heard["error"] is None and heard["sampleRate"] == SAMPLE_RATE, heard
        assert heard["samples"] > SAMPLE_RATE // 2 and heard["bytes"] == 2 * heard["samples"], heard
        assert heard["chunks"] >= 1 and heard["firstAudioMs"] <= heard["totalMs"], heard
        page.wait_for_function("() => document.getElementById('player').duration > 0")
        assert page.is_enabled("#convert") and not page.is_enabled("#convert-stop")
        browser.close()


def test_conversion_speed_stretches_the_mel_as_the_official_code(server, wavs):
    """``speed`` of ``POST /v1/audio/conversions``: official ``inference_vc(speed=)``, the mel of F frames
    stretched to int(F / speed) before the vocoder (480 samples per frame); out of range: 400."""
    lengths = {}
    for speed in (1.0, 2.0, 0.5):
        form = {
            "voice": "alice",
            "response_format": "pcm",
            "seed": "0",
            "speed": str(speed),
            "stream": "true",
        }
        with open(wavs["ref"], "rb") as source:
            response = httpx.post(
                server + "/v1/audio/conversions", data=form, files={"file": ("s.wav", source)}, timeout=120
            )
        assert response.status_code == 200, response.text
        lengths[speed] = len(response.content) // 2
    frames = lengths[1.0] // 480
    assert lengths[1.0] == frames * 480
    assert lengths[2.0] == int(frames / 2.0) * 480 and lengths[0.5] == int(frames / 0.5) * 480, lengths
    with open(wavs["ref"], "rb") as source:
        response = httpx.post(
            server + "/v1/audio/conversions",
            data={"voice": "alice", "speed": "5"},
            files={"file": ("s.wav", source)},
            timeout=60,
        )
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_speed", response.text
