"""Streaming synthesis: the official hop schedule, golden parity of the scheduled path, the pipelined
LLM worker (first audio before the LLM finishes, closing stops the work, worker errors reach the caller).

Pure tests of ``HopSchedule`` are instant. End-to-end tests use ONNX Runtime engines of the golden
tiny checkpoint, built once per session (the fixtures of tests/test_tts.py). The random tiny LLM
practically never samples eos, so a text of n tokens gives exactly 20·n speech tokens.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from _streaming_support import TEXT_60, counting, llm_threads, load_tiny_ort, make_tiny_voice

from trt_cosy import CosyVoice, SynthesisConfig
from trt_cosy.errors import InputError
from trt_cosy.pipeline import Stages, render_chunk
from trt_cosy.runtime import graphs
from trt_cosy.stages.flow import FlowStage
from trt_cosy.stages.vocoder import VocoderCache, VocoderStage
from trt_cosy.streaming import FAST_SCHEDULE, ChunkPlan, HopSchedule, hop_schedule
from trt_cosy.synthesis import llm_prompt, request_rngs
from trt_cosy.verify.golden import GoldenSet

WAV_TOLERANCE = 1e-3  # golden README §3: waveforms
TEXT_100 = "Hi there."  # 5 text tokens -> 100 speech tokens on the tiny model
ONE_SEGMENT = SynthesisConfig(stream=True, text_frontend=False)


# ----------------------------------------------------------------------------- the schedule (pure)


def _golden_chunks(golden: GoldenSet, name: str) -> list[ChunkPlan]:
    return [
        ChunkPlan(end=chunk["n_tokens_to_flow"], offset=chunk["token_offset"], final=chunk["flow_finalize"])
        for chunk in golden.meta[name]["chunks"]
    ]


@pytest.fixture(scope="module")
def golden(v2_tiny_dir) -> GoldenSet:
    return GoldenSet.load(v2_tiny_dir / "reference.npz")


@pytest.mark.parametrize("name", ["stream", "streampad"])
def test_schedule_reproduces_the_official_chunks(golden, name):
    meta = golden.meta[name]
    schedule = HopSchedule(meta["prompt_tokens"], stream=True)
    plans = schedule.plan_all(meta["target_tokens"])
    assert plans == _golden_chunks(golden, name)
    assert all(plan.streaming != plan.final for plan in plans)


def test_hops_grow_25_plus_pad_50_100_and_each_schedule_starts_again():
    for prompt, pad in ((37, 13), (25, 0), (0, 0), (51, 24)):
        plans = HopSchedule(prompt, stream=True).plan_all(25 + pad + 50 + 100 + 100 + 3 + 7)
        hops = [plan.end - 3 - plan.offset for plan in plans[:-1]]
        assert hops == [25 + pad, 50, 100, 100], (prompt, hops)
        assert plans[-1] == ChunkPlan(end=25 + pad + 253 + 7, offset=25 + pad + 250, final=True)
    # The official code keeps the grown hop on the model; a second request must not inherit it.
    again = HopSchedule(37, stream=True).plan_all(100)
    assert [plan.end for plan in again] == [41, 91, 100]


def test_chunks_depend_on_the_token_count_only_not_on_arrival_timing():
    whole = HopSchedule(12, stream=True).plan_all(250)
    schedule, trickled = HopSchedule(12, stream=True), []
    for available in range(251):
        while (plan := schedule.next_chunk(available, finished=available == 250)) is not None:
            trickled.append(plan)
    assert trickled == whole
    assert schedule.next_chunk(250, finished=True) is None


def test_non_streaming_is_one_final_chunk_when_the_llm_ends():
    schedule = HopSchedule(37, stream=False)
    assert schedule.needed is None and schedule.next_chunk(500, finished=False) is None
    assert schedule.next_chunk(500, finished=True) == ChunkPlan(end=500, offset=0, final=True)
    short = HopSchedule(37, stream=True)
    assert short.next_chunk(40, finished=True) == ChunkPlan(end=40, offset=0, final=True)


def test_fast_schedule_doubles_past_100_and_keeps_chunk_attention_to_the_end():
    plans = hop_schedule(37, True, 25, 3, FAST_SCHEDULE).plan_all(38 + 50 + 100 + 200 + 3 + 9)
    hops = [plan.end - 3 - plan.offset for plan in plans[:-1]]
    assert hops == [38, 50, 100, 200]
    assert plans[-1] == ChunkPlan(end=400, offset=388, final=True, chunk_attention=True)
    assert all(plan.streaming for plan in plans)
    # Not streaming: one full-attention call, whatever the schedule.
    (whole,) = hop_schedule(37, False, 25, 3, FAST_SCHEDULE).plan_all(400)
    assert whole == ChunkPlan(end=400, offset=0, final=True) and not whole.streaming


# ----------------------------------------------------------------------------- golden parity


def test_scheduled_render_reproduces_the_golden_stream_wav(golden, tiny_ort):
    """HopSchedule + render_chunk (what a request runs) on the golden tokens and injected noise."""
    model = tiny_ort.model
    flow = FlowStage(
        model.runners[graphs.FLOW_ENCODER.name],
        model.runners[graphs.FLOW_ESTIMATOR.name],
        model.runners[graphs.FLOW_ESTIMATOR_STREAM.name],
        golden["flow_rand_noise"].astype(np.float32),
        model.config.flow,
    )
    stages = Stages(None, flow, VocoderStage(model.runners[graphs.HIFT.name], model.config.hift))
    for name in ("stream", "streampad"):
        meta = golden.meta[name]
        voice = SimpleNamespace(
            speech_tokens=golden["in_prompt_speech_token"][0, : meta["prompt_tokens"]],
            prompt_mel=golden["in_prompt_feat"][0, : meta["prompt_feat_frames"]],
            speaker_embedding=golden["in_spk_embedding"][0],
        )
        tokens = golden[f"{name}_c{len(meta['chunks']) - 1}_flow_tokens"][0].astype(np.int64)
        cache, pieces = VocoderCache(), []
        for index, plan in enumerate(HopSchedule(meta["prompt_tokens"], stream=True).plan_all(tokens.size)):
            noise = golden[f"{name}_c{index}_hift_sine_noise"].astype(np.float32)
            samples, _, _ = render_chunk(stages, voice, tokens, plan, cache, noise, 2)
            pieces.append(samples)
        ours, theirs = np.concatenate(pieces), golden[f"{name}_wav"][0]
        assert ours.shape == theirs.shape, name
        error = float(np.abs(ours - theirs).max())
        assert error <= WAV_TOLERANCE, f"{name}_wav max error {error:.3g}"


# ----------------------------------------------------------------------------- end to end, tiny engines


@pytest.fixture(scope="module")
def tiny_ort(tmp_path_factory, v2_tiny_dir) -> CosyVoice:
    return load_tiny_ort(tmp_path_factory, v2_tiny_dir)


@pytest.fixture(scope="module")
def tiny_voice(tiny_ort, tmp_path_factory):
    return make_tiny_voice(tiny_ort, tmp_path_factory)


def official_assembly(tts: CosyVoice, voice, text: str, seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The official ``tts(stream=True)`` loop written out by hand on our stages (spec §6.1)."""
    stages = tts._stages
    llm_rng, vocoder_rng = request_rngs(seed)
    from trt_cosy.stages.sampling import RASSampler

    sampler = RASSampler.from_config(tts.model.config.llm, llm_rng)
    ids = np.asarray(tts.tokenizer.encode(text), np.int64)
    tokens = np.fromiter(stages.llm.generate(ids, *llm_prompt(voice), sampler), np.int64)  # [n]
    prompt = voice.speech_tokens.shape[0]
    pad = -(-prompt // 25) * 25 - prompt
    offset, hop, cache, pieces = 0, 25, VocoderCache(), []
    args = (voice.speech_tokens[None].astype(np.int64), voice.prompt_mel[None], voice.speaker_embedding[None])
    # The flow as a request runs it (incremental where the engines can; test_flow_incremental checks
    # that this equals the recomputation), so the assembly below can be compared exactly.
    flow_cache = stages.flow.new_cache()
    while True:
        this_hop = hop + pad if offset == 0 else hop
        if tokens.size - offset < this_hop + 3:
            break
        mel = stages.flow.token2mel(
            tokens[None, : offset + this_hop + 3], *args, streaming=True, finalize=False, cache=flow_cache
        ).mel
        pieces.append(stages.vocoder.render(mel[:, :, 2 * offset :], vocoder_rng, cache, final=False)[0])
        offset, hop = offset + this_hop, min(100, 2 * hop)
    mel = stages.flow.token2mel(tokens[None], *args, streaming=False, finalize=True).mel
    pieces.append(stages.vocoder.render(mel[:, :, 2 * offset :], vocoder_rng, cache, final=True)[0])
    return pieces, tokens


@pytest.mark.slow
def test_streaming_equals_the_official_assembly_chunk_by_chunk(tiny_ort, tiny_voice):
    chunks = list(tiny_ort.synthesize(TEXT_100, tiny_voice, seed=11, config=ONE_SEGMENT))
    pieces, tokens = official_assembly(tiny_ort, tiny_voice, TEXT_100, seed=11)
    assert tokens.size == 100 and len(chunks) == len(pieces) == 3
    # Prompt 37 tokens -> pad 13: hops 38, 50, then the final 12 tokens.
    assert [chunk.timings["tokens"] for chunk in chunks] == [38, 50, 12]
    assert [chunk.samples.shape[0] for chunk in chunks] == [38 * 960 - 3840, 50 * 960, 12 * 960 + 3840]
    for chunk, piece in zip(chunks, pieces, strict=True):
        np.testing.assert_array_equal(chunk.samples, piece, err_msg=f"chunk {chunk.index}")
    assert [chunk.is_last for chunk in chunks] == [False, False, True]
    assert [chunk.index for chunk in chunks] == [0, 1, 2]
    timings = chunks[-1].timings
    assert timings["first_audio_s"] == chunks[0].timings["first_audio_s"] < timings["elapsed_s"]
    assert timings["rtf"] == pytest.approx(timings["elapsed_s"] / (100 * 960 / 24000))


@pytest.mark.slow
def test_first_audio_arrives_while_the_llm_is_still_decoding(tiny_ort, tiny_voice):
    """Structural TTFA: the LLM is held at its 42nd step; the first chunk (38 + 3 tokens) must still come."""
    first_hop_tokens = 38 + 3
    tts, counters = counting(tiny_ort, llm={"block_at": first_hop_tokens + 1})
    llm = counters["llm"]
    chunks = tts.synthesize(TEXT_100, tiny_voice, seed=2, config=ONE_SEGMENT)
    try:
        first = next(chunks)
        assert llm.blocked.is_set() and not llm.release.is_set(), "first chunk came after the LLM went on"
        assert llm.calls == first_hop_tokens + 1, llm.calls  # prefill + 40 steps done, step 41 held
    finally:
        llm.release.set()
    rest = list(chunks)
    total_tokens = first.timings["tokens"] + sum(chunk.timings["tokens"] for chunk in rest)
    assert total_tokens == 100 and llm.calls == 100
    # Non-streaming waits for all 100 tokens: here the first audio needed 41, a factor of ~2.4.
    assert total_tokens / first_hop_tokens > 2.4
    assert first.timings["first_audio_s"] < rest[-1].timings["elapsed_s"]


@pytest.mark.slow
def test_closing_the_generator_mid_utterance_stops_all_compute(tiny_ort, tiny_voice):
    """The LLM is held at step 120 (in the second segment) while the consumer closes the request:
    after the stop flag at most that one step runs, nothing else is rendered, the worker is joined."""
    tts, counters = counting(tiny_ort, llm={"block_at": 120})
    llm = counters["llm"]
    text = "Hi there. Hello there."  # two segments, 200 speech tokens if run to the end
    chunks = tts.synthesize(text, tiny_voice, seed=3, config=SynthesisConfig(stream=True))
    first = next(chunks)
    assert first.index == 0 and not first.is_last
    assert llm.blocked.wait(30), "the LLM never reached step 120"
    closer = threading.Thread(target=chunks.close)
    closer.start()  # sets the stop flag, then joins the held worker
    time.sleep(0.1)
    llm.release.set()
    closer.join(30)
    assert not closer.is_alive() and not llm_threads()
    at_close = {name: counter.calls for name, counter in counters.items()}
    time.sleep(0.3)
    assert {name: counter.calls for name, counter in counters.items()} == at_close
    assert at_close["llm"] == 120 and at_close["hift"] == 1, at_close


@pytest.mark.slow
def test_an_error_in_the_llm_worker_reaches_the_consumer_and_stops_the_request(tiny_ort, tiny_voice):
    tts, counters = counting(tiny_ort, llm={"fail_at": 50})
    chunks = tts.synthesize(TEXT_100, tiny_voice, seed=4, config=ONE_SEGMENT)
    with pytest.raises(RuntimeError, match="llm failed at call 50"):
        for _ in chunks:
            pass
    assert not llm_threads()
    assert counters["llm"].calls == 50 and counters["hift"].calls <= 1


@pytest.mark.slow
def test_non_streaming_is_one_full_attention_chunk_per_segment(tiny_ort, tiny_voice):
    tts, counters = counting(tiny_ort)
    (chunk,) = tts.synthesize(TEXT_60, tiny_voice, seed=5)
    assert chunk.timings["tokens"] == 60 and chunk.samples.shape[0] == 60 * 960 and chunk.is_last
    assert counters["hift"].calls == 1 and counters["flow_estimator_stream"].calls == 0
    assert counters["flow_estimator"].calls == tiny_ort.model.config.flow.cfm.n_timesteps


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_flow_is_chunk_causal_so_the_fast_schedule_emits_one_chunk_attention_pass(
    golden, tiny_ort, v2_tiny_dir, backend
):
    """Frames of completed chunks come out the same in every later call (encoder look-ahead, noise and
    cond aligned): the fast schedule's mel, chunk by chunk, is one chunk-attention pass over all."""
    if backend == "torch":
        pytest.importorskip("torch", reason="the torch reference needs torch")
        from trt_cosy.builder.reference import load_torch_model

        model = load_torch_model(v2_tiny_dir, threads=1)
    else:
        model = tiny_ort.model
    flow = FlowStage(
        model.runners[graphs.FLOW_ENCODER.name],
        model.runners[graphs.FLOW_ESTIMATOR.name],
        model.runners[graphs.FLOW_ESTIMATOR_STREAM.name],
        model.flow_noise,  # [1, 80, 15000]: the golden noise covers only the golden lengths
        model.config.flow,
    )
    meta = golden.meta["streampad"]
    prompt = (
        golden["in_prompt_speech_token"][:, : meta["prompt_tokens"]].astype(np.int64),
        golden["in_prompt_feat"][:, : meta["prompt_feat_frames"]],
        golden["in_spk_embedding"],
    )
    tokens = np.random.default_rng(0).integers(0, model.config.flow.vocab_size, (1, 230))  # [1, 230]
    whole = flow.token2mel(tokens, *prompt, streaming=True, finalize=True).mel  # [1, 80, 460]
    assert whole.shape[2] == 460
    for schedule in ("official", FAST_SCHEDULE):
        plans = hop_schedule(meta["prompt_tokens"], True, 25, 3, schedule).plan_all(tokens.shape[1])
        pieces = [
            flow.token2mel(tokens[:, : plan.end], *prompt, streaming=plan.streaming, finalize=plan.final).mel[
                :, :, 2 * plan.offset :
            ]
            for plan in plans
        ]
        mel = np.concatenate(pieces, axis=2)  # [1, 80, 460]
        assert mel.shape == whole.shape, schedule
        last = 2 * plans[-1].offset  # the official final call has full attention from here on
        error = float(np.abs(mel[:, :, :last] - whole[:, :, :last]).max())
        assert error <= 1e-4, (schedule, error)
        tail = float(np.abs(mel[:, :, last:] - whole[:, :, last:]).max())
        if schedule == FAST_SCHEDULE:
            assert tail <= 1e-4, tail
        else:  # full attention differs from chunk attention: the test can tell them apart
            assert tail > 1e-3, tail


@pytest.mark.slow
def test_llm_waits_while_the_first_chunk_renders(tiny_ort, tiny_voice):
    """The first chunk renders with the cores to itself: the LLM takes no step until it is done."""
    # The first streaming chunk runs the incremental estimator where the engines have it.
    name = next(n for n in ("flow_estimator_incremental", "flow_estimator_stream") if n in tiny_ort.model.runners)
    tts, counters = counting(tiny_ort, **{name: {"block_at": 1}})
    estimator, llm = counters[name], counters["llm"]
    chunks = tts.synthesize(TEXT_100, tiny_voice, seed=6, config=ONE_SEGMENT)
    worker = threading.Thread(target=lambda: next(chunks))
    worker.start()
    try:
        assert estimator.blocked.wait(30), "the first chunk never reached the flow"
        held_at = llm.calls
        time.sleep(0.5)
        assert llm.calls <= held_at + 1, (held_at, llm.calls)  # at most the step under way finishes
        assert held_at < 100
    finally:
        estimator.release.set()
    worker.join(30)
    rest = list(chunks)
    assert sum(chunk.timings["tokens"] for chunk in rest) == 100 - 38 and llm.calls == 100


@pytest.mark.slow
def test_fast_schedule_through_the_api_never_runs_the_full_attention_estimator(tiny_ort, tiny_voice):
    tts, counters = counting(tiny_ort)
    config = SynthesisConfig(stream=True, text_frontend=False, stream_schedule="fast")
    chunks = list(tts.synthesize(TEXT_100, tiny_voice, seed=7, config=config))
    assert [chunk.timings["tokens"] for chunk in chunks] == [38, 50, 12]
    steps = tiny_ort.model.config.flow.cfm.n_timesteps
    # Every call has chunk attention: the stream estimator's, or the incremental one's where built
    # (which also computes the voice's prompt prefix once: 37 prompt tokens hold one chunk).
    chunked = sum(counters[n].calls for n in ("flow_estimator_stream", "flow_estimator_incremental") if n in counters)
    prefix = steps if "flow_estimator_incremental" in counters else 0
    assert counters["flow_estimator"].calls == 0 and chunked == 3 * steps + prefix
    official = list(tiny_ort.synthesize(TEXT_100, tiny_voice, seed=7, config=ONE_SEGMENT))
    for fast, slow in zip(chunks[:2], official[:2], strict=True):  # the same until the final call
        np.testing.assert_array_equal(fast.samples, slow.samples)
    assert chunks[2].samples.shape == official[2].samples.shape
    assert not np.array_equal(chunks[2].samples, official[2].samples)


def test_stream_schedule_is_checked():
    with pytest.raises(InputError, match="stream_schedule must be 'official' or 'fast'"):
        SynthesisConfig(stream=True, stream_schedule="quick")
