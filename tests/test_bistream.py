"""Text-in streaming (official ``inference_bistream``, ``stages.bistream``) on the tiny CosyVoice2 ONNX
Runtime engines: the schedule depends on the text ids only (not on when they arrive), the shared decode
loop gives the tokens of decoding alone and keeps a waiting request's slot, and the Python API takes
iterators and async iterators of text pieces (a str keeps today's path). Parity with the official code
is test_bistream_golden.py."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest
from _streaming_support import load_tiny_ort, make_tiny_voice

from trt_cosy import CosyVoice, InputError, SynthesisConfig
from trt_cosy.models.registry import FAMILIES
from trt_cosy.stages.bistream import TextStream
from trt_cosy.stages.llm import LLMStage
from trt_cosy.stages.llm_batch import BatchedLLMStage
from trt_cosy.stages.sampling import greedy_sample
from trt_cosy.synthesis import LLMPrompt

PIECES = ["Hello there, ", "this is a ", "streamed sentence ", "that arrives ", "a few words ", "at a time."]


@pytest.fixture(scope="module")
def tts(tmp_path_factory, v2_tiny_dir):
    """The tiny engines with at most 4 speech tokens per text id (the random model never says eos: the
    official 20 would make every request here long; parity at 20 is test_bistream_golden.py)."""
    loaded = load_tiny_ort(tmp_path_factory, v2_tiny_dir)
    config = loaded.model.config
    short = dataclasses.replace(config, llm=dataclasses.replace(config.llm, max_token_text_ratio=4.0))
    model = dataclasses.replace(loaded.model, config=short)
    return CosyVoice(model, loaded.tokenizer, loaded.voice_builder, loaded.normalizer, loaded.engine_config)


@pytest.fixture(scope="module")
def voice(tts, tmp_path_factory):
    return make_tiny_voice(tts, tmp_path_factory)


@pytest.fixture(scope="module")
def prompt(tts, voice):
    llm_prompt = tts.llm_prompt(voice)
    return FAMILIES["v2"].bistream_prompt(tts.model.config, llm_prompt, tts.tokenizer.token_to_id)


@pytest.fixture(scope="module")
def model(tts):
    return tts.model


@pytest.fixture(scope="module")
def alone(model) -> LLMStage:
    return LLMStage(model.runners["llm"], model.llm_tables, model.config.llm)


def _batched(model, slots: int = 2) -> BatchedLLMStage:
    config = model.config.llm
    return BatchedLLMStage(
        model.runners["llm"], model.runners["llm_batch"], model.llm_tables, config, slots, 1024
    )


def _stream(tts, pieces, delay: float = 0.0) -> TextStream:
    """A TextStream fed by a thread, ``delay`` s between pieces."""
    stream = TextStream(tts.tokenizer.encode)

    def produce():
        for piece in pieces:
            time.sleep(delay)
            stream.put(piece)
        stream.end()

    threading.Thread(target=produce, daemon=True).start()
    return stream


def test_v1_has_no_text_streaming_and_says_so():
    v1 = FAMILIES["v1"]
    assert not v1.text_streaming and FAMILIES["v2"].text_streaming and FAMILIES["v3"].text_streaming
    empty = LLMPrompt(np.zeros(0, np.int64), np.zeros(0, np.int64))
    with pytest.raises(InputError, match="whole text as one str"):
        v1.bistream_prompt(None, empty, lambda token: None)


def test_v3_prompt_is_split_after_the_end_of_prompt_marker(model):
    v3 = FAMILIES["v3"]
    config = type("C", (), {"llm": model.config.llm, "real_eos_token": 6562})()
    prompt = LLMPrompt(np.array([7, 8, 99, 3, 4], np.int64), np.arange(20, dtype=np.int64))
    split = v3.bistream_prompt(config, prompt, {"<|endofprompt|>": 99}.get)
    assert split.head_ids.tolist() == [7, 8, 99] and split.text_ids.tolist() == [3, 4]
    assert split.specials.fill == 6564 and split.specials.eos == 6562 and split.specials.masked == 6561
    with pytest.raises(InputError, match="endofprompt"):
        v3.bistream_prompt(config, prompt, {"<|endofprompt|>": 98}.get)


def test_tokens_depend_on_the_text_not_on_when_it_arrives(tts, alone, prompt):
    at_once = list(alone.generate_bistream(_stream(tts, PIECES), prompt, greedy_sample, 400))
    slowly = list(alone.generate_bistream(_stream(tts, PIECES, delay=0.02), prompt, greedy_sample, 400))
    one_piece = list(alone.generate_bistream(_stream(tts, ["".join(PIECES)]), prompt, greedy_sample, 400))
    assert at_once == slowly
    ids = sum((tts.tokenizer.encode(piece) for piece in PIECES), [])
    assert len(at_once) > 3 * len(ids)  # speech for every block of text, then the tail after the end
    assert max(at_once) < 6561  # no fill token (or eos) comes out
    # the same words tokenised as one piece may give other ids: the pieces are tokenised one by one
    if tts.tokenizer.encode("".join(PIECES)) == ids:
        assert one_piece == at_once


def test_the_shared_loop_decodes_what_decoding_alone_does_and_keeps_the_slot(tts, model, alone, prompt):
    expected = list(alone.generate_bistream(_stream(tts, PIECES), prompt, greedy_sample, 400))
    batched = _batched(model, slots=1)
    try:
        batched.scheduler.deterministic = True
        # The text comes slowly: the row parks between pieces; a plain request that arrives meanwhile
        # must wait for the slot, which the parked row keeps.
        slow = _stream(tts, PIECES, delay=0.15)
        results: dict[str, list[int]] = {}
        first = threading.Thread(
            target=lambda: results.setdefault(
                "streamed", list(batched.generate_bistream(slow, prompt, greedy_sample, 400))
            )
        )
        first.start()
        deadline = time.monotonic() + 20
        while batched.scheduler.stats.parked == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batched.scheduler.stats.parked > 0
        ref_text = np.asarray(tts.tokenizer.encode("Hi."), np.int64)
        other = batched.generate(ref_text, prompt.text_ids, prompt.speech_ids, greedy_sample, 5)
        second = threading.Thread(target=lambda: results.setdefault("plain", list(other)))
        second.start()
        time.sleep(0.3)
        if not slow.ended:  # still streaming: the plain request has not got the slot
            assert "plain" not in results
        first.join(60)
        second.join(60)
        assert results["streamed"] == expected
        assert len(results["plain"]) == 5
        assert batched.scheduler.parked == 0
    finally:
        batched.scheduler.close()


def test_a_request_closed_while_it_waits_for_text_frees_its_slot(tts, model, prompt):
    batched = _batched(model, slots=1)
    try:
        stream = TextStream(tts.tokenizer.encode)
        stream.put(" ".join(PIECES))  # enough text to start speaking, no end: it must wait for more
        tokens = batched.generate_bistream(stream, prompt, greedy_sample, 400)
        outcome: list[object] = []

        def consume():
            try:
                outcome.append(list(tokens))
            except Exception as exc:  # noqa: BLE001 - checked below
                outcome.append(exc)

        consumer = threading.Thread(target=consume)
        consumer.start()
        deadline = time.monotonic() + 20
        while batched.scheduler.parked == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert batched.scheduler.parked == 1  # waits for text, holding the only slot
        stream.abort()  # the request stops (Request.cancel does this)
        consumer.join(10)
        assert isinstance(outcome[0], Exception) and "cancelled" in str(outcome[0])
        assert batched.scheduler.parked == 0
        plain = batched.generate(
            np.asarray(tts.tokenizer.encode("Hi."), np.int64),
            prompt.text_ids,
            prompt.speech_ids,
            greedy_sample,
            3,
        )
        assert len(list(plain)) == 3  # the slot is free again
    finally:
        batched.scheduler.close()


def test_synthesize_takes_an_iterator_of_pieces(tts, voice):
    config = SynthesisConfig(stream=True)
    pieces = PIECES[:3]  # (the tiny random model rarely says eos: 20 speech tokens per text id)
    chunks = list(tts.synthesize(iter(pieces), voice, seed=3, config=config))
    again = list(tts.synthesize(iter(pieces), voice, seed=3, config=config))
    assert len(chunks) >= 2 and chunks[-1].is_last
    audio = np.concatenate([c.samples for c in chunks])
    assert audio.size > 0 and np.isfinite(audio).all()
    np.testing.assert_array_equal(audio, np.concatenate([c.samples for c in again]))  # seeded: same audio
    plain = tts.synthesize("".join(pieces), voice, seed=3, config=config)  # str: the segmented path
    assert plain.request.text_stream is None and len(plain.request.segments) == 1
    plain.close()


def test_synthesize_rejects_bad_pieces_clearly(tts, voice):
    with pytest.raises(InputError, match="iterable of str"):
        tts.synthesize(42, voice)
    with pytest.raises(InputError, match="must be str"):
        list(tts.synthesize(iter(["Hello ", b"bytes"]), voice))
    stream = TextStream(tts.tokenizer.encode)
    tts.synthesize(stream, voice).close()
    with pytest.raises(InputError, match="one TextStream per request"):
        tts.synthesize(stream, voice)


def test_asynthesize_takes_an_async_iterator_and_audio_comes_before_the_text_ends(tts, voice):
    # The last piece waits for the first audio (60 s at most): an engine that needed the whole text
    # first would make it wait in vain. No race with the machine's load.
    first_audio = asyncio.Event()
    held: list[bool] = []

    async def pieces():
        for index, piece in enumerate(PIECES):
            if index == len(PIECES) - 1:
                try:
                    await asyncio.wait_for(first_audio.wait(), 60)
                except asyncio.TimeoutError:
                    pass
                held.append(first_audio.is_set())
            yield piece
            await asyncio.sleep(0.15)

    async def main():
        chunks = []
        async for chunk in tts.asynthesize(pieces(), voice, seed=1, config=SynthesisConfig(stream=True)):
            first_audio.set()
            chunks.append(chunk)
        return chunks

    chunks = asyncio.run(main())
    assert chunks[-1].is_last
    assert held == [True]  # speech started while text was still coming
