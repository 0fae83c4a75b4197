"""Text-in streaming on CosyVoice3 (the official ``CosyVoice3LM`` inherits ``inference_bistream``): the
tiny v3 ONNX Runtime engines speak an iterator of pieces, the prompt is split after ``<|endofprompt|>``,
the tokens depend on the text only and never include a special id. (No official golden: the official v3
LLM asserts the literal id 151646 of ``<|endofprompt|>``, which the tiny 2048-id vocabulary cannot hold.)"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from _support import REF_TEXT, family_engines, reference_wavs

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig, TextStream
from trt_cosy.frontend.tokenizer import ENDOFPROMPT
from trt_cosy.models.registry import FAMILIES
from trt_cosy.stages.llm import LLMStage
from trt_cosy.stages.sampling import greedy_sample

PIECES = ["Hello there, ", "this is CosyVoice3 ", "speaking while ", "the text arrives."]


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> CosyVoice:
    return CosyVoice.load(family_engines(tmp_path_factory, "v3"), config=EngineConfig(threads=1))


@pytest.fixture(scope="module")
def voice(tts, tmp_path_factory):
    return tts.voice_from_wav(reference_wavs(tmp_path_factory.mktemp("v3-bistream"))["ref"], REF_TEXT)


def test_v3_prompt_head_ends_with_the_marker(tts, voice):
    prompt = FAMILIES["v3"].bistream_prompt(
        tts.model.config, tts.llm_prompt(voice), tts.tokenizer.token_to_id
    )
    marker = tts.tokenizer.token_to_id(ENDOFPROMPT)
    assert prompt.head_ids.size and prompt.head_ids[-1] == marker and marker not in prompt.text_ids
    assert prompt.specials == (6564, 6562, 6561)


def _stream(tts, delay: float) -> TextStream:
    stream = TextStream(tts.tokenizer.encode)

    def produce():
        for piece in PIECES:
            time.sleep(delay)
            stream.put(piece)
        stream.end()

    threading.Thread(target=produce, daemon=True).start()
    return stream


def test_v3_tokens_depend_on_the_text_only(tts, voice):
    prompt = FAMILIES["v3"].bistream_prompt(
        tts.model.config, tts.llm_prompt(voice), tts.tokenizer.token_to_id
    )
    model = tts.model
    stage = LLMStage(model.runners["llm"], model.llm_tables, model.config.llm)
    fast = list(stage.generate_bistream(_stream(tts, 0.0), prompt, greedy_sample, 200))
    slow = list(stage.generate_bistream(_stream(tts, 0.05), prompt, greedy_sample, 200))
    assert fast == slow and len(fast) > 0 and max(fast) < 6561


def test_v3_synthesize_speaks_an_iterator_of_pieces(tts, voice):
    chunks = list(tts.synthesize(iter(PIECES[:2]), voice, seed=2, config=SynthesisConfig(stream=True)))
    assert chunks and chunks[-1].is_last
    audio = np.concatenate([chunk.samples for chunk in chunks])
    assert audio.size > 0 and np.isfinite(audio).all()
