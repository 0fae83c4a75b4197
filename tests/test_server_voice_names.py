"""OpenAI's voice names on a server whose voices have other names: ``--default-voice`` and ``--voice-alias``
(``ServerSettings.default_voice`` / ``voice_aliases``), on a real uvicorn with a scripted engine."""

from __future__ import annotations

import pytest
from _server_support import (  # noqa: E402  (skips the module without the server extras)
    GOOD,
    SPEECH,
    assert_error,
    httpx,
    running_server,
    scripted_server_fixtures,
    serve_without_serving,
    wait_ready,
)

from trt_cosy.errors import InputError  # noqa: E402
from trt_cosy.server import ServerSettings  # noqa: E402
from trt_cosy.server.voice_names import parse_voice_aliases  # noqa: E402

wavs, torch_tts, alice, voices_dir, scripted = scripted_server_fixtures("voice-names")


def test_without_flags_an_openai_name_gets_a_404_naming_them(scripted, voices_dir):
    with running_server(scripted, voices_dir, warmup=False) as url:
        wait_ready(url)
        missing = httpx.post(url + SPEECH, json={**GOOD, "voice": "alloy"}, timeout=60)
        other = httpx.post(url + SPEECH, json={**GOOD, "voice": "nobody"}, timeout=60)
    message = assert_error(missing, 404, "voice_not_found")["message"]
    assert "--default-voice" in message and "--voice-alias alloy=NAME" in message, message
    message = assert_error(other, 404, "voice_not_found")["message"]
    assert "voice 'nobody' does not exist" in message and "--voice-alias nobody=NAME" in message, message
    assert "--default-voice" not in message  # the default voice is for OpenAI's names only


def test_default_voice_and_aliases_pick_the_stored_voice(scripted, voices_dir):
    settings = {"default_voice": "alice", "voice_aliases": {"echo": "alice", "dave": "alice", "ghost": "nobody"}}
    with running_server(scripted, voices_dir, warmup=False, **settings) as url:
        wait_ready(url)
        answers = {
            name: httpx.post(url + SPEECH, json={**GOOD, "voice": name, "response_format": "pcm"}, timeout=60)
            for name in ("alice", "alloy", "verse", "echo", "dave")
        }
        not_openai = httpx.post(url + SPEECH, json={**GOOD, "voice": "fox"}, timeout=60)
        dangling = httpx.post(url + SPEECH, json={**GOOD, "voice": "ghost"}, timeout=60)
    assert all(answer.status_code == 200 for answer in answers.values()), {
        name: answer.text for name, answer in answers.items() if answer.status_code != 200
    }
    voices = [record["voice"] for record in scripted.requests]
    assert len(voices) == 5 and all(voice is voices[0] for voice in voices)  # alice's stored voice each time
    assert_error(not_openai, 404, "voice_not_found")
    message = assert_error(dangling, 404, "voice_not_found")["message"]
    assert "'ghost' maps to 'nobody'" in message, message


def test_settings_check_the_names():
    with pytest.raises(InputError, match="voice_aliases"):
        ServerSettings(voices_dir=".", voice_aliases={"alloy": ""})
    with pytest.raises(InputError, match="default_voice"):
        ServerSettings(voices_dir=".", default_voice="")
    assert ServerSettings(voices_dir=".", voice_aliases={"alloy": "fox"}).voice_aliases == {"alloy": "fox"}
    assert parse_voice_aliases(("alloy=fox, echo=bob", "nova=fox")) == {"alloy": "fox", "echo": "bob", "nova": "fox"}
    with pytest.raises(ValueError, match="NAME=STORED_VOICE"):
        parse_voice_aliases(("alloy",))


def test_serve_flags_reach_the_settings(torch_tts, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from trt_cosy.cli import main

    served = serve_without_serving(monkeypatch, torch_tts, tmp_path / "cache")
    base = ["serve", "--engines", str(tmp_path)]
    result = CliRunner().invoke(
        main, [*base, "--default-voice", "fox", "--voice-alias", "alloy=bob,echo=carol", "--voice-alias", "nova=bob"]
    )
    assert result.exit_code == 0, result.output
    settings = served[0][1]
    assert settings.default_voice == "fox"
    assert settings.voice_aliases == {"alloy": "bob", "echo": "carol", "nova": "bob"}
    bad = CliRunner().invoke(main, [*base, "--voice-alias", "alloy"])
    assert bad.exit_code == 2 and "alloy=fox" in bad.output, bad.output
