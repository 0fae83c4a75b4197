"""TensorRT runtime without a GPU: cuda_call error mapping, grow-only buffers, TrtRunner bookkeeping
(profiles, shapes and addresses set only on change, preallocation from profile maxima) and plan
records, all driven by a fake ``cuda.bindings.runtime`` and a fake engine whose "device" memory is
host memory. The real GPU test at the end is marked ``gpu`` and skips with the reason."""

from __future__ import annotations

import ctypes
import enum
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
from trt_fakes import FAKE_TRT, USER_MANAGED, FakeEngine, aligned_block

from trt_cosy.errors import EngineMismatchError, InputError, MissingDependencyError, TrtCosyError
from trt_cosy.runtime.backends.tensorrt import cuda
from trt_cosy.runtime.backends.tensorrt.runner import (
    PlanRecord,
    TrtRunner,
    checkpoint_digest,
    load_tensorrt,
    plan_mismatch,
)
from trt_cosy.runtime.profiles import GraphProfiles, ShapeProfile


class _Err(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorMemoryAllocation = 2
    cudaErrorNotReady = 600
    cudaErrorInsufficientDriver = 35


class FakeCuda:
    """Enough of ``cuda.bindings.runtime``: memory is real host memory, copies are memmoves."""

    cudaError_t = _Err
    cudaStreamNonBlocking, cudaEventDisableTiming, cudaEventDefault = 1, 2, 0
    cudaMemcpyKind = SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2)

    def __init__(self, devices: int = 1, driver: int = 12080):
        self.devices, self.driver, self.blocks, self.calls = devices, driver, {}, []
        self.fail_malloc, self.handles = False, 6

    def _alloc(self, size):
        return aligned_block(self.blocks, size)  # 256-byte aligned, as cudaMalloc's are

    def _handle(self):
        self.handles += 1
        return (_Err.cudaSuccess, self.handles)

    def cudaMalloc(self, size):
        self.calls.append(("malloc", size))
        if self.fail_malloc:
            return (_Err.cudaErrorMemoryAllocation, None)
        return (_Err.cudaSuccess, self._alloc(size))

    def cudaMallocHost(self, size):
        self.calls.append(("malloc_host", size))
        return (_Err.cudaSuccess, self._alloc(size))

    def cudaFree(self, ptr):
        self.calls.append(("free", ptr))
        self.blocks.pop(ptr)
        return (_Err.cudaSuccess,)

    cudaFreeHost = cudaFree

    def cudaMemcpyAsync(self, dst, src, count, kind, stream):
        ctypes.memmove(dst, src, count)
        return (_Err.cudaSuccess,)

    def cudaGetErrorName(self, err):
        return (_Err.cudaSuccess, _Err(int(err)).name.encode())

    def cudaGetErrorString(self, err):
        return (_Err.cudaSuccess, b"out of memory" if int(err) == 2 else b"")

    def cudaGetDeviceCount(self):
        if not self.devices:
            return (_Err.cudaErrorInsufficientDriver, None)
        return (_Err.cudaSuccess, self.devices)

    def cudaDriverGetVersion(self):
        return (_Err.cudaSuccess, self.driver)

    def cudaStreamCreateWithFlags(self, flags):
        return self._handle()

    def cudaStreamSynchronize(self, stream):
        self.calls.append(("synchronize", stream))
        return (_Err.cudaSuccess,)

    def cudaStreamDestroy(self, stream):
        return (_Err.cudaSuccess,)

    def cudaStreamWaitEvent(self, stream, event, flags):
        self.calls.append(("wait", stream, event))
        return (_Err.cudaSuccess,)

    def cudaEventCreateWithFlags(self, flags):
        return self._handle()

    def cudaEventRecord(self, event, stream):
        self.calls.append(("record", event, stream))
        return (_Err.cudaSuccess,)

    def cudaEventDestroy(self, event):
        return (_Err.cudaSuccess,)

    def cudaEventQuery(self, event):
        return (_Err.cudaErrorNotReady,)


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(cuda, "_BINDINGS", fake)
    return fake


# -- cuda helpers -------------------------------------------------------------------------------------


def test_cuda_call_returns_values_and_names_errors(fake_cuda):
    assert cuda.cuda_call((_Err.cudaSuccess,)) is None
    assert cuda.cuda_call((_Err.cudaSuccess, 5)) == 5
    assert cuda.cuda_call((_Err.cudaSuccess, 1, 2)) == (1, 2)
    with pytest.raises(cuda.CudaError, match=r"cudaErrorMemoryAllocation \(2\): out of memory") as info:
        cuda.cuda_call((_Err.cudaErrorMemoryAllocation, None))
    assert info.value.code == 2 and info.value.name == "cudaErrorMemoryAllocation"


def test_device_buffer_grows_only_and_frees(fake_cuda):
    with cuda.DeviceBuffer(100) as buffer:
        assert buffer.nbytes == 256 and buffer.ptr  # rounded up to TensorRT's 256-byte alignment
        assert not buffer.resize(200)
        assert buffer.resize(1000) and buffer.nbytes == 1024
        assert not buffer.resize(10)
    assert buffer.ptr == 0 and not fake_cuda.blocks
    assert [c[0] for c in fake_cuda.calls] == ["malloc", "free", "malloc", "free"]


def test_failed_allocation_raises_cuda_error(fake_cuda):
    fake_cuda.fail_malloc = True
    with pytest.raises(cuda.CudaError, match="cudaErrorMemoryAllocation"):
        cuda.DeviceBuffer(10)


def test_pinned_view_and_events(fake_cuda):
    with cuda.PinnedBuffer(64) as pinned, cuda.Stream() as stream, cuda.Event() as event:
        view = pinned.view(np.float32, (2, 3))
        view[...] = 1.5
        assert pinned.view(np.float32, (6,)).sum() == 9.0
        with pytest.raises(ValueError, match="needs"):
            pinned.view(np.float32, (100,))
        event.record(stream)
        stream.wait(event)
        assert not event.done()
        handles = stream.handle, event.handle
    assert ("record", handles[1], handles[0]) in fake_cuda.calls
    assert ("wait", handles[0], handles[1]) in fake_cuda.calls


def test_no_gpu_is_reported_not_crashed(monkeypatch):
    monkeypatch.setattr(cuda, "_BINDINGS", FakeCuda(devices=0))
    assert cuda.device_count() == 0
    assert "cudaErrorInsufficientDriver" in cuda.gpu_unavailable_reason()
    with pytest.raises(MissingDependencyError, match=r"pip install 'trt-cosy\[gpu\]'"):
        load_tensorrt()


def test_an_old_driver_is_named_with_the_cuda_12_extra(monkeypatch):
    """cuda-python 13 on an R550-R575 driver: cudaErrorInsufficientDriver must say what to install."""
    monkeypatch.setattr(cuda, "_BINDINGS", FakeCuda(devices=0, driver=12080))
    reason = cuda.gpu_unavailable_reason()
    assert "this driver supports CUDA 12.8" in reason, reason
    assert ">= 580" in reason and "trt-cosy[gpu-cu12]" in reason, reason
    with pytest.raises(MissingDependencyError, match=r"gpu-cu12"):
        load_tensorrt()


# -- TrtRunner over a fake engine (tests/trt_fakes.py: the real bindings' failure modes) ------------------

PROFILES = GraphProfiles(
    "toy",
    (
        ShapeProfile("short", {"x": ((1, 1, 4), (1, 8, 4), (1, 16, 4))}),
        ShapeProfile("long", {"x": ((1, 1, 4), (1, 64, 4), (1, 128, 4))}),
    ),
)


def toy_engine(slots: int = 1, profiles: GraphProfiles = PROFILES, **options) -> FakeEngine:
    """y = 2 * x, y shaped like x (``output_frames`` may change y's frame count)."""
    frames = options.pop("output_frames", lambda t: t)
    return FakeEngine(
        profiles,
        outputs=("y",),
        compute=lambda v: {"y": 2.0 * np.asarray(v["x"][:, : frames(v["x"].shape[1])])},
        output_shape=lambda shapes, name: (1, frames(shapes["x"][1]), 4),
        slots=slots,
        **options,
    )


def _setters(context):
    return [c for c in context.calls if c[0] in ("profile", "shape", "address")]


def _slot_contexts(engine):
    return engine.live_contexts  # the sizing probe is gone once the runner is built


def test_runner_preallocates_from_profile_maxima_and_never_reallocates(fake_cuda):
    runner = TrtRunner(toy_engine(slots=2), "toy", PROFILES, trt=FAKE_TRT, slots=2)
    max_bytes = 1 * 128 * 4 * 4
    mallocs = [size for kind, size in fake_cuda.calls if kind == "malloc"]
    assert mallocs == [max_bytes, max_bytes, 4096] * 2, mallocs  # per slot: x, y, "short"'s activations
    before = len(fake_cuda.calls)
    for frames in (3, 16, 100, 2):
        feed = {"x": np.arange(frames * 4, dtype=np.float32).reshape(1, frames, 4)}
        out = runner.infer(feed)["y"]
        assert out.shape == (1, frames, 4) and np.array_equal(out, 2 * feed["x"])
    grown = [c for c in fake_cuda.calls[before:] if c[0].startswith("malloc")]
    assert grown == [("malloc", 8192)], grown  # only the activations of "long", once
    runner.free()
    assert not fake_cuda.blocks


def test_runner_sets_shapes_and_addresses_only_on_change(fake_cuda):
    engine = toy_engine()
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT)
    (context,) = _slot_contexts(engine)
    x5 = {"x": np.ones((1, 5, 4), np.float32)}
    runner.infer(x5)
    first = _setters(context)
    assert first[0] == ("profile", 0) and ("shape", "x", (1, 5, 4)) in first
    assert {c[1] for c in first if c[0] == "address"} == {"x", "y"}
    context.calls.clear()
    runner.infer(x5)  # same shapes, same buffers: nothing to set
    assert _setters(context) == [] and context.calls == [("execute", None)]
    runner.infer({"x": np.ones((1, 9, 4), np.float32)})  # new length, same profile
    assert _setters(context) == [("shape", "x", (1, 9, 4))]
    context.calls.clear()
    runner.infer({"x": np.ones((1, 40, 4), np.float32)})  # beyond "short": switch profile, re-set all
    assert _setters(context)[:2] == [("profile", 1), ("shape", "x", (1, 40, 4))]
    assert engine.failures == []


def test_a_profile_switch_binds_the_addresses_again(fake_cuda):
    """Issue 19 item 7: the fake forgets addresses on a profile switch; the runner must set them again."""
    engine = toy_engine()
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT)
    for frames in (5, 40, 5):  # short, long, short
        x = np.full((1, frames, 4), float(frames), np.float32)
        assert np.array_equal(runner.infer({"x": x})["y"], 2 * x)
    (context,) = _slot_contexts(engine)
    bound = [c[1] for c in context.calls if c[0] == "address"]
    assert bound.count("x") == 3 and bound.count("y") == 3, bound
    assert engine.failures == []


def test_runner_refuses_inputs_beyond_the_largest_profile(fake_cuda):
    engine = toy_engine()
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT)
    (context,) = _slot_contexts(engine)
    context.calls.clear()
    with pytest.raises(InputError, match=r"\(1, 129, 4\).*largest TensorRT profile"):
        runner.infer({"x": np.ones((1, 129, 4), np.float32)})
    assert context.calls == []  # refused before TensorRT saw it
    with pytest.raises(InputError, match="missing"):
        runner.infer({})


def test_runner_rejects_a_plan_whose_profiles_differ(fake_cuda):
    one = GraphProfiles("toy", PROFILES.profiles[:1])
    with pytest.raises(EngineMismatchError, match="profile 1 gives 'x'"):  # 2 = 1 profile x 2 slots? no:
        TrtRunner(toy_engine(), "toy", one, trt=FAKE_TRT)  # its profile 1 is "long", not "short"
    three = GraphProfiles("toy", (*PROFILES.profiles, PROFILES.profiles[0]))
    with pytest.raises(EngineMismatchError, match="2 profiles; profiles.json lists 3"):
        TrtRunner(toy_engine(), "toy", three, trt=FAKE_TRT)


def test_slots_use_separate_profiles_of_a_plan_built_per_slot(fake_cuda):
    """Issue 19 item 3: concurrent contexts must not share a profile; slot k uses k·P … k·P + P − 1."""
    engine = toy_engine(slots=2)
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT, slots=2)
    x = np.ones((1, 7, 4), np.float32)
    with runner.slot() as first, runner.slot() as second:  # both held at once: in concurrent use
        for slot in (first, second):
            runner.set_shapes({"x": x.shape}, slot)
            runner.copy_inputs({"x": x}, slot)
            runner.enqueue(slot)
    contexts = _slot_contexts(engine)
    assert [c.profile for c in contexts] == [0, 2]  # the same "short" profile, one copy per slot
    assert engine.failures == []


def test_two_threads_share_two_slots_without_sharing_a_profile(fake_cuda):
    import threading

    runner = TrtRunner(toy_engine(slots=2), "toy", PROFILES, trt=FAKE_TRT, slots=2)
    errors: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(30):
            x = rng.standard_normal((1, int(rng.integers(1, 129)), 4)).astype(np.float32)
            try:
                if not np.array_equal(runner.infer({"x": x})["y"], 2 * x):
                    errors.append(f"thread {seed}: wrong output for {x.shape}")
            except Exception as exc:  # a shared profile raises in the fake
                errors.append(f"thread {seed}: {exc!r}")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[:3]


def test_more_slots_than_the_plan_was_built_for_is_refused(fake_cuda):
    with pytest.raises(EngineMismatchError, match=r"built for 1 concurrent slot.*--slots 2"):
        TrtRunner(toy_engine(slots=1), "toy", PROFILES, trt=FAKE_TRT, slots=2)
    runner = TrtRunner(toy_engine(slots=3), "toy", PROFILES, trt=FAKE_TRT, slots=2)  # fewer: fine
    assert runner.slots == 2


def test_a_failed_profile_switch_raises_the_projects_error(fake_cuda):
    """Issue 19 item 4: the binding raises RuntimeError (never returns False)."""
    engine = toy_engine()
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT)
    engine.fail_profile_switch = True
    with pytest.raises(
        TrtCosyError, match=r"select optimization profile 0 \('short'\).*Error in set"
    ) as info:
        runner.infer({"x": np.ones((1, 3, 4), np.float32)})
    assert isinstance(info.value.__cause__, RuntimeError)
    engine.fail_profile_switch = False
    assert runner.infer({"x": np.ones((1, 3, 4), np.float32)})["y"].shape == (1, 3, 4)  # it tries again


def test_a_rejected_maximum_shape_is_refused_at_load(fake_cuda):
    """Issue 19 item 8: set_input_shape False at the max gives -1 dims; never size buffers from them."""
    with pytest.raises(EngineMismatchError, match=r"rejects its own maximum shape \(1, 16, 4\) for 'x'"):
        TrtRunner(toy_engine(reject_max=True), "toy", PROFILES, trt=FAKE_TRT)


def test_the_probe_context_reserves_no_activation_memory(fake_cuda):
    engine = toy_engine()
    TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT)
    assert engine.strategies == [USER_MANAGED, USER_MANAGED]  # the probe, then the slot


def test_enqueue_never_reallocates_a_buffer_another_stage_may_hold(fake_cuda):
    """Issue 19 item 8: a bigger output than sized at load raises; the captured pointer stays valid."""
    engine = toy_engine(output_frames=lambda t: 150 if t == 3 else t)  # y outgrows the max-input probe
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT)
    pointer = runner.device_tensor("y")[0]
    runner.set_shapes({"x": (1, 3, 4)})
    before = len(fake_cuda.calls)
    with pytest.raises(TrtCosyError, match="'y' needs 2400 bytes, more than the 2048"):
        runner.enqueue()
    assert not [c for c in fake_cuda.calls[before:] if c[0] in ("malloc", "free")]
    assert runner.device_tensor("y")[0] == pointer and pointer in fake_cuda.blocks


def test_enqueue_launches_only_on_the_profiles_stream(fake_cuda):
    """Issue 19 item 9: no launch on a stream the profile switch was not ordered with."""
    engine = toy_engine()
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT)
    runner.set_shapes({"x": (1, 4, 4)})
    with cuda.Stream() as other, pytest.raises(TypeError):
        runner.enqueue(0, stream=other)
    runner.enqueue(0)
    assert engine.failures == []


def test_misaligned_addresses_are_refused_with_the_reason(fake_cuda):
    runner = TrtRunner(toy_engine(), "toy", PROFILES, trt=FAKE_TRT)
    runner.set_shapes({"x": (1, 4, 4)})
    with cuda.DeviceBuffer(1024) as source, pytest.raises(TrtCosyError, match="not 256-byte aligned"):
        runner.enqueue(addresses={"x": source.ptr + 4})


def test_shape_tensor_io_is_refused_at_load(fake_cuda):
    """Issue 19 item 10: shape tensors live in host memory; this runner binds device memory only."""
    with pytest.raises(TrtCosyError, match="shape tensor 'x'"):
        TrtRunner(toy_engine(shape_io=("x",)), "toy", PROFILES, trt=FAKE_TRT)


def test_activation_memory_is_per_context_and_grows_per_profile(fake_cuda):
    """Issue 19 item 11: USER_MANAGED contexts get the memory of the profiles they select, reported."""
    engine = toy_engine(slots=2)
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT, slots=2)
    io = 2 * 128 * 4 * 4
    assert (
        runner.device_memory()
        == [{"activations": 4096, "activations_max": 8192, "io": io, "total": 4096 + io}] * 2
    )
    for context in _slot_contexts(engine):
        assert context.memory is not None and context.memory[1] == 4096
    runner.infer({"x": np.ones((1, 100, 4), np.float32)})  # "long" on one slot
    grown = sorted(m["activations"] for m in runner.device_memory())
    assert grown == [4096, 8192], runner.device_memory()
    ran = next(ctx for ctx in _slot_contexts(engine) if ctx.profile == 1)
    order = [(c[0], c[-1]) for c in ran.calls if c[0] in ("memory", "profile")]
    # grown before the switch, bound again after it (the fake drops the binding on every switch)
    assert order == [("memory", 4096), ("memory", 8192), ("profile", 1), ("memory", 8192)], order
    assert engine.failures == []


def test_the_activation_memory_is_bound_again_after_every_profile_switch(fake_cuda):
    """Issue 29 item 6: re-bind set_device_memory after each switch, right before the launch."""
    engine = toy_engine()
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT)
    (context,) = _slot_contexts(engine)
    for frames in (5, 40, 5, 40, 41):  # short, long, short, long, long (same profile: no switch)
        x = np.full((1, frames, 4), float(frames), np.float32)
        assert np.array_equal(runner.infer({"x": x})["y"], 2 * x)
    kinds = [c[0] for c in context.calls if c[0] in ("profile", "memory", "execute")]
    assert kinds.count("profile") == 4 and kinds.count("execute") == 5, " ".join(kinds)
    for at, kind in enumerate(kinds):
        if kind == "profile":  # the next call after every switch binds the memory, before any launch
            assert kinds[at + 1] == "memory", kinds
    assert engine.failures == []


def test_the_fake_refuses_a_launch_without_memory_after_a_switch(fake_cuda):
    """The pessimistic fake: a profile switch drops the set_device_memory binding."""
    engine = toy_engine()
    context = engine.create_execution_context(USER_MANAGED)
    context.set_device_memory(1 << 20, 8192)
    context.set_optimization_profile_async(1, 7)
    context.set_input_shape("x", (1, 40, 4))
    for name in ("x", "y"):
        context.set_tensor_address(name, 256)
    assert context.execute_async_v3(7) is False
    assert "activation memory None" in engine.failures[-1]


def _fake_trt_module(make_engine):
    """A tensorrt module whose Runtime and ILogger count their instances."""
    created: dict[str, list] = {"runtimes": [], "loggers": []}

    class ILogger:
        Severity = SimpleNamespace(INTERNAL_ERROR=0, ERROR=1, WARNING=2, INFO=3, VERBOSE=4)

        def __init__(self):
            created["loggers"].append(self)

    class Runtime:
        def __init__(self, logger):
            self.logger = logger
            created["runtimes"].append(self)

        def deserialize_cuda_engine(self, data):
            return make_engine()

    return SimpleNamespace(**vars(FAKE_TRT), ILogger=ILogger, Runtime=Runtime), created


def test_one_logger_and_one_runtime_serve_every_plan(fake_cuda, monkeypatch, tmp_path, caplog):
    """Issue 19 item 6: TensorRT keeps the first logger; one logger and one Runtime per process."""
    import logging

    from trt_cosy.runtime.backends.tensorrt import runner as trt_runtime

    trt, created = _fake_trt_module(toy_engine)
    monkeypatch.setattr(trt_runtime, "load_tensorrt", lambda: trt)
    plan = tmp_path / "toy.plan"
    plan.write_bytes(b"plan")
    runners = [TrtRunner.from_plan(plan, "toy", PROFILES) for _ in range(3)]
    runners[0].free()  # dropping the first runner must not drop the logger the others use
    del runners[0]
    assert len(created["runtimes"]) == 1 and len(created["loggers"]) == 1, created
    logger = created["runtimes"][0].logger
    with caplog.at_level(logging.DEBUG, logger="trt_cosy.runtime.backends.tensorrt.runner"):
        logger.log(trt.ILogger.Severity.VERBOSE, "a verbose detail")  # below DEBUG: dropped first
        logger.log(trt.ILogger.Severity.WARNING, "a warning")
    messages = [record.getMessage() for record in caplog.records]
    assert "TensorRT: a warning" in messages and not any("verbose detail" in m for m in messages), messages


def test_load_plan_runners_refuses_more_slots_than_the_plans_hold(fake_cuda, monkeypatch, tmp_path):
    import json

    from trt_cosy.runtime.backends.tensorrt import runner as trt_runtime
    from trt_cosy.runtime.profiles import write_profiles

    trt, _ = _fake_trt_module(toy_engine)  # plans built for one slot
    monkeypatch.setattr(trt_runtime, "load_tensorrt", lambda: trt)
    monkeypatch.setattr(trt_runtime, "current_system", lambda trt: SYSTEM)
    write_profiles({"toy": PROFILES}, tmp_path / "profiles.json")
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "toy.plan").write_bytes(b"plan")
    record = _record(graph="toy", plan="toy.plan", slots=1)
    (tmp_path / "plans" / "toy.json").write_text(json.dumps(record.to_dict()))
    with pytest.raises(
        EngineMismatchError, match=r"built for 1 concurrent slot\(s\), 2 asked for.*--slots 2"
    ):
        trt_runtime.load_plan_runners(tmp_path, slots=2)
    runners = trt_runtime.load_plan_runners(tmp_path, slots=1)
    assert set(runners) == {"toy"} and runners["toy"].slots == 1


def test_bench_reports_device_memory_per_context(fake_cuda):
    """bench/gpu_check.py's "ctx MB": one context of every graph; None for ONNX Runtime runners."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "gpu_check", Path(__file__).parents[1] / "bench" / "gpu_check.py"
    )
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    runners = {"a": TrtRunner(toy_engine(), "toy", PROFILES, trt=FAKE_TRT)}
    runners["b"] = TrtRunner(toy_engine(slots=2), "toy", PROFILES, trt=FAKE_TRT, slots=2)
    report = gpu_check.context_memory(runners)
    assert report == {name: runner.device_memory()[0] for name, runner in runners.items()}
    assert report["a"]["total"] == 4096 + 2 * 128 * 4 * 4
    assert gpu_check.context_memory({**runners, "ort": object()}) is None


def test_enqueue_binds_caller_addresses_and_events(fake_cuda):
    runner = TrtRunner(toy_engine(), "toy", PROFILES, trt=FAKE_TRT)
    shapes = runner.set_shapes({"x": (1, 4, 4)})
    assert shapes == {"y": (1, 4, 4)}
    source = cuda.DeviceBuffer(64)
    np.frombuffer((ctypes.c_float * 16).from_address(source.ptr), np.float32)[:] = 3.0
    runner.enqueue(addresses={"x": source.ptr})  # another stage's output, no host copy
    ptr, shape, dtype = runner.device_tensor("y")
    assert shape == (1, 4, 4) and dtype == np.float32
    assert np.all(np.frombuffer((ctypes.c_float * 16).from_address(ptr), np.float32) == 6.0)
    event = runner.record()
    runner.wait(event)
    source.free()


# -- plan records -----------------------------------------------------------------------------------

SYSTEM = {"gpu": "NVIDIA H100", "compute_capability": "9.0", "tensorrt": "10.12.0"}


def _record(**changes):
    base = dict(
        graph="hift",
        onnx="hift.fp16.onnx",
        onnx_sha256="aa",
        precision="fp16",
        checkpoint="cc",
        profiles=PROFILES.to_dict(),
        plan="hift.plan",
        system=SYSTEM,
    )
    return PlanRecord(**{**base, **changes})


def test_plan_record_matches_only_its_system_and_inputs():
    record = _record()
    assert PlanRecord.from_dict(record.to_dict()) == record
    kwargs = dict(checkpoint="cc", precision="fp16", profiles=PROFILES.to_dict(), onnx_sha256="aa")
    assert plan_mismatch(record, SYSTEM, **kwargs) is None
    cases = {
        "GPU": {**SYSTEM, "gpu": "NVIDIA L4"},
        "compute capability": {**SYSTEM, "compute_capability": "8.9"},
        "TensorRT": {**SYSTEM, "tensorrt": "11.0.0"},
    }
    for label, system in cases.items():
        assert label in plan_mismatch(record, system, **kwargs)
    for key, label in (("checkpoint", "checkpoint"), ("precision", "precision"), ("onnx_sha256", "ONNX")):
        assert label in plan_mismatch(record, SYSTEM, **{**kwargs, key: "other"})
    other = GraphProfiles("toy", PROFILES.profiles[:1]).to_dict()
    assert "profiles" in plan_mismatch(record, SYSTEM, **{**kwargs, "profiles": other})
    assert "--onnx-only" in plan_mismatch(_record(system=None), SYSTEM)
    assert plan_mismatch(record, SYSTEM, **kwargs, slots=1) is None
    assert "built for 1 concurrent slot(s), 2 wanted" in plan_mismatch(record, SYSTEM, **kwargs, slots=2)
    assert plan_mismatch(_record(slots=3), SYSTEM, **kwargs, slots=2) is None  # more slots serve fewer


def test_checkpoint_digest_is_order_free():
    assert checkpoint_digest({"a": "1", "b": "2"}) == checkpoint_digest({"b": "2", "a": "1"})
    assert checkpoint_digest({"a": "1"}) != checkpoint_digest({"a": "2"})


def test_tensorrt_modules_import_without_tensorrt_or_cuda():
    code = textwrap.dedent("""
        import sys
        sys.modules["tensorrt"] = None  # importing it raises ImportError
        sys.modules["cuda"] = None
        import trt_cosy
        import trt_cosy.runtime.backends.tensorrt.runner, trt_cosy.runtime.backends.tensorrt.cuda, trt_cosy.runtime.profiles, trt_cosy.builder.trt.plans
        from trt_cosy.runtime.backends.tensorrt.cuda import gpu_unavailable_reason
        print(gpu_unavailable_reason())
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "cuda-python is not installed" in result.stdout, result.stdout


# -- on a GPU -----------------------------------------------------------------------------------------

_NO_GPU = cuda.gpu_unavailable_reason()


def _toy_onnx(path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])],
        "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 4])],
        [numpy_helper.from_array(weight, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=f"needs an NVIDIA GPU with TensorRT: {_NO_GPU}")
def test_toy_plan_matches_onnxruntime_on_gpu(tmp_path):
    from trt_cosy.builder.trt.plans import build_plan
    from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner

    source = _toy_onnx(tmp_path / "toy.onnx")
    plan = build_plan(source, tmp_path / "toy.plan", PROFILES, tmp_path / "timing.cache")
    assert (tmp_path / "timing.cache").is_file()
    feed = {"x": np.random.default_rng(1).standard_normal((1, 37, 4)).astype(np.float32)}
    with TrtRunner.from_plan(plan, "toy", PROFILES) as runner:
        got = runner.infer(feed)["y"]
        print(f"device memory per context: {runner.device_memory()}")
    expected = OrtRunner.from_path(source, "toy").infer(feed)["y"]
    assert np.abs(got - expected).max() < 1e-4, np.abs(got - expected).max()


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=f"needs an NVIDIA GPU with TensorRT: {_NO_GPU}")
def test_two_threads_on_two_slots_match_onnxruntime_on_gpu(tmp_path):
    """Issue 19 item 3 on a GPU: a plan built for 2 slots (profiles x 2), two threads running at once,
    lengths across both profiles, every output against ONNX Runtime."""
    import threading

    from trt_cosy.builder.trt.plans import build_plan
    from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner

    source = _toy_onnx(tmp_path / "toy.onnx")
    plan = build_plan(source, tmp_path / "toy.plan", PROFILES, tmp_path / "timing.cache", slots=2)
    reference = OrtRunner.from_path(source, "toy")
    errors: list[str] = []
    with TrtRunner.from_plan(plan, "toy", PROFILES, slots=2) as runner:
        assert runner.engine.num_optimization_profiles == 2 * len(PROFILES.profiles)

        def work(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(50):
                x = rng.standard_normal((1, int(rng.integers(1, 129)), 4)).astype(np.float32)
                error = np.abs(runner.infer({"x": x})["y"] - reference.infer({"x": x})["y"]).max()
                if not error < 1e-4:
                    errors.append(f"thread {seed}: {x.shape} off by {error}")

        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        memory = runner.device_memory()
        print(f"device memory per context: {memory}")
    assert not errors, errors[:5]
    assert len(memory) == 2 and all(m["activations"] <= m["activations_max"] for m in memory)


def test_lazy_plans_are_checked_at_load_and_deserialised_on_first_use(fake_cuda, monkeypatch, tmp_path):
    """Issue 29 item 3: plans load when first needed; the record check still happens at load."""
    import json

    from trt_cosy.runtime.backends.tensorrt import runner as trt_runtime
    from trt_cosy.runtime.backends.tensorrt.lazy import LazyTrtRunner, load_plans
    from trt_cosy.runtime.profiles import write_profiles

    made = []
    trt, _ = _fake_trt_module(lambda: made.append(toy_engine()) or made[-1])
    monkeypatch.setattr(trt_runtime, "load_tensorrt", lambda: trt)
    monkeypatch.setattr(trt_runtime, "current_system", lambda trt: SYSTEM)
    write_profiles({"toy": PROFILES}, tmp_path / "profiles.json")
    (tmp_path / "plans").mkdir()
    (tmp_path / "plans" / "toy.plan").write_bytes(b"plan")
    record = _record(graph="toy", plan="toy.plan", slots=1)
    (tmp_path / "plans" / "toy.json").write_text(json.dumps(record.to_dict()))
    runner = load_plans(tmp_path, lazy={"toy"})["toy"]
    assert isinstance(runner, LazyTrtRunner) and not made and not runner.loaded
    assert runner.profiles == PROFILES and runner.slots == 1
    malloc_before = sum(1 for c in fake_cuda.calls if c[0] == "malloc")
    assert malloc_before == 0  # no buffers, no activation memory yet
    x = np.ones((1, 5, 4), np.float32)
    assert np.array_equal(runner.infer({"x": x})["y"], 2 * x) and len(made) == 1
    with runner.slot() as slot:  # the TrtRunner hot path through the lazy runner, no second load
        runner.set_shapes({"x": x.shape}, slot)
    assert len(made) == 1 and runner.loaded
    runner.free()
    (tmp_path / "plans" / "toy.plan").unlink()
    with pytest.raises(EngineMismatchError, match="does not exist"):  # a missing plan: refused at load
        load_plans(tmp_path, lazy={"toy"})


def test_plain_estimator_plans_are_deferred_where_step_plans_exist():
    from trt_cosy.runtime.backends.tensorrt.lazy import deferred_plans

    plans = ["llm", "llm_decode", "flow_encoder", "flow_estimator", "flow_estimator_stream", "flow_step",
             "flow_step_stream", "hift"]  # fmt: skip
    assert deferred_plans(plans, {"hift_stream"}) == {"flow_estimator", "flow_estimator_stream"}
    assert deferred_plans(plans[:5] + ["hift"], {"flow_estimator_stream"}) == {"flow_estimator_stream"}
    assert deferred_plans([*plans, "hift_stream"], {"hift_stream"}) >= {"hift_stream"}
