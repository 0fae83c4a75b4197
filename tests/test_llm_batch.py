"""Continuous batching of the speech LLM: the ``llm_batch`` graph against ``llm`` row by row, the KV
slots, the shared decode loop (same tokens and audio as decoding alone, cancellation, failures, no
slot leak), on the ONNX Runtime engines of the golden tiny CosyVoice2 checkpoint (fp32)."""

from __future__ import annotations

import os
import resource
import threading
import time

import numpy as np
import onnx
import pytest
from _streaming_support import make_tiny_voice
from _support import shared_tiny_engines

from trt_cosy import CosyVoice, InputError, SynthesisConfig
from trt_cosy.builder.onnx.llm_batch import derive_batched_llm
from trt_cosy.runtime.backends.onnxruntime.batch import OrtBatchLLM
from trt_cosy.runtime.backends.onnxruntime.runner import LazyOrtRunner, OrtKVDecoder
from trt_cosy.runtime.engines import load_engines
from trt_cosy.runtime.kv_slots import KVSlots, PrefillCache
from trt_cosy.runtime.manifest import Manifest
from trt_cosy.stages import llm_batch
from trt_cosy.stages.llm import LLMStage
from trt_cosy.stages.llm_batch import BatchedLLMStage
from trt_cosy.stages.sampling import RASSampler, greedy_sample, log_softmax
from trt_cosy.synthesis import EngineConfig

TOL = 1e-4  # fp32 engines: a row decoded in a batch against the same request decoded alone


@pytest.fixture(scope="module")
def engines(tmp_path_factory, v2_tiny_dir):
    return shared_tiny_engines(tmp_path_factory, v2_tiny_dir)[1]


@pytest.fixture(scope="module")
def model(engines):
    return load_engines(engines, threads=1)


@pytest.fixture(scope="module")
def alone(model) -> LLMStage:
    return LLMStage(model.runners["llm"], model.llm_tables, model.config.llm)


def _batched(model, slots: int = 4, positions: int = 256) -> BatchedLLMStage:
    return BatchedLLMStage(
        model.runners["llm"], model.runners["llm_batch"], model.llm_tables, model.config.llm, slots, positions
    )


def _prompts(alone: LLMStage, ref) -> list[np.ndarray]:
    """Prefill embeddings of mixed lengths: the golden prompt cut to 25, 7, 16 and 0 speech tokens."""
    speech = ref["in_prompt_speech_token"].reshape(-1)
    return [alone.build_inputs(ref["in_text"], ref["in_prompt_text"], speech[:n]) for n in (25, 7, 16, 0)]


def _rss_mib() -> float:
    """Resident set size of this process now (Linux), MiB."""
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * resource.getpagesize() / 2**20


def _drain(scheduler, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (scheduler.active or scheduler._pending) and time.monotonic() < deadline:
        time.sleep(0.01)


# ---------------------------------------------------------------- the graph and the slots


def test_build_writes_and_records_the_batched_graph(engines, model):
    record = Manifest.read(engines).graphs["llm_batch"]
    assert record.file == "llm_batch.onnx"
    names = {t.name for t in record.inputs}
    assert {"inputs_embeds", "seqlens_k", "total_sequence_length", "past_key_0", "past_value_1"} <= names
    assert [t.name for t in record.outputs][0] == "logits"
    # Only the LLM session that is used gets created: both are deferred.
    assert isinstance(model.runners["llm"], LazyOrtRunner) and isinstance(
        model.runners["llm_batch"], LazyOrtRunner
    )
    # Decoding alone through the deferred llm session still keeps the cache inside ONNX Runtime.
    stage = LLMStage(model.runners["llm"], model.llm_tables, model.config.llm)
    assert isinstance(stage._decoder(), OrtKVDecoder)


def test_graph_without_group_query_attention_is_not_derived(engines):
    assert derive_batched_llm(onnx.load(str(engines / "hift.onnx"))) is None


def test_teacher_forced_rows_of_a_mixed_batch_equal_each_request_alone(model, alone, v2_reference):
    """Every row of a batch of mixed prompt lengths, fed the golden target tokens, gives the log-probs
    of the same request decoded alone (``llm`` graph), also after a row leaves mid-way and while the
    padding of every slot holds NaN (padding must not reach any row)."""
    prompts = _prompts(alone, v2_reference)
    forced = v2_reference["in_target_speech_token"].reshape(-1)[:8].astype(np.int64)
    expected = [alone.cached_logp(p, forced) for p in prompts]  # each [1 + 8, V]
    config = model.config.llm.qwen
    batch = OrtBatchLLM(model.runners["llm_batch"].load(), config.num_layers)
    slots = KVSlots(5, config.num_layers, config.num_kv_heads, 64, config.head_dim)
    for buffer in (*slots.keys, *slots.values):
        buffer.fill(np.nan)
    rows = []  # request index of each slot row
    for index, prompt in enumerate(prompts):
        cache = PrefillCache(config.num_layers, config.num_kv_heads, prompt.shape[1], config.head_dim)
        got = log_softmax(batch.prefill(prompt, cache))
        assert np.abs(got - expected[index][0]).max() <= TOL
        slots.add(cache)
        rows.append(index)
    stepper = batch.decoder(slots, model.config.llm.speech_vocab_size)
    table = alone.speech_embedding
    for step in range(forced.size):
        if step == 3:  # request 1 leaves: the last row moves into its slot
            moved = slots.remove(rows.index(1))
            rows[rows.index(1)] = rows[moved]
            rows.pop()
        logits = stepper.step(np.stack([table[forced[step]] for _ in rows])[:, None])  # [B, V]
        assert np.isfinite(logits).all(), "padding leaked into a row"
        for row, index in enumerate(rows):
            err = np.abs(log_softmax(logits[row]) - expected[index][step + 1]).max()
            assert err <= TOL, f"request {index} step {step}: {err:.3g}"


def test_kv_slots_move_the_last_row_into_a_freed_slot():
    slots = KVSlots(3, 1, 1, 4, 2)
    for value, length in ((1.0, 2), (2.0, 3), (3.0, 1)):
        cache = PrefillCache(1, 1, length, 2)
        cache.keys[0].fill(value)
        cache.values[0].fill(-value)
        slots.add(cache)
    assert slots.count == 3 and slots.lengths.tolist() == [2, 3, 1]
    assert slots.remove(0) == 2  # row 2 (value 3, length 1) moved into row 0
    assert slots.count == 2 and slots.lengths.tolist() == [1, 3, 0]
    assert slots.keys[0][0, 0, 0, 0] == 3.0 and slots.values[0][0, 0, 0, 0] == -3.0
    assert slots.remove(1) is None and slots.lengths.tolist() == [1, 0, 0]
    slots.add(PrefillCache(1, 1, 4, 2))
    slots.add(PrefillCache(1, 1, 4, 2))
    with pytest.raises(InputError, match="KV slots are in use"):
        slots.add(PrefillCache(1, 1, 1, 2))
    with pytest.raises(InputError, match="capacity"):
        KVSlots(1, 1, 1, 2, 2).add(PrefillCache(1, 1, 3, 2))


# ---------------------------------------------------------------- the shared decode loop


def _first_step_waits_for_rows(scheduler, rows: int, timeout_s: float = 20.0) -> None:
    """The scheduler's first step waits until ``rows`` rows have joined (or are queued to), so that a
    test's requests share steps however the threads are scheduled; later steps are unchanged."""
    step, waited = scheduler._step, threading.Event()

    def first_step_waits() -> None:
        if not waited.is_set():
            deadline = time.monotonic() + timeout_s
            while scheduler.active + len(scheduler._pending) < rows and time.monotonic() < deadline:
                time.sleep(0.005)
            waited.set()
        step()

    scheduler._step = first_step_waits


def test_concurrent_greedy_requests_give_the_golden_tokens(model, v2_reference):
    """Four threads decode at once in one batch (joining and leaving at different steps)."""
    stage = _batched(model)
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    golden = v2_reference["llm_greedy_tokens"].tolist()
    lengths = [len(golden), 5, len(golden) - 3, 1]
    results: dict[int, list[int]] = {}
    _first_step_waits_for_rows(stage.scheduler, rows=3)  # tiny steps take microseconds: make them overlap

    def run(index: int) -> None:
        results[index] = list(stage.generate(*args, greedy_sample, max_new_tokens=lengths[index]))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(lengths))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, length in enumerate(lengths):
        assert results[index] == golden[:length], index
    _drain(stage.scheduler)
    assert stage.scheduler.active == 0 and stage.scheduler.slots.count == 0
    assert stage.scheduler.stats.joined == stage.scheduler.stats.left == 3  # max_new_tokens=1 never joins
    assert max(stage.scheduler.stats.batch_sizes) >= 2


def test_seeded_sampling_equals_decoding_alone(model, alone, v2_reference):
    stage = _batched(model)
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    config = model.config.llm

    def tokens(target: LLMStage, seed: int) -> list[int]:
        return list(target.generate(*args, RASSampler.from_config(config, np.random.default_rng(seed)), 40))

    expected = {seed: tokens(alone, seed) for seed in range(6)}
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda s=s: got.__setitem__(s, tokens(stage, s))) for s in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == expected
    assert len({tuple(t) for t in expected.values()}) > 1  # the seeds matter


def test_cancelled_request_frees_its_slot_at_once_and_the_others_continue(
    model, alone, v2_reference, monkeypatch
):
    stage = _batched(model, slots=2)
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    expected = list(alone.generate(*args, greedy_sample, max_new_tokens=120))
    stepper = stage.scheduler._stepper
    real_step = stepper.step

    def slow_step(inputs):  # 120 steps take >= 0.6 s: both rows are surely still running below
        time.sleep(0.005)
        return real_step(inputs)

    monkeypatch.setattr(stepper, "step", slow_step)
    keep = stage.generate(*args, greedy_sample, max_new_tokens=120)
    drop = stage.generate(*args, greedy_sample, max_new_tokens=120)
    kept = [next(keep), next(keep)]
    assert [next(drop), next(drop)] == expected[:2]
    assert stage.scheduler.active == 2
    drop.close()
    deadline = time.monotonic() + 0.5
    while stage.scheduler.active > 1 and time.monotonic() < deadline:
        time.sleep(0.002)
    assert stage.scheduler.active == 1, "the cancelled row still holds its slot"
    # A third request takes the freed slot while the first goes on unaffected.
    third = list(stage.generate(*args, greedy_sample, max_new_tokens=4))
    assert kept + list(keep) == expected and third == expected[:4]
    _drain(stage.scheduler)
    assert stage.scheduler.active == 0 and stage.scheduler.slots.count == 0


def _slow_steps(stage: BatchedLLMStage, monkeypatch) -> None:
    """Steps of >= 10 ms, so a row of 60 tokens is still decoding while the test looks."""
    stepper = stage.scheduler._stepper
    real_step = stepper.step

    def slow_step(inputs):
        time.sleep(0.01)
        return real_step(inputs)

    monkeypatch.setattr(stepper, "step", slow_step)


def test_first_chunk_hold_pauses_the_loop_only_when_every_row_is_held(
    model, alone, v2_reference, monkeypatch
):
    """``pause="all"``: one request holding for its first chunk stops the loop (its LLM waits, as
    decoding alone does); with a second row running, the loop goes on; the tokens stay exact."""
    stage = _batched(model, slots=2)
    scheduler = stage.scheduler
    scheduler.pause = "all"
    _slow_steps(stage, monkeypatch)
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])

    def sampler(seed: int) -> RASSampler:
        return RASSampler.from_config(model.config.llm, np.random.default_rng(seed))

    expected = [list(alone.generate(*args, sampler(seed), 60)) for seed in (1, 2)]
    assert min(len(tokens) for tokens in expected) >= 20
    first = stage.generate(*args, sampler(1), 60)
    got = [next(first), next(first)]  # the second token comes from the loop: the row has joined
    with stage.render_hold():
        time.sleep(0.05)  # at most the step in progress ends
        steps = scheduler.stats.steps
        time.sleep(0.2)
        assert scheduler.active == 1 and scheduler.stats.steps == steps, "a held lone row kept decoding"
        second = stage.generate(*args, sampler(2), 60)
        other = [next(second), next(second)]  # the second row joins; the loop runs again
        assert scheduler.stats.steps > steps, "two rows and one hold: the loop should go on"
    got += list(first)
    other += list(second)
    assert [got, other] == expected
    assert scheduler.stats.held_s >= 0.2
    _drain(scheduler)
    assert scheduler.active == 0 and scheduler._holds == 0


def test_any_pause_holds_the_loop_for_every_row(model, alone, v2_reference, monkeypatch):
    stage = _batched(model, slots=2)
    scheduler = stage.scheduler
    assert scheduler.pause == "any"  # the default
    _slow_steps(stage, monkeypatch)
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    sampler = RASSampler.from_config(model.config.llm, np.random.default_rng(3))
    expected = list(alone.generate(*args, sampler, 60))
    rows = [
        stage.generate(*args, RASSampler.from_config(model.config.llm, np.random.default_rng(3)), 60)
        for _ in range(2)
    ]
    got = [[next(row), next(row)] for row in rows]
    with scheduler.held():
        time.sleep(0.05)
        steps = scheduler.stats.steps
        time.sleep(0.2)
        assert scheduler.active == 2 and scheduler.stats.steps == steps
    for tokens, row in zip(got, rows, strict=True):
        tokens += list(row)
        assert tokens == expected


def _may_raise_priority() -> bool:
    """Whether this process may lower a thread's nice value below 0 (root, CAP_SYS_NICE, RLIMIT_NICE)."""
    result: list[bool] = []

    def probe() -> None:
        try:
            own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), own + llm_batch.DECODE_NICE)
            result.append(True)
        except PermissionError:
            result.append(False)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return result[0]


def _decode_nice_values(stage, v2_reference, monkeypatch) -> list[int]:
    """Nice values of the threads that ran the decode steps of one short greedy request on ``stage``."""
    stepper = stage.scheduler._stepper
    real_step = stepper.step
    seen: list[int] = []

    def recording(inputs):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real_step(inputs)

    monkeypatch.setattr(stepper, "step", recording)
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    list(stage.generate(*args, greedy_sample, max_new_tokens=4))
    return seen


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread priorities need POSIX os.setpriority")
def test_decode_steps_run_at_the_decode_priority_and_none_leaves_it(model, v2_reference, monkeypatch):
    stage = _batched(model, slots=2)
    seen = _decode_nice_values(stage, v2_reference, monkeypatch)
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    expected = own + llm_batch.DECODE_NICE if _may_raise_priority() else own
    assert seen and set(seen) == {expected}
    stage.scheduler.priority = None  # back to the process's own nice value at the next admission
    seen = _decode_nice_values(stage, v2_reference, monkeypatch)
    assert seen and set(seen) == {own}


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="thread priorities need POSIX os.setpriority")
def test_decode_priority_is_relative_to_a_niced_process(model, v2_reference, monkeypatch):
    """A process started with ``nice`` decodes at its own nice value + DECODE_NICE, never at an absolute
    priority above the one it was given."""
    niced = min(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + 7, 19)  # raising needs no right
    result: list[list[int]] = []
    errors: list[BaseException] = []

    def run_niced() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niced)
            result.append(_decode_nice_values(_batched(model, slots=2), v2_reference, monkeypatch))
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=run_niced)
    thread.start()
    thread.join()
    assert not errors, errors
    expected = niced + llm_batch.DECODE_NICE if _may_raise_priority() else niced
    assert result[0] and set(result[0]) == {expected}


def test_failed_step_fails_its_rows_and_the_loop_serves_the_next(model, v2_reference, monkeypatch):
    stage = _batched(model, slots=2)
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    stepper = stage.scheduler._stepper
    real_step = stepper.step
    calls = []

    def failing(inputs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected decode failure")
        return real_step(inputs)

    monkeypatch.setattr(stepper, "step", failing)
    with pytest.raises(RuntimeError, match="injected decode failure"):
        list(stage.generate(*args, greedy_sample, max_new_tokens=10))
    _drain(stage.scheduler)
    assert stage.scheduler.active == 0 and stage.scheduler.slots.count == 0
    golden = v2_reference["llm_greedy_tokens"].tolist()
    assert list(stage.generate(*args, greedy_sample, max_new_tokens=6)) == golden[:6]


def test_idle_loop_ends_its_thread_and_the_next_request_starts_one(model, v2_reference, monkeypatch):
    import trt_cosy.stages.llm_batch as llm_batch

    monkeypatch.setattr(llm_batch, "_IDLE_EXIT_S", 0.1)
    stage = _batched(model, slots=2)
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    golden = v2_reference["llm_greedy_tokens"][:6].tolist()
    assert list(stage.generate(*args, greedy_sample, max_new_tokens=6)) == golden
    deadline = time.monotonic() + 5.0
    while stage.scheduler._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stage.scheduler._thread is None
    assert list(stage.generate(*args, greedy_sample, max_new_tokens=6)) == golden
    stage.scheduler.close()
    with pytest.raises(RuntimeError, match="closed"):
        list(stage.generate(*args, greedy_sample, max_new_tokens=6))


def test_request_joining_while_an_idle_loop_exits_is_served_by_the_next_loop(model, v2_reference, monkeypatch):
    """The idle loop gives its thread up, then a request joins (and starts a new loop) before the old
    thread's cleanup runs: the cleanup must leave the new request alone (it used to fail it). A hold
    keeps the new loop from finishing the request before the old thread's cleanup has run."""
    import trt_cosy.stages.llm_batch as llm_batch

    monkeypatch.setattr(llm_batch, "_IDLE_EXIT_S", 0.05)
    stage = _batched(model, slots=2)
    scheduler = stage.scheduler
    scheduler.pause = "all"
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    golden = v2_reference["llm_greedy_tokens"][:6].tolist()
    real_admit_rows, racing, results = scheduler._admit_rows, [], []

    def late_request() -> None:
        try:
            results.append(list(stage.generate(*args, greedy_sample, max_new_tokens=6)))
        except RuntimeError as exc:
            results.append(exc)

    def admit_then_race() -> bool:
        admitted = real_admit_rows()
        if not admitted and not racing:  # the idle exit: before this thread's cleanup, a request joins
            racing.append(threading.current_thread())
            scheduler.hold()  # the new loop admits the request but does not step it yet
            racing.append(threading.Thread(target=late_request))
            racing[1].start()
            deadline = time.monotonic() + 20.0
            while not scheduler._rows and time.monotonic() < deadline:  # joined and admitted by a new loop
                time.sleep(0.005)
        return admitted

    monkeypatch.setattr(scheduler, "_admit_rows", admit_then_race)
    assert list(stage.generate(*args, greedy_sample, max_new_tokens=6)) == golden  # then the loop idles out
    deadline = time.monotonic() + 20.0
    while len(racing) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    racing[0].join(20.0)  # the old loop's cleanup has run
    scheduler.release()
    racing[1].join(20.0)
    assert results == [golden]  # served, not "the decode scheduler stopped"
    scheduler.close()


def test_request_longer_than_a_slot_decodes_alone(model, v2_reference):
    stage = _batched(model, slots=2, positions=50)  # prompt 43 + 10 tokens does not fit
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    assert (
        list(stage.generate(*args, greedy_sample, max_new_tokens=10))
        == v2_reference["llm_greedy_tokens"][:10].tolist()
    )
    assert stage.scheduler.stats.joined == 0


def test_no_slot_or_memory_leak_over_500_requests(model, v2_reference):
    stage = _batched(model, slots=8)
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    golden = v2_reference["llm_greedy_tokens"].tolist()
    failures: list[str] = []

    def worker(first: int) -> None:
        for index in range(first, 500, 8):
            stream = stage.generate(*args, greedy_sample, max_new_tokens=4)
            if index % 5 == 0:  # every fifth is cancelled after its second token
                got = [next(stream), next(stream)]
                stream.close()
                expected = golden[:2]
            else:
                got, expected = list(stream), golden[:4]
            if got != expected:
                failures.append(f"request {index}: {got}")

    def run_all() -> None:
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    run_all()  # warm: arenas and the slot pages reach their working size
    before = _rss_mib()
    run_all()
    growth_mib = _rss_mib() - before
    _drain(stage.scheduler)
    assert not failures, failures[:5]
    scheduler = stage.scheduler
    assert scheduler.active == 0 and scheduler.slots.count == 0 and not scheduler.slots.lengths.any()
    assert scheduler.stats.joined == scheduler.stats.left == 1000
    print(f"RSS growth over the second 500 requests: {growth_mib:.1f} MiB")
    assert growth_mib < 20, f"RSS grew {growth_mib:.1f} MiB over 500 requests"


# ---------------------------------------------------------------- through CosyVoice


TEXTS = (
    "Hi.",
    "Hello there.",
    "A longer sentence for the test.",
    "Ok.",
    "Yes, it is.",
    "Go.",
    "Hello.",
    "No.",
)


@pytest.mark.slow
def test_eight_concurrent_requests_equal_decoding_alone_some_cancelled(engines, tmp_path_factory):
    """Same seeds: the batched engine's audio equals the unbatched engine's bit for bit; requests 2
    and 5 stop after their first chunk and free their slots; the others are unaffected."""
    alone = CosyVoice.load(engines, config=EngineConfig(threads=1, llm_slots=0))
    batched = CosyVoice.load(engines, config=EngineConfig(threads=1, llm_slots=8))
    assert type(alone._stages.llm) is LLMStage and type(batched._stages.llm) is BatchedLLMStage
    voice = make_tiny_voice(alone, tmp_path_factory)
    cancelled = {2, 5}

    def audio(tts: CosyVoice, index: int) -> list[np.ndarray]:
        config = SynthesisConfig(stream=index % 2 == 0, text_frontend=False)
        chunks = tts.synthesize(TEXTS[index], voice, seed=200 + index, config=config)
        out = []
        for chunk in chunks:
            out.append(chunk.samples)
            if index in cancelled:
                chunks.close()
                break
        return out

    expected = {index: audio(alone, index) for index in range(8)}
    got: dict[int, list[np.ndarray]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def run(index: int) -> None:
        try:
            barrier.wait()
            got[index] = audio(batched, index)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for index in range(8):
        assert len(got[index]) == len(expected[index]), index
        for a, b in zip(got[index], expected[index], strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"request {index}")
    scheduler = batched._stages.llm.scheduler
    _drain(scheduler)
    assert scheduler.active == 0 and scheduler.slots.count == 0
    assert scheduler.stats.joined == scheduler.stats.left
    assert max(scheduler.stats.batch_sizes) >= 4


def test_engine_config_checks_the_batching_options():
    for bad in ({"llm_slots": -1}, {"llm_slots": 1.5}, {"llm_slot_positions": 0}, {"llm_slots": True}):
        with pytest.raises(InputError):
            EngineConfig(**bad)
    assert EngineConfig(llm_slots=0).llm_slots == 0


def test_kv_slots_give_a_freed_rows_pages_back():
    # One row of one layer = 64 positions x 16 x 4 bytes = one page, so a freed row is released whole.
    slots = KVSlots(3, 1, 1, 64, 16)
    for buffer in (*slots.keys, *slots.values):
        buffer.fill(7.0)
    for length in (64, 10, 5):
        slots.add(PrefillCache(1, 1, length, 16))
    slots.keys[0][2] = 5.0  # the row that will move
    assert slots.remove(0) == 2  # row 2 moves into row 0; row 2's pages go back (read as zeros)
    assert (slots.keys[0][0, :, :5] == 5.0).all()
    assert not slots.keys[0][2].any() and not slots.values[0][2].any()
    assert slots.remove(1) is None  # the last row leaves: released too
    assert not slots.keys[0][1].any() and (slots.keys[0][0, :, :5] == 5.0).all()
    slots.add(PrefillCache(1, 1, 3, 16))  # a released row is usable again
    assert slots.count == 2 and not slots.keys[0][1].any()
