"""Batch-invariant decoding (``EngineConfig.deterministic``): a request's logits in the shared decode
loop are bit-identical (``np.array_equal``, no tolerance) whether it decodes alone or beside other
rows, at every batch size up to the slot count, with mixed prompt lengths and rows joining and
leaving mid-way, on the fp32 and the int4 ``llm_batch`` graphs of the golden tiny CosyVoice2 (ONNX
Runtime, 2 intra-op threads); and seeded sampling through the scheduler gives the tokens of
decoding alone. OpenVINO never runs the batched LLM (its engines, and the mixed ones' ONNX Runtime
LLM, decode as here or one request at a time). TensorRT: tests/test_trt_llm_decode.py."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from _support import shared_tiny_engines
from test_llm_batch import _first_step_waits_for_rows

from trt_cosy import EngineConfig, InputError
from trt_cosy.runtime.backends.onnxruntime.batch import OrtBatchLLM
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.engines import load_engines
from trt_cosy.runtime.kv_slots import ROW_GROUP, KVSlots, PrefillCache
from trt_cosy.stages.llm_batch import BatchedLLMStage
from trt_cosy.stages.sampling import RASSampler

THREADS = 2  # intra-op threads of the batched session (several threads split the work of a step)
PROMPTS = (5, 17, 9, 30, 3, 12, 21)  # prompt lengths of the requests (mixed)
STEPS = (12, 7, 10, 4, 9, 11, 6)  # decode steps of each request (they leave at different times)


@pytest.fixture(scope="module")
def engines(tmp_path_factory, v2_tiny_dir) -> Path:
    return shared_tiny_engines(tmp_path_factory, v2_tiny_dir)[1]


@pytest.fixture(scope="module")
def tables(engines):
    model = load_engines(engines, threads=1)
    return model.llm_tables, model.config


@pytest.fixture(scope="module")
def graphs(engines, tmp_path_factory) -> dict[str, Path]:
    """The fp32 engines' ``llm.onnx`` and ``llm_batch.onnx``, and their int4 forms (4-bit
    ``MatMulNBits``, block 128, int8 compute, as ``trt-cosy build --precision int4`` makes the LLM)."""
    from trt_cosy.builder.onnx.llm_batch import write_batched_llm
    from trt_cosy.builder.quantize.engines import quantize_weights_nbits

    int4 = tmp_path_factory.mktemp("int4-llm")
    quantize_weights_nbits(engines / "llm.onnx", int4 / "llm.onnx", bits=4, block_size=128)
    assert write_batched_llm(int4) is not None
    return {"fp32": engines, "int4": int4}


@dataclass
class _Request:
    prompt: np.ndarray  # [1, T, D]
    tokens: np.ndarray  # [N] forced speech tokens, one per decode step
    logits: list[np.ndarray] = field(default_factory=list)  # [V] per step


def _requests(config, table: np.ndarray, count: int) -> list[_Request]:
    rng = np.random.default_rng(7)
    width = table.shape[1]
    return [
        _Request(
            (rng.standard_normal((1, PROMPTS[i], width)) * 0.5).astype(np.float32),
            rng.integers(0, config.llm.speech_vocab_size - 3, STEPS[i]),
        )
        for i in range(count)
    ]


def _decode(model: OrtBatchLLM, config, table, requests, joins: dict[int, int], slots: int, fixed: bool) -> None:
    """Run ``requests`` through KV slots as the scheduler does: request i is queued at step ``joins[i]``
    and joins when a slot is free; each step feeds every active row its next forced token; a row
    leaves after its last token (the last active row moves into its slot). Fills ``request.logits``."""
    qwen = config.llm.qwen
    kv = KVSlots(slots, qwen.num_layers, qwen.num_kv_heads, 64, qwen.head_dim)
    stepper = model.decoder(kv, config.llm.speech_vocab_size, fixed_shapes=fixed)
    caches = {}
    for index in joins:
        cache = PrefillCache(qwen.num_layers, qwen.num_kv_heads, requests[index].prompt.shape[1], qwen.head_dim)
        model.prefill(requests[index].prompt, cache)
        caches[index] = cache
        requests[index].logits.clear()
    waiting = sorted(joins, key=lambda i: (joins[i], i))
    rows: list[int] = []  # the request in each active slot
    step = 0
    while waiting or rows:
        while waiting and joins[waiting[0]] <= step and len(rows) < slots:
            index = waiting.pop(0)
            kv.add(caches[index])
            rows.append(index)
        if rows:
            inputs = np.stack([table[requests[i].tokens[len(requests[i].logits)]] for i in rows])[:, None]
            logits = stepper.step(inputs)  # [B, V]
            for row, index in enumerate(rows):
                requests[index].logits.append(logits[row].copy())
            done = [row for row, index in enumerate(rows) if len(requests[index].logits) == requests[index].tokens.size]
            for row in sorted(done, reverse=True):
                moved = kv.remove(row)
                if moved is not None:
                    rows[row] = rows[moved]
                rows.pop()
        step += 1


def _batch_model(graphs, precision: str) -> OrtBatchLLM:
    runner = OrtRunner.from_path(graphs[precision] / "llm_batch.onnx", "llm_batch", threads=THREADS, exported=True)
    return OrtBatchLLM(runner, sum(name.startswith("past_key_") for name in runner.input_names))


def _schedules(slots: int, count: int) -> list[dict[int, int]]:
    """Every batch size 1..slots at once, then rows joining and leaving mid-way in two orders (more
    requests than slots: some wait for a slot; a request lands in different slots)."""
    together = [dict.fromkeys(range(size), 0) for size in range(1, slots + 1)]
    staggered = {i: (0, 0, 2, 3, 5, 6, 8)[i] for i in range(count)}
    reverse = {count - 1 - i: step for i, step in staggered.items()}
    return [*together, staggered, reverse]


@pytest.mark.parametrize("slots", [4, 5])
@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_logits_alone_and_in_every_batch_are_bit_identical(graphs, tables, precision, slots):
    llm_tables, config = tables
    table = np.asarray(llm_tables["speech_embedding"], np.float32)
    model = _batch_model(graphs, precision)
    requests = _requests(config, table, len(PROMPTS))
    alone = []
    for index, request in enumerate(requests):
        _decode(model, config, table, requests, {index: 0}, slots, fixed=True)
        alone.append([row.copy() for row in request.logits])
    for schedule in _schedules(slots, len(requests)):
        _decode(model, config, table, requests, schedule, slots, fixed=True)
        for index in schedule:
            got, want = requests[index].logits, alone[index]
            assert len(got) == len(want) == STEPS[index]
            for step, (row, expected) in enumerate(zip(got, want, strict=True)):
                assert np.array_equal(row, expected), (
                    f"{precision}, {slots} slots, schedule {schedule}: request {index} step {step} differs "
                    f"by {np.abs(row - expected).max():.3g} from decoding alone"
                )


def test_fixed_steps_run_whole_row_groups_and_the_default_runs_the_active_rows(graphs, tables):
    llm_tables, config = tables
    qwen = config.llm.qwen
    kv = KVSlots(5, qwen.num_layers, qwen.num_kv_heads, 16, qwen.head_dim)
    assert kv.rows == 2 * ROW_GROUP and kv.slots == 5 and kv.lengths.shape == (5,)
    assert kv.keys[0].shape == (8, qwen.num_kv_heads, 16, qwen.head_dim)
    model = _batch_model(graphs, "fp32")
    width = np.asarray(llm_tables["speech_embedding"]).shape[1]
    cache = PrefillCache(qwen.num_layers, qwen.num_kv_heads, 3, qwen.head_dim)
    model.prefill(np.zeros((1, 3, width), np.float32), cache)
    kv.add(cache)
    stepper = model.decoder(kv, config.llm.speech_vocab_size, fixed_shapes=True)
    assert stepper.step(np.zeros((1, 1, width), np.float32)).shape == (1, config.llm.speech_vocab_size)
    assert stepper._rows == 8  # the step ran all 8 rows of the buffers
    stepper.fixed_shapes = False
    stepper.step(np.zeros((1, 1, width), np.float32))
    assert stepper._rows == 1
    assert kv.lengths.tolist() == [5, 0, 0, 0, 0]  # only the active row grew
    with pytest.raises(InputError, match="active rows"):
        stepper.step(np.zeros((2, 1, width), np.float32))


def test_engine_config_sets_the_shared_decode_loop(engines):
    from trt_cosy import CosyVoice
    from trt_cosy.stages.llm_batch import DETERMINISTIC_DEFAULT

    assert EngineConfig.from_dict({"deterministic": False}).deterministic is False
    with pytest.raises(InputError, match="deterministic"):
        EngineConfig(deterministic="yes")
    for setting, expected in ((True, True), (False, False), (None, DETERMINISTIC_DEFAULT)):
        tts = CosyVoice.load(engines, config=EngineConfig(threads=1, normalizer="none", deterministic=setting))
        llm = tts._stages.llm
        assert isinstance(llm, BatchedLLMStage) and llm.scheduler.deterministic is expected
        assert llm.scheduler._stepper.fixed_shapes is expected


def test_seeded_sampling_in_the_shared_loop_equals_decoding_alone_int4(graphs, tables, v2_reference):
    """Six concurrent seeded requests through the deterministic scheduler on the int4 graphs (where
    compact steps measurably change the last bits) yield each request's tokens decoded alone."""
    llm_tables, config = tables
    llm = OrtRunner.from_path(graphs["int4"] / "llm.onnx", "llm", threads=1, exported=True)
    batch = OrtRunner.from_path(graphs["int4"] / "llm_batch.onnx", "llm_batch", threads=THREADS, exported=True)
    stage = BatchedLLMStage(llm, batch, llm_tables, config.llm, slots=4, positions=256, deterministic=True)
    assert stage.scheduler.deterministic
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])

    def tokens(seed: int, prompt_tokens: int) -> list[int]:
        speech = args[2].reshape(-1)[:prompt_tokens]
        sampler = RASSampler.from_config(config.llm, np.random.default_rng(seed))
        return list(stage.generate(args[0], args[1], speech, sampler, 40))

    cases = [(seed, (25, 7, 16, 0, 11, 3)[seed]) for seed in range(6)]
    expected = {case: tokens(*case) for case in cases}  # one at a time: each alone in the loop
    assert set(stage.scheduler.stats.batch_sizes) == {1}
    _first_step_waits_for_rows(stage.scheduler, rows=3)  # tiny steps take microseconds: make them overlap
    got: dict[tuple[int, int], list[int]] = {}
    threads = [threading.Thread(target=lambda c=c: got.__setitem__(c, tokens(*c))) for c in cases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert got == expected
    assert len({tuple(t) for t in expected.values()}) > 1  # the seeds matter
    assert max(stage.scheduler.stats.batch_sizes) >= 3  # the requests shared steps
    stage.scheduler.close()
