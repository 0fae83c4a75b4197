"""The playground's "Simulate a chat model" mode in a real headless Chromium (see test_playground.py for
the browser setup): the typed paragraph goes to ``WS /v1/audio/speech/stream`` a few words every 150 ms,
with the API key as the browser's subprotocol, and the audio plays as it arrives, before the text ends."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("websockets", reason="uvicorn serves WebSockets with the websockets package")
sync_api = pytest.importorskip(
    "playwright.sync_api",
    reason="the browser test drives Chromium with playwright (pip install playwright; no `playwright install`)",
)

from _server_support import SAMPLE_RATE, running_server, wait_ready  # noqa: E402
from _streaming_support import load_tiny_ort, make_tiny_voice  # noqa: E402
from test_playground import TIMEOUT_MS, browser  # noqa: E402,F401  (the module's Chromium fixture)

from trt_cosy import CosyVoice  # noqa: E402

KEY = "chat-key-1"
PARAGRAPH = (
    "A chat model writes its answer a few words at a time, and the speech starts long before "
    "the answer is complete, so the listener hears it almost at once."
)


@pytest.mark.slow
def test_simulate_a_chat_model_speaks_while_the_text_arrives(browser, tmp_path_factory, v2_tiny_dir):  # noqa: F811
    tts = load_tiny_ort(tmp_path_factory, v2_tiny_dir)
    voices = tmp_path_factory.mktemp("chat-voices")
    make_tiny_voice(tts, tmp_path_factory).save(voices / "alice.npz")
    config = tts.model.config  # the tiny random model never says eos: 4 speech tokens per text id at most
    short = dataclasses.replace(config, llm=dataclasses.replace(config.llm, max_token_text_ratio=4.0))
    short_tts = CosyVoice(
        dataclasses.replace(tts.model, config=short),
        tts.tokenizer,
        tts.voice_builder,
        tts.normalizer,
        tts.engine_config,
    )
    with running_server(short_tts, voices, api_key=KEY, warmup=False) as url:
        wait_ready(url)
        page = browser.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(url + "/")
        page.fill("#api-key", KEY)
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("() => document.getElementById('voice').value === 'alice'")
        page.fill("#text", PARAGRAPH)
        page.click("#chat")
        page.wait_for_function("() => window.playground.done === true || window.playground.error !== null")
        heard = page.evaluate("() => ({...window.playground})")
        assert heard["error"] is None, heard
        assert heard["sampleRate"] == SAMPLE_RATE and heard["chunks"] >= 2, heard
        assert heard["bytes"] == 2 * heard["samples"] and heard["samples"] > SAMPLE_RATE // 2, heard
        # ~28 words at 3-5 per 150 ms: about a second of sending (test_server_stream shows the audio
        # coming before the last piece; a browser on a loaded machine is not timed here)
        assert 0 < heard["textEndMs"] < heard["totalMs"], heard
        status = page.text_content("#status")
        assert status.startswith("done:") and "after the first words" in status, status
        assert heard["firstAudioMs"] < heard["totalMs"], heard
        page.wait_for_function("() => document.getElementById('player').duration > 0")
        page.close()
