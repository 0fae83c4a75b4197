"""The Euler step on the device as CUDA graphs (issue 29 items 1 and 4), counted with the pessimistic fakes.

``tests/trt_fakes.CountingCuda`` counts host<->device bytes when copies run (a replayed copy too) and
host synchronizes, records stream captures and replays them, refuses host copies and synchronizes
while capturing, and checks a graph update's topology; ``FakeContext`` refuses a capture that comes
before a plain launch after a shape change. The step engines compute in numpy on host memory standing
in for device memory: the incremental chunk (``DeviceIncrementalLoop``: x, the velocity, the cache
and its tails on the device) is compared bit for bit with the host Euler loop of
``stages.flow_incremental``; per chunk the bytes do not grow with the cache and there is one
synchronize; a failed capture falls back to plain launches with one log line.
"""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
from trt_fakes import FAKE_TRT, CountingCuda, FakeEngine

from trt_cosy.models.registry import read_release_config
from trt_cosy.runtime.backends.tensorrt import cuda
from trt_cosy.runtime.backends.tensorrt.euler import step_schedule
from trt_cosy.runtime.backends.tensorrt.euler_incremental import DeviceIncrementalLoop
from trt_cosy.runtime.backends.tensorrt.runner import BOUND_INPUTS, TrtRunner
from trt_cosy.runtime.graphs import FLOW_ESTIMATOR_INCREMENTAL, FLOW_STEP_INCREMENTAL
from trt_cosy.runtime.profiles import step_profiles
from trt_cosy.stages.flow import cosine_t_span
from trt_cosy.stages.flow_incremental import FlowCache, cache_layout, solve_euler_incremental

CFG = 0.7


@pytest.fixture
def counting(monkeypatch) -> CountingCuda:
    fake = CountingCuda()
    monkeypatch.setattr(cuda, "_BINDINGS", fake)
    yield fake
    gc.collect()  # fake "device" memory must never reach real bindings


@pytest.fixture(scope="module")
def config(v2_tiny_dir):
    return read_release_config(v2_tiny_dir)


def _estimator(config):
    """The incremental estimator in numpy, reading every input: the velocity depends on the cached
    blocks (their mean) and tails, the new blocks on x and their absolute frame (a misplaced append or
    stale tails show)."""
    blocks, width, _ = cache_layout(config.flow.estimator)

    def compute(views):
        x, past, tails = (np.asarray(views[n], np.float32) for n in ("x", "past_blocks", "past_tails"))
        t = np.asarray(views["t"], np.float32)
        mean = np.float32(past.mean()) if past.size else np.float32(0)
        velocity = np.float32(0.5) * x + mean + np.float32(tails.mean()) + t[:, None, None]
        velocity = (
            velocity
            + np.asarray(views["mu"])
            - np.asarray(views["cond"])
            + np.asarray(views["spks"])[:, :, None]
        )
        new = x.shape[2]
        positions = np.arange(past.shape[0], past.shape[0] + new, dtype=np.float32)  # absolute frames
        new_blocks = np.broadcast_to((x[0, 0] + positions)[:, None, None, None], (new, blocks, 2, width))
        return {"estimator_out": velocity.astype(np.float32), "new_blocks": np.ascontiguousarray(new_blocks),
                "new_tails": tails + np.float32(1)}  # fmt: skip

    return compute


class _HostRunner:
    """The numpy estimator as a plain ``Runner``: the host Euler loop of the incremental chunk."""

    input_names = FLOW_ESTIMATOR_INCREMENTAL.input_names
    output_names = FLOW_ESTIMATOR_INCREMENTAL.output_names

    def __init__(self, config):
        self.compute = _estimator(config)

    def infer(self, feed):
        return self.compute(feed)


def _step_runner(config) -> TrtRunner:
    """``flow_step_incremental`` in numpy: the estimator, then the guidance and the Euler update in
    ``solve_euler``'s float32 order (what ``builder.flow_step`` adds to the graph)."""
    from trt_cosy.runtime.incremental_profiles import incremental_profiles

    estimator = _estimator(config)
    _, _, channels = cache_layout(config.flow.estimator)
    profiles = step_profiles(incremental_profiles(config), FLOW_STEP_INCREMENTAL.name)

    def compute(views):
        x, t = np.asarray(views["x"]), np.asarray(views["t"])  # [1, 80, T], [1]
        out = estimator({**views, "x": np.concatenate([x, x]), "t": np.repeat(t, 2)})
        velocity = out["estimator_out"]  # [2, 80, T]
        guided, unguided = np.float32(1.0 + CFG), np.float32(CFG)
        velocity = guided * velocity[0:1] - unguided * velocity[1:2]  # [1, 80, T]
        x_next = x + np.asarray(views["dt"])[0] * velocity
        return {
            "x_next": x_next.astype(np.float32),
            "new_blocks": out["new_blocks"],
            "new_tails": out["new_tails"],
        }

    def output_shape(shapes, name):
        new = shapes["x"][2]
        blocks = shapes["past_blocks"][1:]
        return {"x_next": (1, 80, new), "new_blocks": (new, *blocks), "new_tails": (2, channels, 2)}[name]

    engine = FakeEngine(profiles, outputs=FLOW_STEP_INCREMENTAL.output_names, compute=compute,
                        output_shape=output_shape)  # fmt: skip
    return TrtRunner(engine, FLOW_STEP_INCREMENTAL.name, profiles, trt=FAKE_TRT,
                     external=BOUND_INPUTS[FLOW_STEP_INCREMENTAL.name])  # fmt: skip


def _inputs(total: int, seed: int = 3):
    rng = np.random.default_rng(seed)
    mu, cond, noise = (rng.standard_normal((1, 80, total)).astype(np.float32) for _ in range(3))
    return mu, rng.standard_normal((1, 80)).astype(np.float32), cond, noise


def _chunk(solver, cache, inputs, end: int, steps: int) -> np.ndarray:
    mu, spks, cond, noise = inputs
    return solve_euler_incremental(solver, cache, mu[:, :, :end], spks, cond[:, :, :end], noise[:, :, :end],
                                   cosine_t_span(steps), CFG)  # fmt: skip


def test_an_incremental_chunk_runs_on_the_device_with_one_synchronize(config, counting, caplog):
    """Three chunks of 50 new frames: the mel equals the host loop's bit for bit; the second and third
    chunks (after 50 and 100 cached frames) move the same bytes: the new frames' inputs up and their mel
    down once, the appends device to device, and one synchronize per chunk; each step after the first
    of a chunk is captured, then updated with the chunk's shapes and addresses, never instantiated again."""
    steps = config.flow.cfm.n_timesteps
    runner = _step_runner(config)
    loop = DeviceIncrementalLoop(runner, step_schedule(cosine_t_span(steps)))
    device, host = FlowCache(config.flow.estimator, steps), FlowCache(config.flow.estimator, steps)
    inputs = _inputs(150)
    per_chunk = []
    with caplog.at_level(logging.WARNING):
        for end in (50, 100, 150):
            mark = counting.mark()
            got = _chunk(loop, device, inputs, end, steps)
            per_chunk.append(counting.since(mark))
            np.testing.assert_array_equal(got, _chunk(_HostRunner(config), host, inputs, end, steps))
    assert "CUDA graph capture failed" not in caplog.text
    assert device.device.frames == [150] * steps and device._blocks == []
    assert per_chunk[1] == per_chunk[2], per_chunk
    frame_bytes = device.blocks * 2 * device.width * 4
    new = 50
    assert per_chunk[1] == {
        "to_device": 4 * (80 * new + 2 * 80 * new + 2 * 80 + 2 * 80 * new),  # x0, mu, spks, cond (CFG pairs)
        "to_host": 4 * 80 * new,  # the new frames' mel
        "device": steps * new * frame_bytes,  # the appends only: x, tails and velocity never move
        "synchronizes": 1,
    }, per_chunk[1]
    assert runner.graph_counts == {"plain": 3, "captured": steps - 1, "updated": 2 * (steps - 1),
                                   "replayed": 0}, runner.graph_counts  # fmt: skip
    assert counting.instantiations == steps - 1 and counting.replays == 3 * (steps - 1)
    assert runner.engine.failures == []
    loop.free()
    device.release()


def test_a_voice_prefix_on_the_device_carries_its_tails(config, counting):
    """A prefix solved on the device, cloned into a request's cache (blocks and both tail sets), then
    extended: the mel equals the host loop over the same prefix, and the prefix is never extended."""
    steps = config.flow.cfm.n_timesteps
    loop = DeviceIncrementalLoop(_step_runner(config), step_schedule(cosine_t_span(steps)))
    inputs = _inputs(100, seed=4)
    want = FlowCache(config.flow.estimator, steps)
    _chunk(_HostRunner(config), want, inputs, 50, steps)
    expected = _chunk(_HostRunner(config), want, inputs, 100, steps)
    for prefix_solver in (loop, _HostRunner(config)):  # a device prefix, then a host one (uploaded once)
        prefix = FlowCache(config.flow.estimator, steps)
        _chunk(prefix_solver, prefix, inputs, 50, steps)
        request = FlowCache(config.flow.estimator, steps)
        request.load(prefix)
        np.testing.assert_array_equal(_chunk(loop, request, inputs, 100, steps), expected)
        if prefix.device is not None:
            assert prefix.device.frames == [50] * steps
    loop.free()


def test_a_failed_capture_falls_back_to_plain_launches_with_one_log_line(
    config, counting, monkeypatch, caplog
):
    steps = config.flow.cfm.n_timesteps
    runner = _step_runner(config)
    loop = DeviceIncrementalLoop(runner, step_schedule(cosine_t_span(steps)))
    refused = (counting.cudaError_t.cudaErrorStreamCaptureUnsupported,)
    monkeypatch.setattr(counting, "cudaStreamBeginCapture", lambda stream, mode: refused)
    device, host = FlowCache(config.flow.estimator, steps), FlowCache(config.flow.estimator, steps)
    inputs = _inputs(150, seed=5)
    with caplog.at_level(logging.WARNING):
        for end in (50, 100, 150):
            mark = counting.mark()
            got = _chunk(loop, device, inputs, end, steps)
            assert counting.since(mark)["synchronizes"] == (1 if end > 50 else 2)  # + the tails' upload
            np.testing.assert_array_equal(got, _chunk(_HostRunner(config), host, inputs, end, steps))
    failures = [r for r in caplog.records if "CUDA graph capture failed" in r.getMessage()]
    assert len(failures) == 1, [r.getMessage() for r in failures]
    assert counting.replays == 0 and runner.graph_counts["plain"] == 3 * steps
    assert runner.engine.failures == []
    loop.free()


def test_a_capture_right_after_a_shape_change_is_what_the_fake_refuses(config, counting):
    """The rule the runner keeps (a plain launch first after every shape change): forcing captures
    without it makes the pessimistic context refuse them, so a wrong runner would fail the tests above."""
    steps = config.flow.cfm.n_timesteps
    runner = _step_runner(config)
    loop = DeviceIncrementalLoop(runner, step_schedule(cosine_t_span(steps)))
    for state in runner._slots:
        state.fresh = False
    cache = FlowCache(config.flow.estimator, steps)
    original = runner.set_shapes

    def set_shapes_keeping_fresh_off(shapes, slot=0):
        out = original(shapes, slot)
        runner._slots[slot].fresh = False  # the rule broken on purpose
        return out

    runner.set_shapes = set_shapes_keeping_fresh_off
    _chunk(loop, cache, _inputs(50), 50, steps)
    refused = [
        c
        for c in runner.engine.live_contexts[0].calls
        if c == ("execute", "captured before a launch after the shape change")
    ]
    assert refused and not runner._graphs  # refused, then the runner fell back to plain launches
    loop.free()


def test_the_plain_euler_loop_replays_its_step_graphs_while_the_frames_stay(config, counting):
    """``DeviceEulerLoop`` (full or chunk attention, no cache): with stable addresses and the same frame
    count, the second and later solves replay every step's graph without capturing again."""
    from trt_cosy.models.registry import trt_profiles
    from trt_cosy.runtime.backends.tensorrt.euler import DeviceEulerLoop, guidance_feed
    from trt_cosy.runtime.graphs import FLOW_STEP

    steps = config.flow.cfm.n_timesteps
    profiles = step_profiles(trt_profiles(config)["flow_estimator"], FLOW_STEP.name)

    def compute(views):
        x, t, dt = (np.asarray(views[n]) for n in ("x", "t", "dt"))
        return {
            "x_next": (x + dt[0] * (np.float32(0.5) * x + t[0] + np.asarray(views["mu"])[:1])).astype(
                np.float32
            )
        }

    engine = FakeEngine(profiles, outputs=FLOW_STEP.output_names, compute=compute,
                        output_shape=lambda shapes, name: shapes["x"])  # fmt: skip
    runner = TrtRunner(engine, FLOW_STEP.name, profiles, trt=FAKE_TRT)
    loop = DeviceEulerLoop(runner, step_schedule(cosine_t_span(steps)))
    mu, spks, cond, noise = _inputs(40, seed=6)
    feed = guidance_feed(noise, mu, np.ones((1, 1, 40), np.float32), spks, cond)
    first = loop.run(feed)
    for _ in range(2):
        mark = counting.mark()
        np.testing.assert_array_equal(loop.run(feed), first)
        assert counting.since(mark)["synchronizes"] == 1
    # solve 1: step 0 plain, 1..9 captured; solve 2: step 0 captured; solve 3: every step replayed
    assert runner.graph_counts == {"plain": 1, "captured": steps, "updated": 0, "replayed": 9 + steps}
    assert engine.failures == []
    loop.free()
