"""What crosses between host and device per decode step and per flow solve, counted with the
pessimistic fakes (tests/trt_fakes.py: ``CountingCuda`` counts bytes per direction and host
synchronizes; a profile switch drops the activation memory; events can stay "in flight").

Issue 29: per step only what is new crosses (token embeddings, lengths, logits), independent of the
cache length, with at most one synchronize per decode step; the device KV slots check their dtype
against the plan; chained Euler solves never overwrite pinned staging that is still being copied.
No GPU, no TensorRT: the engines compute in numpy on host memory standing in for device memory.
"""

from __future__ import annotations

import numpy as np
import pytest
from trt_fakes import FAKE_TRT, CountingCuda, FakeEngine, host_array

from trt_cosy.errors import EngineMismatchError
from trt_cosy.models.registry import read_release_config, trt_profiles
from trt_cosy.runtime.backends.tensorrt import cuda
from trt_cosy.runtime.backends.tensorrt.batch import DeviceKVSlots, TrtBatchLLM, cache_dtype
from trt_cosy.runtime.backends.tensorrt.runner import TrtRunner
from trt_cosy.runtime.kv_slots import PrefillCache
from trt_cosy.runtime.llm_decode import LLM_DECODE_NAME, cache_input_names, device_cache_inputs
from trt_cosy.runtime.profiles import GraphProfiles, ProfileLimits, llm_decode_profiles

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


# -- one request's LLM decode with the cache on the device (runtime.backends.tensorrt.kv) --------------------------------


def _llm_engine(config) -> tuple[FakeEngine, GraphProfiles]:
    """The ``LLM`` contract in numpy: present = past ++ the first H·Dh embeds of each new position (every
    layer), logits[0, t, v] = v + Σ present_keys + Σ embeds[0, t] (a stale or missing past shows)."""
    qwen = config.llm.qwen
    heads, head_dim = qwen.num_kv_heads, qwen.head_dim
    profiles = trt_profiles(config, ProfileLimits(max_prefill=64, max_context=256, decode_buckets=(64,)))["llm"]

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


# -- the incremental streaming flow with its cache on the device (stages.flow_incremental) -------------


def _incremental_engine(config):
    """``flow_estimator_incremental`` in numpy, reading every input: the velocity depends on the cached
    blocks (their mean), the new blocks on x and their absolute position (a misplaced append shows)."""
    from trt_cosy.runtime.graphs import FLOW_ESTIMATOR_INCREMENTAL
    from trt_cosy.runtime.incremental_profiles import incremental_profiles
    from trt_cosy.stages.flow_incremental import cache_layout

    blocks, width, channels = cache_layout(config.flow.estimator)
    profiles = incremental_profiles(config)

    def compute(views):
        x, past, tails = (np.asarray(views[n], np.float32) for n in ("x", "past_blocks", "past_tails"))
        t = np.asarray(views["t"], np.float32)
        mean = np.float32(past.mean()) if past.size else np.float32(0)
        new = x.shape[2]
        velocity = np.float32(0.5) * x + mean + t[:, None, None] + np.asarray(views["mu"]) - np.asarray(views["cond"])
        positions = np.arange(past.shape[0], past.shape[0] + new, dtype=np.float32)  # absolute frames
        new_blocks = np.broadcast_to((x[0, 0] + positions)[:, None, None, None], (new, blocks, 2, width))
        return {"estimator_out": velocity.astype(np.float32), "new_blocks": np.ascontiguousarray(new_blocks),
                "new_tails": tails + np.float32(1)}  # fmt: skip

    def output_shape(shapes, name):
        new = shapes["x"][2]
        return {"estimator_out": (2, 80, new), "new_blocks": (new, blocks, 2, width), "new_tails": (2, channels, 2)}[name]

    engine = FakeEngine(profiles, outputs=FLOW_ESTIMATOR_INCREMENTAL.output_names, compute=compute,
                        output_shape=output_shape)  # fmt: skip
    return engine, profiles


class _HostRunner:
    """The same numpy graph as a plain ``Runner`` (``infer``): the host path of the solve."""

    def __init__(self, engine):
        self.engine = engine
        self.input_names, self.output_names = engine.inputs, engine.outputs

    def infer(self, feed):
        return self.engine.compute(feed)


def test_the_incremental_flow_cache_stays_on_the_device(config, counting):
    """Issue 29 item 1: past_blocks bound to the device store, new blocks appended device to device;
    the mel equals the host cache's bit for bit, and a chunk of 50 new frames moves the same bytes at
    50 and at 100 cached frames (nothing grows with the cache)."""
    from trt_cosy.runtime.backends.tensorrt.runner import BOUND_INPUTS
    from trt_cosy.stages.flow import cosine_t_span
    from trt_cosy.stages.flow_incremental import FlowCache, solve_euler_incremental

    engine, profiles = _incremental_engine(config)
    runner = TrtRunner(engine, "flow_estimator_incremental", profiles, trt=FAKE_TRT,
                       external=BOUND_INPUTS["flow_estimator_incremental"])  # fmt: skip
    assert "past_blocks" not in runner._slots[0].device  # no buffer at the profile maximum for it
    host = _HostRunner(_incremental_engine(config)[0])
    steps = config.flow.cfm.n_timesteps
    caches = FlowCache(config.flow.estimator, steps), FlowCache(config.flow.estimator, steps)
    rng = np.random.default_rng(3)
    total = 150
    mu, cond = (rng.standard_normal((1, 80, total)).astype(np.float32) for _ in range(2))
    spks, noise = rng.standard_normal((1, 80)).astype(np.float32), rng.standard_normal((1, 80, total)).astype(np.float32)
    per_chunk = []
    for end in (50, 100, 150):
        args = (mu[:, :, :end], spks, cond[:, :, :end], noise[:, :, :end], cosine_t_span(steps), 0.7)
        mark = counting.mark()
        got = solve_euler_incremental(runner, caches[0], *args)
        per_chunk.append(counting.since(mark))
        want = solve_euler_incremental(host, caches[1], *args)
        np.testing.assert_array_equal(got, want)
    assert caches[0].device is not None and caches[0].device.frames == [150] * steps
    assert caches[1].device is None and caches[0]._blocks == []  # the host cache never held device frames
    assert per_chunk[1] == per_chunk[2], per_chunk  # 50 new frames after 50 or 100 cached ones
    blocks, width, _ = caches[0].blocks, caches[0].width, None
    assert per_chunk[1]["device"] == steps * 50 * blocks * 2 * width * 4  # only the appends
    assert per_chunk[1]["synchronizes"] == steps  # one per Euler step (the update is on the host)
    assert engine.failures == []
    caches[0].release()
    assert caches[0].device is None


def test_a_device_voice_prefix_is_cloned_per_request_and_a_host_one_uploaded_once(config, counting):
    from trt_cosy.runtime.backends.tensorrt.runner import BOUND_INPUTS
    from trt_cosy.stages.flow import cosine_t_span
    from trt_cosy.stages.flow_incremental import FlowCache, solve_euler_incremental

    engine, profiles = _incremental_engine(config)
    runner = TrtRunner(engine, "flow_estimator_incremental", profiles, trt=FAKE_TRT,
                       external=BOUND_INPUTS["flow_estimator_incremental"])  # fmt: skip
    host = _HostRunner(_incremental_engine(config)[0])
    steps, rng = config.flow.cfm.n_timesteps, np.random.default_rng(4)
    mu, cond, noise = (rng.standard_normal((1, 80, 100)).astype(np.float32) for _ in range(3))
    spks = rng.standard_normal((1, 80)).astype(np.float32)
    args = lambda end: (mu[:, :, :end], spks, cond[:, :, :end], noise[:, :, :end], cosine_t_span(steps), 0.7)  # noqa: E731
    want = FlowCache(config.flow.estimator, steps)
    solve_euler_incremental(host, want, *args(50))
    expected = solve_euler_incremental(host, want, *args(100))
    for prefix_runner in (runner, host):  # a prefix computed on the device, then one on the host
        prefix = FlowCache(config.flow.estimator, steps)
        solve_euler_incremental(prefix_runner, prefix, *args(50))
        request = FlowCache(config.flow.estimator, steps)
        request.load(prefix)
        np.testing.assert_array_equal(solve_euler_incremental(runner, request, *args(100)), expected)
        assert request.device.frames == [100] * steps
        if prefix.device is not None:
            assert prefix.device.frames == [50] * steps  # the shared prefix is never extended
    assert engine.failures == []


# -- CUDA graphs for the decode step (TrtRunner.enqueue(graph=True)) ---------------------------------------


def _stepper(config, rows: int = 2):
    qwen = config.llm.qwen
    runner = _decode_runner(config)
    slots = DeviceKVSlots(4, qwen.num_layers, qwen.num_kv_heads, LIMITS.max_context, qwen.head_dim)
    rng = np.random.default_rng(6)
    caches = [_cache(config, 20 + row, rng) for row in range(rows)]
    for cache in caches:
        slots.add(cache)
    embeds = rng.standard_normal((rows, 1, qwen.hidden_size)).astype(np.float32)
    stepper = TrtBatchLLM(None, runner, qwen.num_layers).decoder(slots, VOCAB)
    return runner, slots, caches, embeds, stepper


def _want(config, caches, embeds, steps_before: int) -> np.ndarray:
    part = embeds[:, 0, : config.llm.qwen.num_kv_heads * config.llm.qwen.head_dim].astype(np.float64)
    cached = np.array([float(np.asarray(c.keys[0], np.float64).sum()) for c in caches]) + steps_before * part.sum(1)
    return np.arange(VOCAB)[None] + (embeds[:, 0].astype(np.float64).sum(1) + cached)[:, None]  # [B, V]


def test_the_decode_step_is_captured_once_and_replayed(config, counting):
    """Issue 29 item 4: per (profile, B, P) the first step launches plainly (TensorRT wants one launch
    after a shape change before a capture), the second captures and replays, later ones only replay;
    the replayed graph reads the KV slots and writes the logits as a launch does."""
    runner, slots, caches, embeds, stepper = _stepper(config)
    (context,) = runner.engine.live_contexts
    for step in range(5):
        got = stepper.step(embeds)
        assert np.allclose(got, _want(config, caches, embeds, step), rtol=1e-5, atol=1e-3), step
    kinds = [call[0] for call in counting.calls]
    assert kinds.count("begin_capture") == kinds.count("end_capture") == 1, kinds
    assert kinds.count("graph_launch") == 4 and counting.replays == 4
    assert [call[0] for call in context.calls].count("execute") == 2  # the plain launch and the captured one
    assert runner.engine.failures == []
    slots.free()


def test_a_failed_capture_falls_back_to_plain_launches(config, counting, monkeypatch, caplog):
    runner, slots, caches, embeds, stepper = _stepper(config)
    monkeypatch.setattr(counting, "cudaStreamBeginCapture", lambda stream, mode: (counting.cudaError_t.cudaErrorStreamCaptureUnsupported,))
    for step in range(4):
        assert np.allclose(stepper.step(embeds), _want(config, caches, embeds, step), rtol=1e-5, atol=1e-3)
    assert "CUDA graph capture failed" in caplog.text and counting.replays == 0 and not runner._graphs
    assert runner.engine.failures == []
    slots.free()
