"""``instructions`` (CosyVoice2 instruct2) and ``speed`` against the official ``inference_instruct2`` run
end to end (tests/data/instruct/v2.npz, made by tools/golden/make_instruct_golden.py with the official code
at commit ace7c47; docs/golden.md).

The official run used an argmax sampler (the official eos mask still applied) and logged its HiFT draws;
here ``synthesize(text, voice, config=SynthesisConfig(instruct=..., stream=..., speed=...))`` runs with
trt-cosy's ``greedy_sample`` and the regenerated draws. Text and instruction token ids, flow prompt tokens
and the LLM's speech tokens must be identical; the embedding within 1e-3, each chunk's flow mel within
2e-4 and the audio within 1e-3 (golden README §3), streamed, not streamed and at speed 2 (the official
speed path: the whole mel stretched before the vocoder). This is also what the server's ``instructions``
and ``speed`` fields run (``server/speech`` maps them onto this ``SynthesisConfig``).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from _convert_support import load_family
from _official_golden import DATA, cut_wav, load_official_golden

from trt_cosy import SynthesisConfig, pipeline
from trt_cosy.config import QWEN_DIR
from trt_cosy.stages.sampling import greedy_sample
from trt_cosy.verify.official_draws import OfficialDraws

pytest.importorskip("torch", reason="needs the [build] extra (torch) to build the tiny engines")

MEL_TOLERANCE = 2e-4  # golden README §3: flow mel
WAV_TOLERANCE = 1e-3  # golden README §3: waveforms
EMBEDDING_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tts = load_family(tmp_path_factory, "v2")
    golden = load_official_golden(DATA / "instruct" / "v2.npz")
    target = cut_wav(golden["meta"]["target"], tmp_path_factory.mktemp("instruct-official") / "target.wav")
    return tts, golden, tts.voice_from_wav(target)


def test_same_tokenizer_and_standins_as_the_official_run(setup, tmp_path_factory):
    meta, release = setup[1]["meta"], tmp_path_factory.getbasetemp() / "tiny-release"
    for name, digest in meta["standins_sha256"].items():
        assert hashlib.sha256((release / name).read_bytes()).hexdigest() == digest, name
    for name, digest in meta["tokenizer_sha256"].items():
        assert hashlib.sha256((release / QWEN_DIR / name).read_bytes()).hexdigest() == digest, name


def _synthesize(tts, golden, voice, run, monkeypatch):
    """(request, wav [N], plans, flow mels, final speech tokens) of one golden run, with its draws."""
    meta = golden["meta"][run]
    draws = OfficialDraws(golden["meta"]["draw_seed"], meta["draws"])
    token2mel, mels, plans, tokens = type(tts._stages.flow).token2mel, [], [], []

    def recording_token2mel(self, *args, **kwargs):
        out = token2mel(self, *args, **kwargs)
        mels.append(out.mel)
        return out

    monkeypatch.setattr(type(tts._stages.flow), "token2mel", recording_token2mel)
    render = pipeline.render_chunk

    def injected(stages, voice, chunk_tokens, plan, cache, rng, ratio, flow_cache=None, **options):
        noise = draws.sine_noise(len(plans) - 1)
        return render(
            stages, voice, chunk_tokens, plan, cache, noise, ratio, flow_cache=flow_cache, **options
        )

    monkeypatch.setattr(pipeline, "render_chunk", injected)
    config = SynthesisConfig(instruct=golden["meta"]["instruct"], stream=meta["stream"], speed=meta["speed"])
    request = tts._request(golden["meta"]["text"], voice, 0, config)
    request.sampler = greedy_sample  # the official run's argmax sampler
    original = request._render

    def recording(chunk_tokens, plan, state):
        plans.append(plan)
        tokens[:] = list(chunk_tokens[: plan.end])
        return original(chunk_tokens, plan, state)

    request._render = recording
    chunks = list(request.chunks())
    return request, np.concatenate([chunk.samples for chunk in chunks]), plans, mels, np.array(tokens)


def test_instruct2_inputs_are_the_official_frontend_instruct2(setup, monkeypatch):
    tts, golden, voice = setup
    request = tts._request(
        golden["meta"]["text"], voice, 0, SynthesisConfig(instruct=golden["meta"]["instruct"])
    )
    assert len(request.segments) == 1
    np.testing.assert_array_equal(request.segments[0].ids, golden["text_tokens"])
    np.testing.assert_array_equal(request.prompt.text_ids, golden["instruct_tokens"])
    assert request.prompt.speech_ids.size == 0  # instruct2: no prompt speech for the LLM
    np.testing.assert_array_equal(voice.speech_tokens, golden["prompt_tokens"])
    np.testing.assert_allclose(voice.speaker_embedding, golden["embedding"], atol=EMBEDDING_TOLERANCE)


@pytest.mark.parametrize("run", ["nonstream", "stream", "speed2"])
def test_instruct2_matches_the_official_run(setup, run, monkeypatch):
    tts, golden, voice = setup
    meta, stride = golden["meta"][run], golden["meta"]["mel_stride"]
    _, wav, plans, mels, tokens = _synthesize(tts, golden, voice, run, monkeypatch)
    np.testing.assert_array_equal(tokens, golden[f"{run}_speech_tokens"])
    assert [plan.end for plan in plans] == [call["tokens"] for call in meta["calls"]]
    assert [plan.offset for plan in plans] == [call["token_offset"] for call in meta["calls"]]
    assert [plan.final for plan in plans] == [call["finalize"] for call in meta["calls"]]
    assert [mel.shape[2] for mel in mels] == meta["flow_mel_frames"]
    for index, mel in enumerate(mels):
        error = float(np.abs(mel[:, :, ::stride] - golden[f"{run}_c{index}_flow_mel"]).max())
        assert error <= MEL_TOLERANCE, f"{run} chunk {index}: flow mel max diff {error:.3g}"
    assert wav.shape == (meta["samples"],)
    official = golden[f"{run}_wav"].astype(np.float32) * np.float32(golden["meta"]["wav_scale"])
    error = float(np.abs(wav[:: meta["wav_stride"]] - official).max())
    assert error <= WAV_TOLERANCE, f"{run}: max |ours - official| = {error:.3g}"


class _OfficialSamplingTTS:
    """The engine as the server uses it, but each request decodes with argmax and the official draws of
    golden run ``run`` (what the official run did), so the server's audio can be held to the golden."""

    def __init__(self, tts, golden, run: str):
        self._tts, self._golden, self.run = tts, golden, run

    def __getattr__(self, name):
        return getattr(self._tts, name)

    def synthesize(self, text, voice, seed=None, config=None):
        from trt_cosy.pipeline import CancellableChunks

        request = self._tts._request(text, voice, seed, config)
        request.sampler = greedy_sample
        draws = OfficialDraws(self._golden["meta"]["draw_seed"], self._golden["meta"][self.run]["draws"])
        calls, original = [], request._render

        def render(chunk_tokens, plan, state):
            calls.append(plan)
            request.vocoder_rng = draws.sine_noise(len(calls) - 1)  # [1, S, 9]: the official HiFT noise
            return original(chunk_tokens, plan, state)

        request._render = render
        return CancellableChunks(request)


@pytest.mark.parametrize("run", ["nonstream", "speed2"])
def test_server_speech_instructions_and_speed_match_the_official_run(setup, run, tmp_path):
    """``POST /v1/audio/speech`` with OpenAI's ``instructions`` and ``speed``: the official audio."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from _server_support import running_server, wait_ready

    tts, golden, voice = setup
    meta = golden["meta"][run]
    voices = tmp_path / "voices"
    voices.mkdir()
    voice.save(voices / "target.npz")
    body = {
        "model": "tts-1",
        "input": golden["meta"]["text"],
        "voice": "target",
        "response_format": "pcm",
        "stream": False,
        "instructions": golden["meta"]["instruct"],
        "speed": meta["speed"],
    }
    with running_server(_OfficialSamplingTTS(tts, golden, run), voices, warmup=False) as url:
        wait_ready(url)
        response = httpx.post(url + "/v1/audio/speech", json=body, timeout=120)
    assert response.status_code == 200, response.text
    wav = np.frombuffer(response.content, np.int16).astype(np.float32) / np.float32(32768)  # [N]
    assert wav.shape == (meta["samples"],)
    official = golden[f"{run}_wav"].astype(np.float32) * np.float32(golden["meta"]["wav_scale"])
    error = float(np.abs(wav[:: meta["wav_stride"]] - official).max())
    assert error <= WAV_TOLERANCE, f"server {run}: max |ours - official| = {error:.3g}"
