"""A stored voice carries everything its first request needs (issue 32, item 5).

A ``Voice`` (``voices save``, ``POST /v1/voices``) holds the prompt features, speech tokens and speaker
embedding; the one thing a first streaming request still computed was the flow's prompt prefix
(``FlowStage`` ``VoicePrefixes``). ``CosyVoice.prepare_voice`` computes it up front and the server calls it
on upload: the voice's first request then computes no prompt features and no prefix (counted through
the flow stage's ``_compute_prefix`` and the voice builder's ``from_wav``), and its audio is the audio of
a request that computed them itself.
"""

from __future__ import annotations

import numpy as np
import pytest
from _streaming_support import load_tiny_ort, make_tiny_voice
from _support import REF_TEXT, reference_wavs

from trt_cosy import SynthesisConfig
from trt_cosy.frontend.voice import Voice

pytestmark = pytest.mark.slow  # the session's tiny build, then a few seconds


@pytest.fixture(scope="module")
def tts(tmp_path_factory, v2_tiny_dir):
    return load_tiny_ort(tmp_path_factory, v2_tiny_dir)


@pytest.fixture(scope="module")
def stored(tts, tmp_path_factory) -> Voice:
    """A voice as `voices save` leaves it: made, written to a file, read back."""
    path = make_tiny_voice(tts, tmp_path_factory).save(tmp_path_factory.mktemp("voices") / "alice.npz")
    return Voice.load(path)


@pytest.fixture
def counts(tts, monkeypatch) -> dict[str, int]:
    """Calls of the prompt work a request could do: the flow's prefix and the voice's features."""
    flow = tts._stages.flow
    seen = {"prefix": 0, "features": 0}
    compute, from_wav = flow._compute_prefix, tts.voice_builder.from_wav

    def count_prefix(*args, **kwargs):
        seen["prefix"] += 1
        return compute(*args, **kwargs)

    def count_features(*args, **kwargs):
        seen["features"] += 1
        return from_wav(*args, **kwargs)

    monkeypatch.setattr(flow, "_compute_prefix", count_prefix)
    monkeypatch.setattr(tts.voice_builder, "from_wav", count_features)
    flow.voice_prefixes.clear()
    yield seen
    flow.voice_prefixes.clear()


def _speak(tts, voice: Voice) -> np.ndarray:
    config = SynthesisConfig(stream=True)
    return np.concatenate([chunk.samples for chunk in tts.synthesize("Hello there, how are you?", voice, 7, config)])


def test_a_prepared_voice_first_request_does_no_prompt_work_and_sounds_the_same(tts, stored, counts):
    assert tts._stages.flow.incremental_runner is not None  # the tiny build has the incremental graph
    assert tts.prepare_voice(stored) is True
    assert counts == {"prefix": 1, "features": 0}
    prepared = _speak(tts, stored)
    assert counts == {"prefix": 1, "features": 0}, "the first request computed prompt work"
    assert tts.prepare_voice(stored) is True and counts["prefix"] == 1  # kept: nothing computed again
    tts._stages.flow.voice_prefixes.clear()
    computed = _speak(tts, stored)  # the first request computes the prefix itself
    assert counts == {"prefix": 2, "features": 0}
    assert prepared.size > 0 and np.array_equal(prepared, computed)


def test_the_server_precomputes_an_uploaded_voice(tts, counts, tmp_path):
    from starlette.testclient import TestClient

    from trt_cosy.server import create_app
    from trt_cosy.server.settings import ServerSettings

    wav = reference_wavs(tmp_path)["ref"]
    app = create_app(tts, ServerSettings(voices_dir=tmp_path / "voices", warmup=False))
    with TestClient(app) as client:
        with wav.open("rb") as audio:
            response = client.post(
                "/v1/voices", files={"file": ("ref.wav", audio, "audio/wav")}, data={"name": "bob", "text": REF_TEXT}
            )
        assert response.status_code == 201, response.text
        assert counts == {"prefix": 1, "features": 1}  # the upload made the voice and its prefix
        body = {"input": "Hello there.", "voice": "bob", "response_format": "pcm", "stream": True, "seed": 3}
        speech = client.post("/v1/audio/speech", json=body)
        assert speech.status_code == 200 and len(speech.content) > 0
        assert counts == {"prefix": 1, "features": 1}, "the first request after the upload computed prompt work"
