"""The Python API: CosyVoice, SynthesisConfig/EngineConfig, text planning, LLM prompt layout, bad input.

Two tiers. Fast: the torch reference model of the golden tiny checkpoint (no synthesis runs: only
the checks and the input building). Slow: end-to-end synthesis on ONNX Runtime engines of the same
checkpoint, built once per session into the pytest base temp (the same directories as
tests/test_export.py, so a session that runs both builds once).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile
from _support import REF_TEXT, reference_wavs, tiny_engines, tiny_release
from _tts_support import make_torch_tts, stub_models

from trt_cosy import (
    CosyVoice,
    EngineConfig,
    EngineMismatchError,
    InputError,
    SynthesisConfig,
    Voice,
)
from trt_cosy.stages.llm import LLMStage
from trt_cosy.streaming import ChunkPlan
from trt_cosy.synthesis import llm_prompt, plan_segments, segment_token_limit

FEATURES_AUDIO = Path(__file__).parent / "data" / "features" / "audio"
@pytest.fixture(scope="module")
def wavs(tmp_path_factory) -> dict[str, Path]:
    return reference_wavs(tmp_path_factory.mktemp("wavs"))


@pytest.fixture(scope="module")
def torch_tts(tmp_path_factory, v2_tiny_dir) -> CosyVoice:
    return make_torch_tts(tiny_release(tmp_path_factory, v2_tiny_dir))


@pytest.fixture(scope="module")
def voices(torch_tts, wavs) -> dict[str, Voice]:
    return {
        "zero_shot": torch_tts.voice_from_wav(wavs["ref"], REF_TEXT),
        "cross_lingual": torch_tts.voice_from_wav(wavs["ref"]),
    }


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "config",
    [
        SynthesisConfig(),
        SynthesisConfig(max_text_tokens=40, speed=1.0, text_frontend=False, normalizer="none"),
    ],
)
def test_synthesis_config_round_trips_through_json(config):
    assert SynthesisConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


def test_engine_config_round_trips_and_rejects_unknown_fields():
    config = EngineConfig(threads=2, normalizer="none")
    assert EngineConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(InputError, match="unknown EngineConfig fields"):
        EngineConfig.from_dict({"thread": 2})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"speed": 9.0}, "between 0.25 and 4.0"),
        ({"speed": float("nan")}, "a number between"),
        ({"speed": 1.5, "stream": True}, "only without stream"),
        ({"max_text_tokens": 0}, "positive integer"),
        ({"normalizer": "ttsfrd"}, "wetext, none"),
        ({"text_frontend": "yes"}, "True, False or None"),
    ],
)
def test_synthesis_config_rejects_bad_values(kwargs, message):
    with pytest.raises(InputError, match=message):
        SynthesisConfig(**kwargs)


def test_load_on_a_release_dir_says_to_build(v2_tiny_dir):
    with pytest.raises(EngineMismatchError, match="is a release directory.*trt-cosy build --model-dir"):
        CosyVoice.load(v2_tiny_dir)


def test_load_tensorrt_without_engines_says_to_build_and_refuses_unknown_backends(tmp_path):
    with pytest.raises(EngineMismatchError, match="trt-cosy build"):
        CosyVoice.load(tmp_path, backend="trt")
    with pytest.raises(InputError, match="unknown backend"):
        CosyVoice.load(tmp_path, backend="cuda")


# ----------------------------------------------------------------------------- text planning


def test_plan_splits_long_text_into_sentences(torch_tts):
    sentence = "This sentence is about the weather and the sea and the wind today. "
    text = sentence * 6
    segments = plan_segments(text, torch_tts.normalizer.split, torch_tts.tokenizer.encode, limit=1000)
    assert len(segments) > 1, [segment.text for segment in segments]
    assert "".join(segment.text for segment in segments).replace(" ", "") == text.replace(" ", "")
    for segment in segments:
        assert segment.ids.dtype == np.int64
        assert np.array_equal(segment.ids, torch_tts.tokenizer.encode(segment.text))


def test_plan_without_text_frontend_keeps_one_segment(torch_tts):
    text = "One. Two. Three 3."
    (segment,) = plan_segments(text, None, torch_tts.tokenizer.encode, limit=1000)
    assert segment.text == text


def test_segment_token_limit_keeps_the_longest_speech_inside_the_flow_noise():
    limit = segment_token_limit(15000, 2, 20.0, prompt_tokens=100)
    assert limit == (7500 - 100) // 20
    assert 100 + 20 * limit <= 7500 < 100 + 20 * (limit + 1)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "text is empty"),
        ("  \n\t ", "text is empty"),
        ("?!... --- …", "only punctuation"),
    ],
)
def test_bad_text_is_refused_before_anything_runs(torch_tts, voices, text, message):
    with pytest.raises(InputError, match=message):
        torch_tts.synthesize(text, voices["zero_shot"])


def test_segment_over_the_engine_limit_is_refused_with_the_limit(torch_tts, voices):
    voice = voices["zero_shot"]
    limit = segment_token_limit(15000, 2, 20.0, voice.speech_tokens.shape[0])
    unsplittable = " ".join(["word"] * (limit + 50))  # no punctuation: the official split keeps it whole
    with pytest.raises(InputError, match=rf"at most {limit} fit in one segment"):
        torch_tts.synthesize(unsplittable, voice)
    with pytest.raises(InputError, match="at most 3 fit"):
        torch_tts.synthesize("Hello there my old friend.", voice, config=SynthesisConfig(max_text_tokens=3))


def test_bad_seed_voice_and_foreign_voice_are_refused(torch_tts, voices):
    voice = voices["zero_shot"]
    with pytest.raises(InputError, match="seed must be"):
        torch_tts.synthesize("Hi.", voice, seed=-1)
    with pytest.raises(InputError, match="must be a trt_cosy.Voice"):
        torch_tts.synthesize("Hi.", "voice.npz")
    foreign = Voice(
        prompt_text=voice.prompt_text,
        prompt_text_ids=voice.prompt_text_ids,
        speech_tokens=voice.speech_tokens,
        prompt_mel=voice.prompt_mel,
        speaker_embedding=voice.speaker_embedding,
        sample_rate=voice.sample_rate,
        model_id="v2-0123456789abcdef",
    )
    with pytest.raises(InputError, match="made for model v2-0123456789abcdef"):
        torch_tts.synthesize("Hi.", foreign)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("short", "at least 1 s"),
        ("long", "at most 30 s"),
        ("silent", "is silent"),
        ("unreadable", "could not read"),
    ],
)
def test_bad_references_are_refused(torch_tts, wavs, name, message):
    with pytest.raises(InputError, match=message):
        torch_tts.voice_from_wav(wavs[name], REF_TEXT)


def test_bad_text_leaves_no_file(torch_tts, voices, tmp_path):
    with pytest.raises(InputError):
        torch_tts.synthesize_to_file("   ", tmp_path / "out.wav", voices["zero_shot"])
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- voices and LLM input


def test_zero_shot_voice_has_the_normalised_tokenised_prompt_text(torch_tts, voices):
    voice = voices["zero_shot"]
    assert voice.prompt_text == torch_tts.normalizer.normalize(REF_TEXT)
    assert np.array_equal(voice.prompt_text_ids, torch_tts.tokenizer.encode(voice.prompt_text))
    assert voice.model_id == torch_tts.model_id
    assert voices["cross_lingual"].prompt_text == "" and voices["cross_lingual"].prompt_text_ids.size == 0
    # Both modes give the flow the same prompt tokens, mel and speaker embedding.
    for key in ("speech_tokens", "prompt_mel", "speaker_embedding"):
        assert np.array_equal(getattr(voice, key), getattr(voices["cross_lingual"], key)), key


def test_llm_input_layout_zero_shot_vs_cross_lingual(torch_tts, voices):
    """Spec §2.4/§3.2: [sos, text(prompt ++ tts), task, speech(prompt)]; cross-lingual drops both prompts."""
    model = torch_tts.model
    stage = LLMStage(None, model.llm_tables, model.config.llm)
    tables = {name: np.asarray(table) for name, table in model.llm_tables.items()}
    text_ids = np.asarray(torch_tts.tokenizer.encode("Good morning."), np.int64)
    zero_shot = voices["zero_shot"]
    prompt_text, prompt_speech = llm_prompt(zero_shot)
    assert np.array_equal(prompt_text, zero_shot.prompt_text_ids)
    assert np.array_equal(prompt_speech, zero_shot.speech_tokens)
    layout = stage.build_inputs(text_ids, prompt_text, prompt_speech)[0]  # [L, D]
    n_prompt, n_text, n_speech = prompt_text.size, text_ids.size, prompt_speech.size
    assert layout.shape[0] == 1 + n_prompt + n_text + 1 + n_speech
    expected = np.concatenate(
        [
            tables["llm_embedding"][:1],
            tables["text_embedding"][np.concatenate([prompt_text, text_ids])],
            tables["llm_embedding"][1:2],
            tables["speech_embedding"][prompt_speech],
        ]
    )
    np.testing.assert_array_equal(layout, expected)

    prompt_text, prompt_speech = llm_prompt(voices["cross_lingual"])
    assert prompt_text.size == 0 and prompt_speech.size == 0
    layout = stage.build_inputs(text_ids, prompt_text, prompt_speech)[0]
    expected = np.concatenate(
        [tables["llm_embedding"][:1], tables["text_embedding"][text_ids], tables["llm_embedding"][1:2]]
    )
    np.testing.assert_array_equal(layout, expected)


def test_synthesize_is_lazy_and_stops_when_closed(torch_tts, voices, monkeypatch):
    calls = stub_models(monkeypatch)
    text = "This sentence is about the weather and the sea and the wind today. " * 6
    chunks = torch_tts.synthesize(text, voices["zero_shot"])
    assert calls == []
    first = next(chunks)
    assert len(calls) == 1 and first.index == 0 and not first.is_last
    assert first.timings["tokens"] == 5 and calls[0][1] == ChunkPlan(end=5, offset=0, final=True)
    chunks.close()
    assert len(calls) == 1
    assert not [thread for thread in threading.enumerate() if thread.name == "trt-cosy-llm"]
    indices = [(chunk.index, chunk.is_last) for chunk in torch_tts.synthesize(text, voices["zero_shot"])]
    assert indices[-1][1] and not any(last for _, last in indices[:-1])
    assert [index for index, _ in indices] == list(range(len(indices)))


def test_error_mid_request_leaves_no_file(torch_tts, voices, monkeypatch, tmp_path):
    def failing(call, plan):
        if call == 1:
            raise RuntimeError("engine failure")
        return np.zeros(960, np.float32)

    stub_models(monkeypatch, failing)
    text = "This sentence is about the weather and the sea and the wind today. " * 6
    with pytest.raises(RuntimeError, match="engine failure"):
        torch_tts.synthesize_to_file(text, tmp_path / "out.wav", voices["zero_shot"])
    assert list(tmp_path.iterdir()) == []


def test_stream_config_field_round_trips_and_is_checked():
    config = SynthesisConfig(stream=True)
    assert SynthesisConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert SynthesisConfig().stream is False
    with pytest.raises(InputError, match="stream must be True or False"):
        SynthesisConfig(stream="yes")


# ----------------------------------------------------------------------------- end to end (ONNX Runtime)


@pytest.fixture(scope="module")
def ort_tts(tmp_path_factory, v2_tiny_dir) -> CosyVoice:
    return CosyVoice.load(tiny_engines(tmp_path_factory, v2_tiny_dir), config=EngineConfig(threads=1))


@pytest.mark.slow
def test_audio_length_follows_the_token_count(ort_tts, wavs):
    voice = ort_tts.voice_from_wav(wavs["ref"], REF_TEXT)
    text = "Good morning."
    n_text = len(ort_tts.tokenizer.encode(text))
    chunks = list(ort_tts.synthesize(text, voice, seed=0))
    assert len(chunks) == 1 and chunks[0].is_last and chunks[0].index == 0
    chunk = chunks[0]
    config = ort_tts.model.config
    assert (config.token_mel_ratio, config.hift.samples_per_frame, chunk.sample_rate) == (2, 480, 24000)
    tokens = chunk.timings["tokens"]
    assert 2 * n_text <= tokens <= 20 * n_text, tokens
    assert chunk.samples.dtype == np.float32 and chunk.samples.ndim == 1
    assert chunk.samples.shape[0] == tokens * 2 * 480, (chunk.samples.shape, tokens)
    assert np.isfinite(chunk.samples).all()
    peak = float(np.abs(chunk.samples).max())
    assert peak > 1e-3, f"silent output, peak {peak}"
    assert chunk.timings["audio_s"] == pytest.approx(chunk.samples.shape[0] / 24000)
    assert {"llm_s", "llm_wait_s", "flow_s", "vocoder_s", "rtf", "first_audio_s", "elapsed_s"} <= set(
        chunk.timings
    )


@pytest.mark.slow
def test_same_seed_same_audio_and_threads_do_not_interfere(ort_tts, wavs):
    voice = ort_tts.voice_from_wav(wavs["ref"])  # cross-lingual
    text = "Hi there."

    def run(seed: int) -> np.ndarray:
        return np.concatenate([chunk.samples for chunk in ort_tts.synthesize(text, voice, seed=seed)])

    first, again, other = run(7), run(7), run(8)
    np.testing.assert_array_equal(first, again)
    assert first.shape != other.shape or np.abs(first - other).max() > 1e-3
    results: dict[int, np.ndarray] = {}
    threads = [threading.Thread(target=lambda s=s: results.__setitem__(s, run(s))) for s in (7, 8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    np.testing.assert_array_equal(results[7], first)
    np.testing.assert_array_equal(results[8], other)


@pytest.mark.slow
def test_synthesize_to_file_writes_the_chunks(ort_tts, wavs, tmp_path):
    voice = ort_tts.voice_from_wav(wavs["ref"], REF_TEXT)
    expected = np.concatenate([chunk.samples for chunk in ort_tts.synthesize("Hi.", voice, seed=3)])
    path = ort_tts.synthesize_to_file("Hi.", tmp_path / "out.wav", voice, seed=3)
    audio, rate = soundfile.read(path, dtype="float32")
    assert rate == 24000 and audio.shape == expected.shape
    assert np.abs(audio - expected).max() <= 1 / 32768 + 1e-6  # 16-bit PCM rounding
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.wav"]
