"""``POST /v1/audio/conversions`` on a real uvicorn (127.0.0.1, free port) over the tiny CosyVoice2
ONNX Runtime engines: conversion whole and streamed, and the limits, errors and auth of the other routes.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile
from _convert_support import load_family
from _server_support import assert_error, httpx, running_server, wait_ready

pytest.importorskip("torch", reason="needs the [build] extra (torch) to build the tiny engines")

AUDIO = Path(__file__).parent / "data" / "features" / "audio"
SOURCE = AUDIO / "en_16k_mono.wav"  # 4.36 s
CONVERSIONS = "/v1/audio/conversions"


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return load_family(tmp_path_factory, "v2")


@pytest.fixture
def voices_dir(tts, tmp_path) -> Path:
    folder = tmp_path / "voices"
    folder.mkdir()
    tts.vc_voice_from_wav(AUDIO / "zh_16k_mono.wav").save(folder / "alice.npz")
    return folder


def _post(url: str, path: Path, data: dict | None = None, headers: dict | None = None):
    with open(path, "rb") as stream:
        return httpx.post(
            url + CONVERSIONS,
            files={"file": (path.name, stream, "audio/wav")},
            data={"voice": "alice", **(data or {})},
            headers=headers,
            timeout=120,
        )


def test_conversion_whole_and_streamed(tts, voices_dir):
    with running_server(tts, voices_dir, warmup=False) as url:
        wait_ready(url)
        response = _post(url, SOURCE, {"seed": "1"})
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("audio/wav")
        path = voices_dir.parent / "whole.wav"
        path.write_bytes(response.content)
        audio, rate = soundfile.read(path)
        assert rate == 24000 and abs(audio.size / rate - 4.36) <= 0.05
        with open(SOURCE, "rb") as stream:
            files = {"file": (SOURCE.name, stream, "audio/wav")}
            data = {"voice": "alice", "stream": "true", "response_format": "pcm", "seed": "1"}
            with httpx.stream("POST", url + CONVERSIONS, files=files, data=data, timeout=120) as streamed:
                assert streamed.status_code == 200
                pieces = list(streamed.iter_bytes())
        pcm = np.frombuffer(b"".join(pieces), np.int16)
        assert abs(pcm.size / 24000 - 4.36) <= 0.05
        # The same seed, whole or streamed: the same length (the official schedules differ in the audio).
        assert pcm.size == audio.size
        # 8 kHz mono and 48 kHz stereo sources: resampled and mixed down, the same 4.36 s out.
        speech, rate = soundfile.read(SOURCE, dtype="float32")
        odd = {
            "tel8k.wav": (speech[::2], 8000),
            "st48k.wav": (np.repeat(np.stack([speech, 0.5 * speech], 1), 3, 0), 48000),
        }
        for name, (samples, odd_rate) in odd.items():
            soundfile.write(voices_dir.parent / name, samples, odd_rate)
            response = _post(url, voices_dir.parent / name, {"response_format": "pcm"})
            assert response.status_code == 200, (name, response.text)
            assert abs(len(response.content) / 2 / 24000 - 4.36) <= 0.05, name
    assert not list(voices_dir.glob(".staging-*")), "work files left behind"


def test_bad_sources_limits_and_auth(tts, voices_dir, tmp_path):
    speech, rate = soundfile.read(SOURCE, dtype="float32")
    names = ("s.wav", "c.wav", "h.flac", "st.wav", "t.wav")
    silent, corrupt, long_flac, stereo48k, tenth = (tmp_path / name for name in names)
    soundfile.write(silent, np.zeros(2 * rate, np.float32), rate)
    soundfile.write(tenth, speech[rate : rate + rate // 10], rate)  # 0.1 s
    corrupt.write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt garbage")
    soundfile.write(long_flac, np.zeros(3600 * 8000, np.int16), 8000)  # one hour, a small flac
    soundfile.write(stereo48k, np.repeat(np.stack([speech, 0.3 * speech], axis=1), 3, axis=0), 48000)
    key = {"Authorization": "Bearer secret"}
    with running_server(tts, voices_dir, warmup=False, api_key="secret", max_upload_bytes=600_000) as url:
        wait_ready(url)
        assert_error(_post(url, SOURCE), 401)
        assert_error(_post(url, SOURCE, {"voice": "nobody"}, key), 404)
        assert "silent" in assert_error(_post(url, silent, None, key), 400, "invalid_audio")["message"]
        error = assert_error(_post(url, tenth, None, key), 400, "invalid_audio")
        assert "0.10 s long; voice conversion needs at least 0.5 s" in error["message"], error
        assert "tmp" not in error["message"] and "staging" not in error["message"]
        error = assert_error(_post(url, corrupt, None, key), 400, "invalid_audio")
        assert "tmp" not in error["message"] and "staging" not in error["message"]
        assert "at least 0.5 s" in error["message"] and "3-10 s" not in error["message"], error
        error = assert_error(_post(url, long_flac, None, key), 400, "audio_too_long")
        assert "3600.0 s long; at most 300 s" in error["message"]
        assert_error(_post(url, SOURCE, {"response_format": "xyz"}, key), 400)
        error = assert_error(_post(url, stereo48k, None, key), 413)  # 837 kB over the 600 kB limit
        # refused by the body limit as it arrives (600 kB + the form's slack), naming the file's own limit
        assert "at most 600000 bytes" in error["message"] and "3-10 s" not in error["message"], error
        soundfile.write(stereo48k, np.repeat(speech, 2)[: 2 * rate * 2], 32000)  # 4 s mono 32 kHz: fits
        response = _post(url, stereo48k, None, key)
        assert response.status_code == 200, response.text
    assert not list(voices_dir.glob(".staging-*")), "work files left behind"


class _HeldAfterFirstChunk:
    """The engine, except that a conversion stops after its first chunk until ``release`` is set."""

    def __init__(self, tts):
        self.tts, self.release = tts, threading.Event()

    def __getattr__(self, name):
        return getattr(self.tts, name)

    def convert(self, *args, **kwargs):
        chunks = self.tts.convert(*args, **kwargs)

        def held():
            try:
                for index, chunk in enumerate(chunks):
                    if index == 1:
                        assert self.release.wait(60), "never released"
                    yield chunk
            finally:
                chunks.close()

        return held()


def test_a_full_queue_is_answered_429(tts, voices_dir):
    held = _HeldAfterFirstChunk(tts)
    with running_server(held, voices_dir, warmup=False, max_concurrent=1, max_queue=0) as url:
        wait_ready(url)
        with open(SOURCE, "rb") as stream:
            files = {"file": (SOURCE.name, stream, "audio/wav")}
            data = {"voice": "alice", "stream": "true", "response_format": "pcm"}
            with httpx.stream("POST", url + CONVERSIONS, files=files, data=data, timeout=120) as busy:
                assert busy.status_code == 200
                pieces = busy.iter_bytes()
                next(pieces)  # the first chunk: the slot is taken
                assert_error(_post(url, SOURCE), 429)
                held.release.set()
                rest = b"".join(pieces)
        assert len(rest) > 0
        response = _post(url, SOURCE)  # the slot is free again
        assert response.status_code == 200, response.text
