"""DeviceEulerLoop: the whole Euler solve queued on a step runner's stream, no host synchronisation inside.

A real ``TrtRunner`` over a fake step engine whose ``execute_async_v3`` computes the guided Euler
step in numpy on the bound addresses, with fake cuda bindings over host memory (every call logged);
on a GPU, the same loop over real cuda-python memory and streams with a copy step (no TensorRT).
The numpy estimator and the inputs are those of tests/test_flow_step.py (tests/_flow_step_support.py).
"""

from __future__ import annotations

import ctypes
import enum
import gc
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _flow_step_support import CFG_RATE, MELS, _host_solve, _inputs, _NumpyEstimator, _scaled_error, _velocity
from trt_fakes import FAKE_TRT, FakeContext, FakeEngine, aligned_block

from trt_cosy.config import ModelConfig
from trt_cosy.models.registry import read_release_config, trt_profiles
from trt_cosy.runtime.backends.tensorrt import cuda
from trt_cosy.runtime.backends.tensorrt.euler import (
    TIME_STRIDE,
    DeviceEulerLoop,
    guidance_feed,
    step_schedule,
)
from trt_cosy.runtime.backends.tensorrt.runner import TrtRunner
from trt_cosy.runtime.graphs import FLOW_ESTIMATOR, FLOW_STEP
from trt_cosy.runtime.profiles import GraphProfiles, ShapeProfile, step_profiles
from trt_cosy.stages.flow import cosine_t_span

# -- fake cuda bindings and a fake step engine -----------------------------------------------------------


class _Err(enum.IntEnum):
    cudaSuccess = 0


class _FakeCuda:
    """``cuda.bindings.runtime`` over host memory: copies are memmoves; every call is logged."""

    cudaError_t = _Err
    cudaStreamNonBlocking, cudaEventDisableTiming, cudaEventDefault = 1, 2, 0
    cudaMemcpyKind = SimpleNamespace(
        cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2, cudaMemcpyDeviceToDevice=3
    )
    OK = (_Err.cudaSuccess,)

    def __init__(self):
        self.blocks, self.calls, self.handles = {}, [], 100

    def _handle(self):
        self.handles += 1
        return (_Err.cudaSuccess, self.handles)

    def cudaMalloc(self, size):
        return (_Err.cudaSuccess, aligned_block(self.blocks, size))  # 256-byte aligned, as cudaMalloc's

    cudaMallocHost = cudaMalloc

    def cudaFree(self, ptr):
        self.blocks.pop(ptr)
        return self.OK

    cudaFreeHost = cudaFree

    def cudaMemcpyAsync(self, dst, src, count, kind, stream):
        ctypes.memmove(dst, src, count)
        self.calls.append(("copy", kind, count, src, dst))
        return self.OK

    def cudaStreamCreateWithFlags(self, flags):
        return self._handle()

    def cudaEventCreateWithFlags(self, flags):
        return self._handle()

    def cudaStreamSynchronize(self, stream):
        self.calls.append(("synchronize", stream))
        return self.OK

    def cudaEventSynchronize(self, event):
        self.calls.append(("synchronize", event))
        return self.OK

    def cudaStreamWaitEvent(self, stream, event, flags):
        self.calls.append(("wait", stream, event))
        return self.OK

    def cudaEventRecord(self, event, stream):
        self.calls.append(("record", event, stream))
        return self.OK

    def cudaEventQuery(self, event):
        return self.OK  # host memory: everything queued has already happened

    def cudaStreamDestroy(self, handle):
        return self.OK

    cudaEventDestroy = cudaStreamDestroy

    def count(self, kind: str) -> int:
        return sum(1 for call in self.calls if call[0] == kind)


def _array(ptr: int, shape: tuple[int, ...]) -> np.ndarray:
    count = int(np.prod(shape))
    return np.frombuffer((ctypes.c_float * count).from_address(ptr), np.float32).reshape(shape)


class _FakeStepContext(FakeContext):
    """Runs one guided Euler step in numpy on the bound "device" addresses (tests/trt_fakes.py's
    context, so a shared profile, a launch on an unsynchronised stream, a misaligned or unset address
    and missing activation memory all fail as they do on TensorRT)."""

    def run(self, stream_handle):
        values = {name: _array(self.addresses[name], shape) for name, shape in self.shapes.items()}
        x, t, dt = values["x"], values["t"], values["dt"]  # [1, 80, F], [1], [1]
        pair = {**values, "x": np.concatenate([x, x]), "t": np.repeat(t, 2)}
        velocity = _velocity(*(pair[n] for n in FLOW_ESTIMATOR.input_names))  # [2, 80, F]
        guided, unguided = np.float32(1.0 + CFG_RATE), np.float32(CFG_RATE)
        velocity = guided * velocity[0:1] - unguided * velocity[1:2]  # [1, 80, F]
        _array(self.addresses["x_next"], x.shape)[...] = x + dt[0] * velocity
        self.engine.log.append(("execute", dict(self.addresses), float(t[0]), float(dt[0])))


def _step_engine(log: list, profiles: GraphProfiles, slots: int, context=_FakeStepContext) -> FakeEngine:
    engine = FakeEngine(
        profiles,
        outputs=FLOW_STEP.output_names,
        compute=None,
        output_shape=lambda shapes, name: shapes["x"],  # x_next: [1, 80, F]
        slots=slots,
        context=context,
    )
    engine.log = log  # the step log shares the cuda calls' list, so launches and copies are ordered
    return engine


def _estimator_profiles() -> GraphProfiles:
    def profile(name: str, frames: tuple[int, int, int]) -> ShapeProfile:
        wide = tuple((2, MELS, f) for f in frames)
        mask = tuple((2, 1, f) for f in frames)
        shapes = {
            "x": wide,
            "mask": mask,
            "mu": wide,
            "t": ((2,),) * 3,
            "spks": ((2, MELS),) * 3,
            "cond": wide,
        }
        return ShapeProfile(name, shapes)

    return GraphProfiles("flow_estimator", (profile("stream", (1, 8, 24)), profile("long", (1, 32, 64))))


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = _FakeCuda()
    monkeypatch.setattr(cuda, "_BINDINGS", fake)
    yield fake
    gc.collect()  # fake "device" memory must never reach the real bindings' cudaFree (a crash on a GPU)


@pytest.fixture
def step_runner(fake_cuda):
    profiles = step_profiles(_estimator_profiles(), "flow_step")
    with TrtRunner(
        _step_engine(fake_cuda.calls, profiles, slots=2), "flow_step", profiles, trt=FAKE_TRT, slots=2
    ) as runner:
        yield runner
    assert runner.engine.failures == [], runner.engine.failures


def test_step_profiles_keep_the_estimator_ranges(v2_tiny_dir):
    estimator = trt_profiles(read_release_config(v2_tiny_dir))["flow_estimator"]
    step = step_profiles(estimator, "flow_step")
    step.check_spec(FLOW_STEP)
    assert [p.name for p in step.profiles] == [p.name for p in estimator.profiles]
    for ours, theirs in zip(step.profiles, estimator.profiles, strict=True):
        assert ours.shapes["x"] == tuple((1, *shape[1:]) for shape in theirs.shapes["x"])
        assert ours.shapes["t"] == ours.shapes["dt"] == ((1,),) * 3
        assert all(ours.shapes[n] == theirs.shapes[n] for n in ("mask", "mu", "spks", "cond"))


@pytest.mark.parametrize(("steps", "frames"), [(10, 20), (3, 40)])  # even/odd steps, both profiles
def test_device_loop_reproduces_solve_euler_without_host_syncs(fake_cuda, step_runner, steps, frames):
    schedule = step_schedule(cosine_t_span(steps))
    with DeviceEulerLoop(step_runner, schedule) as loop:
        _check_solves(fake_cuda, loop, schedule, frames)


def _check_solves(fake_cuda, loop: DeviceEulerLoop, schedule: np.ndarray, frames: int) -> None:
    steps = schedule.shape[0]
    table_bytes = 2 * steps * TIME_STRIDE
    inputs = _inputs(frames, seed=steps)
    feed = guidance_feed(inputs["noise"], inputs["mu"], inputs["mask"], inputs["spks"], inputs["cond"])
    expected = _host_solve(_NumpyEstimator(), inputs, steps)
    for attempt in range(2):  # the second solve reuses the uploaded schedule
        fake_cuda.calls.clear()
        got = loop.run(feed)
        error = _scaled_error(got, expected)
        assert error <= 1e-7, f"device loop vs solve_euler (attempt {attempt}): max error {error:.3e}"
        assert fake_cuda.count("synchronize") == 1, fake_cuda.calls  # only the final download waits
        executes = [c for c in fake_cuda.calls if c[0] == "execute"]
        assert len(executes) == steps
        ping, pong = executes[0][1]["x"], executes[0][1]["x_next"]
        assert ping != pong
        for step, (_, addresses, t, dt) in enumerate(executes):
            assert (t, dt) == (schedule[step, 0], schedule[step, 1])
            assert addresses["dt"] - addresses["t"] == TIME_STRIDE
            assert addresses["t"] == executes[0][1]["t"] + 2 * step * TIME_STRIDE  # 256-byte aligned rows
            assert (addresses["x"], addresses["x_next"]) == ((ping, pong) if step % 2 == 0 else (pong, ping))
        uploads = [c for c in fake_cuda.calls if c[0] == "copy" and c[2] == table_bytes]
        assert uploads == [], "the schedule is uploaded once, at construction"


def test_device_loop_uploads_the_schedule_once_and_hands_off_with_an_event(fake_cuda, step_runner):
    steps, frames = 5, 12
    with DeviceEulerLoop(step_runner, step_schedule(cosine_t_span(steps))) as loop, cuda.Event() as upstream:
        h2d = [c for c in fake_cuda.calls if c[0] == "copy" and c[1] == 1]
        assert len(h2d) == 1 and h2d[0][2] == 2 * steps * TIME_STRIDE, h2d  # one upload of the whole table
        inputs = _inputs(frames, seed=3)
        feed = guidance_feed(inputs["noise"], inputs["mu"], inputs["mask"], inputs["spks"], inputs["cond"])
        fake_cuda.calls.clear()
        with step_runner.slot() as slot:
            out = loop.enqueue(feed, slot, after=upstream)
        stream = step_runner.stream(slot).handle
        assert fake_cuda.count("synchronize") == 0, fake_cuda.calls  # nothing waits on the host
        kinds = [c[0] for c in fake_cuda.calls]
        assert kinds.index("wait") < kinds.index("copy") and kinds[-1] == "record", kinds
        assert fake_cuda.calls[kinds.index("wait")] == ("wait", stream, upstream.handle)
        executes = [c for c in fake_cuda.calls if c[0] == "execute"]
        assert out.ptr == executes[-1][1]["x_next"] and out.shape == (1, MELS, frames)  # odd n: x_next buffer
        assert fake_cuda.calls[-1] == ("record", out.event.handle, stream)
        expected = _host_solve(_NumpyEstimator(), inputs, steps)
        error = _scaled_error(_array(out.ptr, out.shape).copy(), expected)
        assert error <= 1e-7, f"handed-off x vs solve_euler: max error {error:.3e}"


# -- on a GPU (cuda-python only: the step is a device copy, TensorRT is not needed) ----------------------

_NO_CUDA = cuda.cuda_unavailable_reason()


class _CountingBindings:
    """The real cuda bindings, with stream synchronizes counted."""

    def __init__(self, runtime):
        self._runtime, self.synchronizes = runtime, 0

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def cudaStreamSynchronize(self, stream):
        self.synchronizes += 1
        return self._runtime.cudaStreamSynchronize(stream)


def _device_copy_context(log_ptr: int):
    """A context whose step queues, on the launch stream: x_next = x, and t, dt appended to a log."""

    class _Context(_FakeStepContext):
        launches = 0  # shared by the contexts of one engine: one log

        def run(self, stream):
            runtime, entry = cuda.bindings(), log_ptr + 8 * _Context.launches
            kind = runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice
            nbytes = 4 * int(np.prod(self.shapes["x"]))
            a = self.addresses
            for target, source, count in (
                (a["x_next"], a["x"], nbytes),
                (entry, a["t"], 4),
                (entry + 4, a["dt"], 4),
            ):
                cuda.cuda_call(runtime.cudaMemcpyAsync(target, source, count, kind, stream))
            _Context.launches += 1
            self.engine.log.append(("execute", dict(a)))

    return _Context


def _download(ptr: int, count: int) -> np.ndarray:
    runtime = cuda.bindings()
    host = np.empty(count, np.float32)
    kind = runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost
    cuda.cuda_call(runtime.cudaMemcpy(host.ctypes.data, ptr, host.nbytes, kind))
    return host


@pytest.mark.gpu
@pytest.mark.skipif(_NO_CUDA is not None, reason=f"needs a CUDA device and cuda-python: {_NO_CUDA}")
def test_device_loop_on_a_gpu(monkeypatch):
    counting = _CountingBindings(cuda.bindings())
    monkeypatch.setattr(cuda, "_BINDINGS", counting)
    steps, frames, calls = 10, 300, []
    schedule = step_schedule(cosine_t_span(steps))
    with cuda.DeviceBuffer(2 * 8 * steps) as log:
        profiles = step_profiles(trt_profiles(_tiny_config())["flow_estimator"], "flow_step")
        engine = _step_engine(calls, profiles, 1, _device_copy_context(log.ptr))
        runner = TrtRunner(engine, "flow_step", profiles, trt=FAKE_TRT, slots=1)
        loop = DeviceEulerLoop(runner, schedule)
        inputs = _inputs(frames)
        feed = guidance_feed(inputs["noise"], inputs["mu"], inputs["mask"], inputs["spks"], inputs["cond"])
        before = counting.synchronizes
        got = loop.run(feed)
        assert counting.synchronizes == before + 1, "one synchronize per solve, after the last step"
        assert np.array_equal(got, feed["x"]), "identity steps must return x0 through the ping-pong"
        with runner.slot() as slot:
            out = loop.enqueue(feed, slot)
            assert counting.synchronizes == before + 1
            out.event.synchronize()
            handed = _download(out.ptr, int(np.prod(out.shape))).reshape(out.shape)
        assert np.array_equal(handed, feed["x"])
        logged = _download(log.ptr, 4 * steps).reshape(2, steps, 2)  # [solve, step, (t, dt)]
        assert np.array_equal(logged[0], schedule) and np.array_equal(logged[1], schedule), logged
        bound = [c[1] for c in calls if c[0] == "execute"]
        assert len(bound) == 2 * steps and all(p % 256 == 0 for b in bound for p in b.values()), bound
        loop.free()
        runner.free()


def _tiny_config() -> ModelConfig:
    return read_release_config(Path(__file__).parent / "data" / "cosyvoice2-tiny")


# -- FlowStage on the device loop ------------------------------------------------------------------------


class _FakeEncoder:
    """The flow-encoder contract: mu [1, 80, 2N] and spks [1, 80] from the N tokens, deterministic."""

    name = "flow_encoder"
    input_names = ("tokens", "context", "context_valid", "streaming", "embedding")
    output_names = ("mu", "spks")

    def infer(self, feed):
        tokens = feed["tokens"].astype(np.float32)  # [1, N]
        frames = np.repeat(tokens, 2, axis=1)  # [1, 2N]
        mu = np.sin(frames[:, None, :] * np.arange(1, MELS + 1, dtype=np.float32)[None, :, None] / 7)
        spks = np.cos(np.arange(MELS, dtype=np.float32) / 5)[None]  # [1, 80]
        return {"mu": mu.astype(np.float32), "spks": spks.astype(np.float32)}


def test_flow_stage_uses_the_device_loop_and_matches_the_host_loop(fake_cuda, step_runner):
    from trt_cosy.stages.flow import FlowStage, device_euler_loops

    config = _tiny_config().flow
    assert config.cfm.inference_cfg_rate == CFG_RATE  # the fake step engine bakes this rate in
    noise = np.random.default_rng(4).standard_normal((1, MELS, 64), dtype=np.float32)  # [1, 80, 64]
    args = dict(
        tokens=np.arange(3, 13, dtype=np.int64)[None],  # [1, 10]
        prompt_tokens=np.array([[1, 2, 5, 7]], np.int64),  # [1, 4]
        prompt_feat=np.random.default_rng(5).standard_normal((1, 8, MELS), dtype=np.float32),  # [1, 8, 80]
        embedding=np.zeros((1, 192), np.float32),
        streaming=False,
        finalize=True,
    )
    loops = device_euler_loops({"flow_step": step_runner}, config)
    assert set(loops) == {False}, loops  # only the plans that exist get a loop
    host = FlowStage(_FakeEncoder(), _NumpyEstimator(), _NumpyEstimator(), noise, config)
    device = FlowStage(_FakeEncoder(), None, None, noise, config, step_loops=loops)
    expected = host.token2mel(**args).mel  # [1, 80, 20]
    fake_cuda.calls.clear()
    got = device.token2mel(**args).mel
    error = _scaled_error(got, expected)
    assert error <= 1e-7, f"FlowStage on the device loop vs the host loop: max error {error:.3e}"
    assert fake_cuda.count("synchronize") == 1, "one synchronize per solve"
    assert sum(1 for c in fake_cuda.calls if c[0] == "execute") == config.cfm.n_timesteps
    assert device_euler_loops({}, config) == {}  # ONNX Runtime / torch runners: the host loop
    for loop in loops.values():
        loop.free()


def test_chained_solves_never_overwrite_pinned_staging_in_flight(fake_cuda, step_runner, monkeypatch):
    """Issue 29 item 9: two enqueues on one slot without a synchronize between them. The second must
    wait (on the host) for the event after the first one's uploads before it writes the pinned
    staging buffers again; where the event has passed, nothing waits."""
    steps, frames = 3, 12
    inputs = _inputs(frames, seed=4)
    feed = guidance_feed(inputs["noise"], inputs["mu"], inputs["mask"], inputs["spks"], inputs["cond"])
    with DeviceEulerLoop(step_runner, step_schedule(cosine_t_span(steps))) as loop:
        with step_runner.slot() as slot:
            fake_cuda.calls.clear()
            loop.enqueue(feed, slot)
            assert fake_cuda.count("synchronize") == 0  # the first solve has nothing to wait for
            staged = next(c for c in fake_cuda.calls if c[0] == "record")[1]  # recorded after the uploads
            monkeypatch.setattr(fake_cuda, "cudaEventQuery", lambda event: (600,))  # still in flight
            monkeypatch.setattr(fake_cuda.cudaError_t, "cudaErrorNotReady", 600, raising=False)
            fake_cuda.calls.clear()
            loop.enqueue(feed, slot)
            kinds = [c[0] for c in fake_cuda.calls]
            assert ("synchronize", staged) in fake_cuda.calls, fake_cuda.calls
            first_upload = next(i for i, c in enumerate(fake_cuda.calls) if c[0] == "copy" and c[1] == 1)
            assert kinds.index("synchronize") < first_upload, kinds  # waited before overwriting staging
            monkeypatch.setattr(fake_cuda, "cudaEventQuery", lambda event: (0,))  # passed: no wait
            fake_cuda.calls.clear()
            loop.enqueue(feed, slot)
            assert fake_cuda.count("synchronize") == 0, fake_cuda.calls


def test_a_solve_moves_the_same_bytes_whatever_its_step_count(monkeypatch):
    """Per solve, counted with tests/trt_fakes.CountingCuda: the inputs up once and x down once, one
    synchronize; the (t, dt) schedule is on the device, so 3 and 10 steps move the same bytes."""
    from trt_fakes import CountingCuda

    counting = CountingCuda()
    monkeypatch.setattr(cuda, "_BINDINGS", counting)
    frames, moved = 12, {}
    inputs = _inputs(frames, seed=5)
    feed = guidance_feed(inputs["noise"], inputs["mu"], inputs["mask"], inputs["spks"], inputs["cond"])
    profiles = step_profiles(_estimator_profiles(), "flow_step")
    for steps in (3, 10):
        with TrtRunner(_step_engine([], profiles, slots=1), "flow_step", profiles, trt=FAKE_TRT) as runner:
            with DeviceEulerLoop(runner, step_schedule(cosine_t_span(steps))) as loop:
                loop.run(feed)  # the first solve selects the profile
                mark = counting.mark()
                loop.run(feed)
                moved[steps] = counting.since(mark)
            assert runner.engine.failures == []
    up = sum(np.asarray(value).nbytes for value in feed.values())  # t and dt: bound from the table
    assert moved[3] == moved[10] == {"to_device": up, "to_host": feed["x"].nbytes, "device": 0,
                                     "synchronizes": 1}, moved  # fmt: skip
    gc.collect()
