"""CosyVoice 1 and 3 through the API: preset speakers, instruct, the LLM input of each mode (spec §2.4).

Fast tier: ``CosyVoice`` injected with the torch reference model of the golden tiny checkpoints
(plus the test tokenizer and stand-in frontend models of ``make-test-model``); nothing is
synthesised, only the prompts, the LLM prefill rows and the checks. The end-to-end runs on ONNX
Runtime engines are in tests/test_families_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

# Shared helpers of the API tests (tests/ is on sys.path under pytest's default import mode).
from _support import INSTRUCT, REF_TEXT, family_release, reference_wavs

from trt_cosy import CosyVoice, EngineConfig, InputError, SynthesisConfig, Voice, families
from trt_cosy.config import QWEN_DIR
from trt_cosy.frontend.text import TextNormalizer
from trt_cosy.models.registry import read_release_config
from trt_cosy.models.v1.request import V1Request, V1Schedule
from trt_cosy.models.v1.stages import stream_token_chunks
from trt_cosy.models.v3.request import V3Request
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.manifest import hash_checkpoint, model_config_from_dict
from trt_cosy.stages.llm import LLMStage
from trt_cosy.streaming import ChunkPlan
from trt_cosy.tts import model_id_from_checkpoint

DATA = Path(__file__).parent / "data"
def make_family_tts(release: Path) -> CosyVoice:
    """CosyVoice on the torch reference model of ``release`` (fast; used where nothing is synthesised)."""
    from trt_cosy.builder.reference import load_torch_model
    from trt_cosy.builder.spk2info import SPK2INFO_FILE, read_spk2info

    model = load_torch_model(release, threads=1, hift_noise_seconds=10.0)
    family = model.config.family
    tokenizer = families.load_text_tokenizer(family, release if family == "v1" else release / QWEN_DIR)
    model_id = model_id_from_checkpoint(family, hash_checkpoint(release))
    builder = families.make_voice_builder(
        model, lambda name, graph: OrtRunner.from_path(release / name, graph, threads=1), model_id
    )
    speakers = read_spk2info(release / SPK2INFO_FILE) if (release / SPK2INFO_FILE).is_file() else {}
    normalizer = TextNormalizer("none", count_tokens=tokenizer.count_tokens)
    return CosyVoice(model, tokenizer, builder, normalizer, EngineConfig(threads=1), speakers)


@pytest.fixture(scope="module")
def wavs(tmp_path_factory) -> dict[str, Path]:
    return reference_wavs(tmp_path_factory.mktemp("family-wavs"))


@pytest.fixture(scope="module")
def v1_tts(tmp_path_factory) -> CosyVoice:
    return make_family_tts(family_release(tmp_path_factory, "v1"))


@pytest.fixture(scope="module")
def v3_tts(tmp_path_factory) -> CosyVoice:
    return make_family_tts(family_release(tmp_path_factory, "v3"))


def _ids(tts: CosyVoice, text: str) -> np.ndarray:
    return np.asarray(tts.tokenizer.encode(text), np.int64)


# ----------------------------------------------------------------------------- CosyVoice 1


def test_v1_preset_speakers_come_from_spk2info_and_unknown_names_list_them(v1_tts):
    assert v1_tts.family == "v1" and v1_tts.sample_rate == 22050
    assert v1_tts.speakers == ("中文女", "英文男")  # golden spk2info.pt, in file order
    voice = v1_tts.preset_voice("英文男")
    assert voice.speech_tokens.size == 0 and voice.prompt_mel.shape == (0, 80)
    np.testing.assert_array_equal(voice.speaker_embedding, v1_tts.speaker_embeddings["英文男"])
    with pytest.raises(InputError, match="unknown preset speaker 'nobody'; this model has: 中文女, 英文男"):
        v1_tts.synthesize("Hi.", "nobody")


def _v1_stage(tts: CosyVoice):
    return families.build_stages(tts.model).llm


def test_v1_sft_llm_input_is_sos_spk_text_task(v1_tts):
    """frontend_sft: the speaker embedding is the LLM's spk row; no prompt text, no prompt speech."""
    prompt = v1_tts.llm_prompt(v1_tts.preset_voice("中文女"))
    assert prompt.text_ids.size == 0 and prompt.speech_ids.size == 0
    embedding = v1_tts.speaker_embeddings["中文女"]
    np.testing.assert_array_equal(prompt.embedding, embedding[None])
    stage = _v1_stage(v1_tts)
    text = _ids(v1_tts, "Good morning.")
    layout = stage.build_inputs(text, prompt.text_ids, prompt.speech_ids, prompt.embedding)[0]  # [L, D]
    assert layout.shape[0] == 1 + 1 + text.size + 1
    encoded = stage.text_encoder.infer(
        {"text_embeds": stage.text_embedding[text][None], "embedding": embedding[None]}
    )
    np.testing.assert_array_equal(layout[0], stage.llm_embedding[0])  # sos
    np.testing.assert_allclose(layout[1], encoded["spk"][0], atol=1e-6)
    np.testing.assert_allclose(layout[2:-1], encoded["text_enc"][0], atol=1e-6)
    np.testing.assert_array_equal(layout[-1], stage.llm_embedding[1])  # task


def test_v1_instruct_llm_input_has_the_instruction_and_no_spk_row(v1_tts):
    """frontend_instruct: sft minus llm_embedding, prompt_text = instruction + '<endofprompt>'."""
    voice = v1_tts.preset_voice("英文男")
    prompt = v1_tts.llm_prompt(voice, INSTRUCT)
    np.testing.assert_array_equal(prompt.text_ids, _ids(v1_tts, INSTRUCT + "<endofprompt>"))
    assert prompt.embedding is None and prompt.speech_ids.size == 0
    stage = _v1_stage(v1_tts)
    text = _ids(v1_tts, "Good morning.")
    layout = stage.build_inputs(text, prompt.text_ids, prompt.speech_ids, prompt.embedding)[0]
    assert layout.shape[0] == 1 + prompt.text_ids.size + text.size + 1  # no spk row
    joined = np.concatenate([prompt.text_ids, text])
    encoded = stage.text_encoder.infer(
        {"text_embeds": stage.text_embedding[joined][None], "embedding": np.zeros((1, 192), np.float32)}
    )
    np.testing.assert_allclose(layout[1:-1], encoded["text_enc"][0], atol=1e-6)
    # min/max length count only the text to speak, not the instruction
    assert stage.length_limits(text.size) == (2 * text.size, 20 * text.size)
    # the flow still gets the preset speaker's embedding
    request = v1_tts._request("Good morning.", "英文男", 0, SynthesisConfig(instruct=INSTRUCT))
    assert isinstance(request, V1Request)
    np.testing.assert_array_equal(request.flow_embedding[0], v1_tts.speaker_embeddings["英文男"])
    np.testing.assert_array_equal(request.prompt.text_ids, prompt.text_ids)


def test_v1_instruct_marker_rules_and_reference_voices(v1_tts, wavs):
    with_bars = INSTRUCT + "<|endofprompt|>"
    prompt = v1_tts.llm_prompt(v1_tts.preset_voice("英文男"), with_bars)
    np.testing.assert_array_equal(prompt.text_ids, _ids(v1_tts, with_bars))  # used as given
    voice = v1_tts.voice_from_wav(wavs["ref"], REF_TEXT)
    with pytest.raises(InputError, match="instruction with a preset speaker"):
        v1_tts.synthesize("Hi.", voice, config=SynthesisConfig(instruct=INSTRUCT))


def test_v1_zero_shot_and_cross_lingual_voices(v1_tts, wavs):
    """v1 voices: 50 Hz tokens and an untrimmed 22.05 kHz mel; the LLM keeps the speaker row."""
    voice = v1_tts.voice_from_wav(wavs["ref"], REF_TEXT)
    assert voice.sample_rate == 22050 and voice.prompt_text == REF_TEXT
    seconds = 1.5
    assert abs(voice.speech_tokens.size - 50 * seconds) <= 2, voice.speech_tokens.size
    assert voice.prompt_mel.shape == (int(seconds * 22050) // 256, 80)  # no alignment to the tokens
    prompt = v1_tts.llm_prompt(voice)
    np.testing.assert_array_equal(prompt.text_ids, voice.prompt_text_ids)
    np.testing.assert_array_equal(prompt.speech_ids, voice.speech_tokens)
    np.testing.assert_array_equal(prompt.embedding, voice.speaker_embedding[None])
    cross = v1_tts.llm_prompt(v1_tts.voice_from_wav(wavs["ref"]))
    assert cross.text_ids.size == 0 and cross.speech_ids.size == 0 and cross.embedding is not None


def test_v1_segment_budget_is_sixty_seconds_of_tokens(v1_tts, wavs):
    voice = v1_tts.preset_voice("中文女")
    assert families.speech_budget(v1_tts.model, voice) == 60 * 50
    unsplittable = " ".join(["word"] * 400)
    with pytest.raises(InputError, match=r"at most 150 fit in one segment"):
        v1_tts.synthesize(unsplittable, voice)


@pytest.mark.parametrize("total", [0, 1, 20, 119, 120, 121, 220, 237, 500])
def test_v1_schedule_matches_the_official_chunking(total):
    """Each plan's tokens[offset:end] are exactly what the official loop hands to token2wav."""
    tokens = np.arange(total)
    official = [(chunk[0].tolist(), final) for chunk, final in stream_token_chunks(tokens)]
    schedule = V1Schedule(stream=True)
    plans, available = [], 0
    while True:  # tokens arrive one by one, the LLM ends at ``total``
        plan = schedule.next_chunk(available, finished=available == total)
        if plan is not None:
            plans.append(plan)
            continue
        if available == total:
            break
        available += 1
    ours = [(tokens[plan.offset : plan.end].tolist(), plan.final) for plan in plans if plan.end > plan.offset]
    assert ours == official
    assert V1Schedule(stream=False).next_chunk(total, True) == ChunkPlan(end=total, offset=0, final=True)


# ----------------------------------------------------------------------------- CosyVoice3


def test_v3_prompts_hold_the_end_of_prompt_marker(v3_tts, wavs):
    """The official v3 LLM asserts <|endofprompt|> in prompt_text ++ text: every mode provides it."""
    marker = v3_tts.tokenizer.token_to_id("<|endofprompt|>")
    system = _ids(v3_tts, "You are a helpful assistant.<|endofprompt|>")
    voice = v3_tts.voice_from_wav(wavs["ref"], REF_TEXT)
    assert voice.prompt_text == "You are a helpful assistant.<|endofprompt|>" + REF_TEXT
    zero_shot = v3_tts.llm_prompt(voice)
    np.testing.assert_array_equal(zero_shot.text_ids, _ids(v3_tts, voice.prompt_text))
    np.testing.assert_array_equal(zero_shot.speech_ids, voice.speech_tokens)
    cross = v3_tts.llm_prompt(v3_tts.voice_from_wav(wavs["ref"]))
    np.testing.assert_array_equal(cross.text_ids, system)
    assert cross.speech_ids.size == 0
    instruct = v3_tts.llm_prompt(voice, INSTRUCT)
    expected = _ids(v3_tts, f"You are a helpful assistant. {INSTRUCT}<|endofprompt|>")
    np.testing.assert_array_equal(instruct.text_ids, expected)
    assert instruct.speech_ids.size == 0 and instruct.embedding is None
    for prompt in (zero_shot, cross, instruct):
        assert marker in prompt.text_ids.tolist()


def test_v3_instruct2_llm_input_and_flow_prompt(v3_tts, wavs):
    """instruct2: zero-shot with prompt_text = instruction and no LLM prompt speech; the flow keeps the voice."""
    voice = v3_tts.voice_from_wav(wavs["ref"], REF_TEXT)
    request = v3_tts._request("Good morning.", voice, 0, SynthesisConfig(instruct=INSTRUCT))
    assert isinstance(request, V3Request) and request.voice is voice
    model = v3_tts.model
    stage = LLMStage(None, model.llm_tables, model.config.llm)
    text = request.segments[0].ids
    layout = stage.build_inputs(text, request.prompt.text_ids, request.prompt.speech_ids)[0]
    tables = {name: np.asarray(table) for name, table in model.llm_tables.items()}
    expected = np.concatenate(
        [
            tables["speech_embedding"][6561:6562],  # sos (v3 keeps it in the speech table)
            tables["text_embedding"][np.concatenate([request.prompt.text_ids, text])],
            tables["speech_embedding"][6563:6564],  # task
        ]
    )
    np.testing.assert_array_equal(layout, expected)


def test_v3_budget_follows_the_hift_noise_and_no_preset_speakers(v3_tts, wavs):
    voice = v3_tts.voice_from_wav(wavs["ref"], REF_TEXT)
    # 10 s of HiFT noise in this fixture: 240000 samples / 480 per frame / 2 frames per token
    assert families.speech_budget(v3_tts.model, voice) == 250
    assert v3_tts.speakers == ()
    with pytest.raises(InputError, match="no preset speakers"):
        v3_tts.synthesize("Hi.", "中文女")


def test_v3_request_drops_long_silent_runs(v3_tts, wavs, monkeypatch):
    voice = v3_tts.voice_from_wav(wavs["ref"], REF_TEXT)
    request = v3_tts._request("Hi.", voice, 0, None)
    stream = [7, 1, 2, 28, 29, 55, 248, 494, 9, 1]
    monkeypatch.setattr(request.stages.llm, "generate", lambda *args, **kwargs: iter(stream))
    assert list(request._decode(0)) == [7, 1, 2, 28, 29, 55, 9, 1]


# ----------------------------------------------------------------------------- shared rules


@pytest.mark.parametrize(
    ("family", "instruct", "expected"),
    [
        ("v1", "Speak fast.", "SPEAK FAST.<endofprompt>"),
        ("v1", "Speak fast.<endofprompt>", "Speak fast.<endofprompt>"),
        ("v2", "用四川话说这句话", "用四川话说这句话<|endofprompt|>"),
        ("v2", "用四川话说这句话<|endofprompt|>", "用四川话说这句话<|endofprompt|>"),
        ("v3", "请用广东话表达。", "You are a helpful assistant. 请用广东话表达。<|endofprompt|>"),
        ("v3", "You are a helpful assistant. Fast.", "You are a helpful assistant. Fast.<|endofprompt|>"),
    ],
)
def test_instruct_text_markers(family, instruct, expected):
    assert families.instruct_text(family, instruct, str.upper) == expected


def test_model_config_and_checkpoint_hashes_follow_the_family(tmp_path_factory):
    for family in ("v1", "v3"):
        release = family_release(tmp_path_factory, family)
        config = read_release_config(release)
        again = model_config_from_dict(json.loads(json.dumps(config.to_dict())))
        assert type(again) is type(config) and again == config
        names = list(hash_checkpoint(release))
        assert names[:4] == [families_yaml(family), "llm.pt", "flow.pt", "hift.pt"]
    assert "spk2info.pt" in hash_checkpoint(family_release(tmp_path_factory, "v1"))


def families_yaml(family: str) -> str:
    from trt_cosy.config import YAML_BY_FAMILY

    return YAML_BY_FAMILY[family]


def test_voice_of_another_family_is_refused(v1_tts, v3_tts, wavs):
    voice = v3_tts.voice_from_wav(wavs["ref"], REF_TEXT)
    stripped = Voice(**{**{k: getattr(voice, k) for k in voice.__dataclass_fields__}, "model_id": ""})
    with pytest.raises(InputError, match="does not fit this model"):
        v1_tts.synthesize("Hi.", stripped)
