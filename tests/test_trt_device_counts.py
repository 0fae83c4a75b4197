"""What crosses between host and device per decode step and per flow solve, counted with the
pessimistic fakes (tests/trt_fakes.py: ``CountingCuda`` counts bytes per direction and host
synchronizes; a profile switch drops the activation memory; events can stay "in flight").

Issue 29: per step only what is new crosses (token embeddings, lengths, logits), independent of the
cache length, with at most one synchronize per decode step; the device KV slots check their dtype
against the plan; chained Euler solves never overwrite pinned staging that is still being copied.
No GPU, no TensorRT: the engines compute in numpy on host memory standing in for device memory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from trt_fakes import FAKE_TRT, CountingCuda, FakeEngine, host_array

from trt_cosy.errors import EngineMismatchError
from trt_cosy.models.registry import read_release_config
from trt_cosy.runtime import cuda
from trt_cosy.runtime.kv_slots import PrefillCache
from trt_cosy.runtime.llm_decode import LLM_DECODE_NAME, cache_input_names, device_cache_inputs
from trt_cosy.runtime.profiles import GraphProfiles, ProfileLimits, default_profiles, llm_decode_profiles
from trt_cosy.runtime.trt import TrtRunner
from trt_cosy.runtime.trt_batch import DeviceKVSlots, TrtBatchLLM, cache_dtype

LIMITS = ProfileLimits(max_batch=4, max_context=256, decode_buckets=(64,))
VOCAB = 16


@pytest.fixture
def counting(monkeypatch) -> CountingCuda:
    fake = CountingCuda()
    monkeypatch.setattr(cuda, "_BINDINGS", fake)
    return fake


@pytest.fixture(scope="module")
def config(v2_tiny_dir):
    return read_release_config(v2_tiny_dir)


def _decode_engine(config, cache_type=np.float32) -> FakeEngine:
    """``llm_decode`` in numpy: logits[b, 0, v] = v + Σ embeds[b] + Σ past_key_0[b, :, :len_b] (so a
    wrong slot row, length or stale memory shows), new_kv [B, 2L, H, Dh] = the first H·Dh embeds."""
    qwen = config.llm.qwen
    layers, heads, head_dim = qwen.num_layers, qwen.num_kv_heads, qwen.head_dim
    profiles = llm_decode_profiles(config, LIMITS)

    def compute(views):
        embeds, lengths = np.asarray(views["inputs_embeds"]), np.asarray(views["past_lengths"])
        keys = np.asarray(views["past_key_0"], np.float64)  # [B, H, C, Dh]
        read = np.asarray(views["key_positions"])  # [P]: 0..P-1
        assert np.array_equal(read, np.arange(read.size)), "key_positions must be 0..P-1"
        rows = embeds.shape[0]
        cached = np.array([keys[b, :, : lengths[b]].sum() for b in range(rows)])  # [B]
        logits = np.arange(VOCAB)[None, None] + (embeds.sum(axis=(1, 2)) + cached)[:, None, None]
        part = embeds[:, 0, : heads * head_dim].reshape(rows, 1, heads, head_dim)
        new_kv = np.repeat(part, 2 * layers, axis=1).astype(cache_type)  # [B, 2L, H, Dh]
        return {"logits": logits.astype(np.float32), "new_kv": new_kv}

    def output_shape(shapes, name):
        rows = shapes["inputs_embeds"][0]
        return (rows, 1, VOCAB) if name == "logits" else (rows, 2 * layers, heads, head_dim)

    dtypes = {"past_lengths": np.int32, "key_positions": np.int32, "new_kv": cache_type}
    dtypes.update(dict.fromkeys(cache_input_names(layers), cache_type))
    return FakeEngine(profiles, outputs=("logits", "new_kv"), compute=compute, output_shape=output_shape,
                      dtypes=dtypes)  # fmt: skip


def _decode_runner(config, cache_type=np.float32) -> TrtRunner:
    engine = _decode_engine(config, cache_type)
    profiles = engine.profiles
    return TrtRunner(engine, LLM_DECODE_NAME, profiles, trt=FAKE_TRT,
                     external=device_cache_inputs(profiles.input_names))  # fmt: skip


def _cache(config, length: int, rng) -> PrefillCache:
    qwen = config.llm.qwen
    cache = PrefillCache(qwen.num_layers, qwen.num_kv_heads, length, qwen.head_dim)
    for part in (*cache.keys, *cache.values):
        part[...] = rng.standard_normal(part.shape)
    return cache


def _step_counts(counting, stepper, embeds, steps: int) -> list[dict[str, int]]:
    counts = []
    for _ in range(steps):
        mark = counting.mark()
        stepper.step(embeds)
        counts.append(counting.since(mark))
    return counts


@pytest.mark.parametrize("rows", [1, 3])
def test_a_decode_step_moves_only_new_data_whatever_the_cache_length(config, counting, rows):
    """Per step: embeddings [B, D] and lengths [B] up, logits [B, V] down, the new positions device to
    device; the same bytes at 10 and at 200 cached positions, and one synchronize."""
    qwen = config.llm.qwen
    runner = _decode_runner(config)
    model = TrtBatchLLM(None, runner, qwen.num_layers)
    rng = np.random.default_rng(0)
    per_length = {}
    for length in (10, 200):
        slots = DeviceKVSlots(4, qwen.num_layers, qwen.num_kv_heads, LIMITS.max_context, qwen.head_dim)
        host_array(slots.buffer.ptr, (slots.nbytes // 4,))[...] = np.nan  # stale memory must never be read
        caches = [_cache(config, length + row, rng) for row in range(rows)]
        for cache in caches:
            slots.add(cache)
        stepper = model.decoder(slots, VOCAB)
        embeds = rng.standard_normal((rows, 1, qwen.hidden_size)).astype(np.float32)
        counts = _step_counts(counting, stepper, embeds, 3)
        per_length[length] = counts
        expected_up = rows * qwen.hidden_size * 4 + rows * 4  # embeddings + lengths
        expected_kv = rows * 2 * qwen.num_layers * qwen.num_kv_heads * qwen.head_dim * 4
        for count in counts:
            assert count == {"to_device": expected_up, "to_host": rows * VOCAB * 4, "device": expected_kv,
                             "synchronizes": 1}, count  # fmt: skip
        # the steps really read the slots: logits follow the cache sums (new positions included)
        got = stepper.step(embeds)
        for row, cache in enumerate(caches):
            written = 3 * embeds[row, 0, : qwen.num_kv_heads * qwen.head_dim].astype(np.float64).sum()
            cached = float(np.asarray(cache.keys[0], np.float64).sum()) + written  # 3 earlier steps' positions
            want = np.arange(VOCAB) + embeds[row].astype(np.float64).sum() + cached
            assert np.allclose(got[row], want, rtol=1e-4, atol=1e-3), row
        slots.free()
    assert per_length[10] == per_length[200]


def test_the_kv_slots_check_the_plans_cache_dtype(config, counting):
    qwen = config.llm.qwen
    dims = (2, qwen.num_layers, qwen.num_kv_heads, 64, qwen.head_dim)
    half = _decode_runner(config, np.float16)
    assert cache_dtype(half) == np.float16 and cache_dtype(_decode_runner(config)) == np.float32
    model = TrtBatchLLM(None, half, qwen.num_layers)
    with pytest.raises(EngineMismatchError, match=r"slots hold float32.*as float16"):
        model.decoder(DeviceKVSlots(*dims), VOCAB)
    slots = DeviceKVSlots(*dims, dtype=np.float16)
    assert slots.nbytes == DeviceKVSlots(*dims).nbytes // 2
    cache = _cache(config, 5, np.random.default_rng(1))
    slots.add(cache)  # float32 prefill cast to the slots' float16 on its way in
    device = host_array(slots.buffer.ptr, (2 * qwen.num_layers, 2, qwen.num_kv_heads, 64, qwen.head_dim), np.float16)
    assert np.array_equal(device[0, 0, :, :5], cache.keys[0][0].astype(np.float16))
    stepper = model.decoder(slots, VOCAB)
    stepper.step(np.ones((1, 1, qwen.hidden_size), np.float32))
    assert np.all(device[:, 0, :, 5] == 1.0)  # the step's new position, written in float16
    slots.free()


def test_a_plan_mixing_cache_dtypes_is_refused(config, counting):
    engine = _decode_engine(config)
    engine.dtypes["past_value_0"] = np.float16
    runner = TrtRunner(engine, LLM_DECODE_NAME, engine.profiles, trt=FAKE_TRT,
                       external=device_cache_inputs(engine.profiles.input_names))  # fmt: skip
    with pytest.raises(EngineMismatchError, match=r"\['float16', 'float32'\].*Rebuild"):
        cache_dtype(runner)


# -- one request's LLM decode with the cache on the device (runtime.trt_kv) --------------------------------


def _llm_engine(config) -> tuple[FakeEngine, GraphProfiles]:
    """The ``LLM`` contract in numpy: present = past ++ the first H·Dh embeds of each new position (every
    layer), logits[0, t, v] = v + Σ present_keys + Σ embeds[0, t] (a stale or missing past shows)."""
    qwen = config.llm.qwen
    heads, head_dim = qwen.num_kv_heads, qwen.head_dim
    profiles = default_profiles(config, ProfileLimits(max_prefill=64, max_context=256, decode_buckets=(64,)))["llm"]

    def compute(views):
        embeds = np.asarray(views["inputs_embeds"])  # [1, T, D]
        new = embeds[:, :, : heads * head_dim].reshape(1, -1, heads, head_dim).transpose(0, 2, 1, 3)  # [1, H, T, Dh]
        keys = np.concatenate([np.asarray(views["past_keys"]), np.broadcast_to(new, (qwen.num_layers, *new.shape))], 3)
        values = np.concatenate([np.asarray(views["past_values"]), -keys[:, :, :, keys.shape[3] - new.shape[2] :]], 3)
        total = keys.astype(np.float64).sum() + values.astype(np.float64).sum()
        logits = np.arange(VOCAB)[None, None] + total + embeds.astype(np.float64).sum(axis=2)[..., None]
        return {"logits": logits.astype(np.float32), "present_keys": keys, "present_values": values}

    def output_shape(shapes, name):
        embeds, past = shapes["inputs_embeds"], shapes["past_keys"]
        if name == "logits":
            return (1, embeds[1], VOCAB)
        return (past[0], 1, past[2], past[3] + embeds[1], past[4])

    engine = FakeEngine(profiles, outputs=("logits", "present_keys", "present_values"), compute=compute,
                        output_shape=output_shape)  # fmt: skip
    return engine, profiles


def test_one_requests_decode_keeps_its_cache_on_the_device(config, counting):
    """Issue 29 item 2: the LLM plan's cache no longer round-trips through the host every token; per step
    the embeddings go up and the logits come down, the same bytes at 10 and 200 cached positions, one
    synchronize; the logits equal those of the host-fed cache (``infer`` with the whole cache)."""
    qwen = config.llm.qwen
    engine, profiles = _llm_engine(config)
    runner = TrtRunner(engine, "llm", profiles, trt=FAKE_TRT)
    reference = _llm_engine(config)[0].compute
    rng = np.random.default_rng(2)
    empty = (qwen.num_layers, 1, qwen.num_kv_heads, 0, qwen.head_dim)
    decoder = runner.kv_decoder(empty)
    past = {"past_keys": np.zeros(empty, np.float32), "past_values": np.zeros(empty, np.float32)}
    per_step: dict[int, dict[str, int]] = {}
    prompt = rng.standard_normal((1, 10, qwen.hidden_size)).astype(np.float32)
    for embeds in [prompt] + [rng.standard_normal((1, 1, qwen.hidden_size)).astype(np.float32) for _ in range(200)]:
        mark = counting.mark()
        got = decoder.step(embeds)
        counts = counting.since(mark)
        want = reference({"inputs_embeds": embeds, **past})
        past = {"past_keys": want["present_keys"], "past_values": want["present_values"]}
        assert np.allclose(got, want["logits"], rtol=1e-5, atol=1e-3), decoder.length
        if embeds.shape[1] == 1:
            per_step[decoder.length] = counts
    assert decoder.length == 210
    expected = {"to_device": qwen.hidden_size * 4, "to_host": VOCAB * 4, "device": 0, "synchronizes": 1}
    assert per_step[11] == per_step[70] == per_step[210] == expected, (per_step[11], per_step[210])
    assert engine.failures == []
    decoder.free()
