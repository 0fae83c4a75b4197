"""One CosyVoice serving many threads, and ``asynthesize`` for asyncio (errors, consumer exit, cancellation).

Runs on the ONNX Runtime engines of the golden tiny checkpoint (fixtures of tests/test_streaming.py).
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from _streaming_support import TEXT_60, counting, llm_threads, load_tiny_ort, make_tiny_voice

from trt_cosy import CosyVoice, InputError, SynthesisConfig

STREAM = SynthesisConfig(stream=True, text_frontend=False)
PLAIN = SynthesisConfig(text_frontend=False)


@pytest.fixture(scope="module")
def tiny_ort(tmp_path_factory, v2_tiny_dir) -> CosyVoice:
    return load_tiny_ort(tmp_path_factory, v2_tiny_dir)


@pytest.fixture(scope="module")
def tiny_voice(tiny_ort, tmp_path_factory):
    return make_tiny_voice(tiny_ort, tmp_path_factory)


def _request_threads() -> list[threading.Thread]:
    return [
        thread for thread in threading.enumerate() if thread.name == "trt-cosy-request" and thread.is_alive()
    ]


def _wait_for_no_workers(timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (llm_threads() or _request_threads()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not llm_threads() and not _request_threads(), "worker threads are still running"


def _audio(tts, voice, seed: int) -> list[np.ndarray]:
    config = STREAM if seed % 2 == 0 else PLAIN
    return [chunk.samples for chunk in tts.synthesize(TEXT_60, voice, seed=seed, config=config)]


@pytest.mark.slow
def test_eight_concurrent_requests_equal_sequential_bit_for_bit(tiny_ort, tiny_voice):
    seeds = list(range(100, 108))  # even seeds stream, odd ones do not
    sequential = {seed: _audio(tiny_ort, tiny_voice, seed) for seed in seeds}
    concurrent: dict[int, list[np.ndarray]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(seeds))

    def run(seed: int) -> None:
        try:
            barrier.wait()
            concurrent[seed] = _audio(tiny_ort, tiny_voice, seed)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for seed in seeds:
        expected, got = sequential[seed], concurrent[seed]
        assert len(got) == len(expected) == (2 if seed % 2 == 0 else 1), seed
        for index, (a, b) in enumerate(zip(got, expected, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"seed {seed} chunk {index}")
    assert (
        np.abs(np.concatenate(sequential[100])[:1000] - np.concatenate(sequential[102])[:1000]).max() > 1e-4
    )
    _wait_for_no_workers()


async def _collect(agen) -> list:
    return [chunk async for chunk in agen]


@pytest.mark.slow
def test_asynthesize_yields_the_chunks_of_synthesize(tiny_ort, tiny_voice):
    chunks = asyncio.run(_collect(tiny_ort.asynthesize(TEXT_60, tiny_voice, seed=9, config=STREAM)))
    expected = list(tiny_ort.synthesize(TEXT_60, tiny_voice, seed=9, config=STREAM))
    assert [chunk.index for chunk in chunks] == [0, 1] and chunks[-1].is_last
    for got, want in zip(chunks, expected, strict=True):
        np.testing.assert_array_equal(got.samples, want.samples)
    _wait_for_no_workers()


def test_asynthesize_raises_input_errors_at_the_first_step(tiny_ort, tiny_voice):
    with pytest.raises(InputError, match="text is empty"):
        asyncio.run(_collect(tiny_ort.asynthesize("  ", tiny_voice)))


@pytest.mark.slow
def test_asynthesize_propagates_an_engine_error(tiny_ort, tiny_voice):
    # The streaming chunks' estimator: the incremental one where the engines have it.
    name = next(n for n in ("flow_estimator_incremental", "flow_estimator_stream") if n in tiny_ort.model.runners)
    tts, counters = counting(tiny_ort, **{name: {"fail_at": 3}})
    with pytest.raises(RuntimeError, match=f"{name} failed at call 3"):
        asyncio.run(_collect(tts.asynthesize(TEXT_60, tiny_voice, seed=1, config=STREAM)))
    _wait_for_no_workers()
    assert counters["hift"].calls == 0


@pytest.mark.slow
def test_asynthesize_consumer_exit_cancels_the_work(tiny_ort, tiny_voice):
    tts, counters = counting(tiny_ort, llm={"block_at": 50})
    llm = counters["llm"]

    async def first_then_stop():
        agen = tts.asynthesize(TEXT_60, tiny_voice, seed=1, config=STREAM)
        first = await agen.__anext__()
        await agen.aclose()  # the consumer is done: the request is cancelled
        return first

    first = asyncio.run(first_then_stop())
    assert first.index == 0 and not first.is_last
    # The LLM waits while the first chunk renders (Request.llm_yield), so at the close it may or may
    # not have reached step 50; either way it stops there at the latest instead of going on to 60.
    llm.release.set()  # a held step finishes; the worker sees the stop flag and ends
    _wait_for_no_workers()
    assert 41 <= llm.calls <= 50 and counters["hift"].calls == 1


@pytest.mark.slow
def test_cancelling_the_consuming_task_cancels_the_work(tiny_ort, tiny_voice):
    tts, counters = counting(tiny_ort, llm={"block_at": 10})
    llm = counters["llm"]

    async def main():
        task = asyncio.create_task(_collect(tts.asynthesize(TEXT_60, tiny_voice, seed=1, config=STREAM)))
        while not llm.blocked.is_set():  # the task now waits for a chunk that needs 41 tokens
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    llm.release.set()
    _wait_for_no_workers()
    assert llm.calls == 10 and counters["hift"].calls == 0 and counters["flow_encoder"].calls == 0
