"""``instructions`` and ``speed`` against the official instruct calls run end to end
(tests/data/instruct/<family>.npz, made by tools/golden/make_instruct_golden.py with the official code at
commit ace7c47; docs/golden.md): CosyVoice2 ``inference_instruct2`` (the reference's flow prompt) and
CosyVoice 1 ``inference_instruct`` (CosyVoice-300M-Instruct: a preset speaker). CosyVoice3 has no golden:
its official LLM asserts the hard-coded id of ``<|endofprompt|>``, beyond the tiny vocabulary.

The official runs used an argmax sampler (the official eos mask still applied) and logged their random
draws; here ``synthesize(text, voice, config=SynthesisConfig(instruct=..., stream=..., speed=...))`` runs
with trt-cosy's ``greedy_sample`` and the regenerated draws. Text and instruction token ids, flow prompt
tokens and the LLM's speech tokens must be identical; the embedding within 1e-3, each chunk's flow mel
within 2e-4 and the audio within 1e-3 (golden README §3), streamed, not streamed and at speeds 2 and 0.5
(the official speed path: the whole mel stretched before the vocoder). The server's ``instructions`` and
``speed`` fields (``POST /v1/audio/speech``) give the same audio (CosyVoice2).
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from _convert_support import load_family
from _official_golden import DATA, cut_wav, load_official_golden

from trt_cosy import SynthesisConfig, pipeline
from trt_cosy.stages.sampling import greedy_sample
from trt_cosy.verify.official_draws import OfficialDraws

pytest.importorskip("torch", reason="needs the [build] extra (torch) to build the tiny engines")

MEL_TOLERANCE = 2e-4  # golden README §3: flow mel
WAV_TOLERANCE = 1e-3  # golden README §3: waveforms
EMBEDDING_TOLERANCE = 1e-3
FAMILIES = ("v1", "v2")
RELEASE_DIRS = {"v1": "v1-tiny-release", "v2": "tiny-release"}


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """family -> (tts, golden, voice): v2 the reference's voice, v1 the golden's preset speaker."""
    loaded = {}

    def setup(family: str):
        if family not in loaded:
            tts = load_family(tmp_path_factory, family)
            golden = load_official_golden(DATA / "instruct" / f"{family}.npz")
            if family == "v1":
                voice = golden["meta"]["speaker"]
            else:
                folder = tmp_path_factory.mktemp("instruct-official")
                voice = tts.voice_from_wav(cut_wav(golden["meta"]["target"], folder / "target.wav"))
            loaded[family] = (tts, golden, voice)
        return loaded[family]

    return setup


@pytest.mark.parametrize("family", FAMILIES)
def test_same_tokenizer_and_standins_as_the_official_run(setups, tmp_path_factory, family):
    meta = setups(family)[1]["meta"]
    release = tmp_path_factory.getbasetemp() / RELEASE_DIRS[family]
    for name, digest in {**meta["standins_sha256"], **meta["tokenizer_sha256"]}.items():
        assert hashlib.sha256((release / name).read_bytes()).hexdigest() == digest, name


def _synthesize(tts, golden, voice, run, monkeypatch):
    """(wav [N], plans, flow mels, final speech tokens) of one golden run, with its draws."""
    meta = golden["meta"][run]
    draws = OfficialDraws(golden["meta"]["draw_seed"], meta["draws"])
    flow = tts._stages.synthesizer.flow if tts.family == "v1" else tts._stages.flow
    token2mel, mels, plans, tokens = type(flow).token2mel, [], [], []

    def recording_token2mel(self, *args, **kwargs):
        out = token2mel(self, *args, **kwargs)
        mels.append(out.mel)
        return out

    monkeypatch.setattr(type(flow), "token2mel", recording_token2mel)
    config = SynthesisConfig(instruct=golden["meta"]["instruct"], stream=meta["stream"], speed=meta["speed"])
    request = tts._request(golden["meta"]["text"], voice, 0, config)
    request.sampler = greedy_sample  # the official run's argmax sampler
    if tts.family == "v1":
        request.draws = draws
    else:
        render = pipeline.render_chunk

        def injected(stages, voice, chunk_tokens, plan, cache, rng, ratio, flow_cache=None, **options):
            noise = draws.sine_noise(len(plans) - 1)
            return render(
                stages, voice, chunk_tokens, plan, cache, noise, ratio, flow_cache=flow_cache, **options
            )

        monkeypatch.setattr(pipeline, "render_chunk", injected)
    original = request._render

    def recording(chunk_tokens, plan, state):
        plans.append(plan)
        tokens[:] = list(chunk_tokens[: plan.end])
        return original(chunk_tokens, plan, state)

    request._render = recording
    chunks = list(request.chunks())
    return np.concatenate([chunk.samples for chunk in chunks]), plans, mels, np.array(tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_instruct_inputs_are_the_official_frontend(setups, family):
    tts, golden, voice = setups(family)
    request = tts._request(
        golden["meta"]["text"], voice, 0, SynthesisConfig(instruct=golden["meta"]["instruct"])
    )
    assert len(request.segments) == 1
    np.testing.assert_array_equal(request.segments[0].ids, golden["text_tokens"])
    np.testing.assert_array_equal(request.prompt.text_ids, golden["instruct_tokens"])
    assert request.prompt.speech_ids.size == 0  # no prompt speech for the LLM
    voice = tts.preset_voice(voice) if isinstance(voice, str) else voice
    if family == "v2":
        np.testing.assert_array_equal(voice.speech_tokens, golden["prompt_tokens"])
    np.testing.assert_allclose(voice.speaker_embedding, golden["embedding"], atol=EMBEDDING_TOLERANCE)


@pytest.mark.parametrize("run", ["nonstream", "stream", "speed2", "speed0.5"])
@pytest.mark.parametrize("family", FAMILIES)
def test_instruct_matches_the_official_run(setups, family, run, monkeypatch):
    tts, golden, voice = setups(family)
    meta, stride = golden["meta"][run], golden["meta"]["mel_stride"]
    wav, plans, mels, tokens = _synthesize(tts, golden, voice, run, monkeypatch)
    np.testing.assert_array_equal(tokens, golden[f"{run}_speech_tokens"])
    calls = meta["calls"]
    if family == "v1":  # official v1 drops each chunk's hop: it is given the tokens from the offset on
        assert [plan.end - plan.offset for plan in plans] == [call["tokens"] for call in calls]
    else:
        assert [plan.end for plan in plans] == [call["tokens"] for call in calls]
        assert [plan.offset for plan in plans] == [call["token_offset"] for call in calls]
    assert [plan.final for plan in plans] == [call["finalize"] for call in calls]
    assert [mel.shape[2] for mel in mels] == meta["flow_mel_frames"]
    for index, mel in enumerate(mels):
        error = float(np.abs(mel[:, :, ::stride] - golden[f"{run}_c{index}_flow_mel"]).max())
        assert error <= MEL_TOLERANCE, f"{family} {run} chunk {index}: flow mel max diff {error:.3g}"
    assert wav.shape == (meta["samples"],)
    official = golden[f"{run}_wav"].astype(np.float32) * np.float32(golden["meta"]["wav_scale"])
    error = float(np.abs(wav[:: meta["wav_stride"]] - official).max())
    assert error <= WAV_TOLERANCE, f"{family} {run}: max |ours - official| = {error:.3g}"


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


@pytest.mark.parametrize("run", ["nonstream", "speed2", "speed0.5"])
def test_server_speech_instructions_and_speed_match_the_official_run(setups, run, tmp_path):
    """``POST /v1/audio/speech`` with OpenAI's ``instructions`` and ``speed``: the official audio."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from _server_support import running_server, wait_ready

    tts, golden, voice = setups("v2")
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
