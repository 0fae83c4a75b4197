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

from trt_cosy.errors import EngineMismatchError, InputError, MissingDependencyError
from trt_cosy.runtime import cuda
from trt_cosy.runtime.profiles import GraphProfiles, ShapeProfile
from trt_cosy.runtime.trt import PlanRecord, TrtRunner, checkpoint_digest, load_tensorrt, plan_mismatch


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

    def __init__(self, devices: int = 1):
        self.devices, self.blocks, self.calls = devices, {}, []
        self.fail_malloc = False

    def _alloc(self, size):
        block = ctypes.create_string_buffer(size)
        self.blocks[ctypes.addressof(block)] = block
        return ctypes.addressof(block)

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

    def cudaStreamCreateWithFlags(self, flags):
        return (_Err.cudaSuccess, 7)

    def cudaStreamSynchronize(self, stream):
        return (_Err.cudaSuccess,)

    def cudaStreamDestroy(self, stream):
        return (_Err.cudaSuccess,)

    def cudaStreamWaitEvent(self, stream, event, flags):
        self.calls.append(("wait", stream, event))
        return (_Err.cudaSuccess,)

    def cudaEventCreateWithFlags(self, flags):
        return (_Err.cudaSuccess, 9)

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
    assert ("record", 9, 7) in fake_cuda.calls and ("wait", 7, 9) in fake_cuda.calls


def test_no_gpu_is_reported_not_crashed(monkeypatch):
    monkeypatch.setattr(cuda, "_BINDINGS", FakeCuda(devices=0))
    assert cuda.device_count() == 0
    assert "cudaErrorInsufficientDriver" in cuda.gpu_unavailable_reason()
    with pytest.raises(MissingDependencyError, match=r"pip install 'trt-cosy\[gpu\]'"):
        load_tensorrt()


# -- TrtRunner over a fake engine -----------------------------------------------------------------------

FAKE_TRT = SimpleNamespace(TensorIOMode=SimpleNamespace(INPUT="in", OUTPUT="out"), nptype=lambda dtype: dtype)


class FakeContext:
    """Computes y = 2 * x on the bound "device" pointers; records every setter call."""

    def __init__(self, engine):
        self.engine, self.shapes, self.addresses, self.calls = engine, {}, {}, []
        engine.contexts.append(self)

    def set_optimization_profile_async(self, index, stream):
        self.calls.append(("profile", index))
        self.shapes = {}
        return True

    def set_input_shape(self, name, shape):
        self.calls.append(("shape", name, tuple(shape)))
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name):
        return self.shapes["x"] if name == "y" else self.shapes[name]

    def set_tensor_address(self, name, ptr):
        self.calls.append(("address", name, ptr))
        self.addresses[name] = ptr
        return True

    def execute_async_v3(self, stream):
        count = int(np.prod(self.shapes["x"]))
        x = np.frombuffer((ctypes.c_float * count).from_address(self.addresses["x"]), np.float32)
        y = np.frombuffer((ctypes.c_float * count).from_address(self.addresses["y"]), np.float32)
        y[:] = 2.0 * x
        self.calls.append(("execute",))
        return True


class FakeEngine:
    num_io_tensors = 2
    num_optimization_profiles = 2

    def __init__(self):
        self.contexts = []

    def get_tensor_name(self, index):
        return ("x", "y")[index]

    def get_tensor_mode(self, name):
        return "in" if name == "x" else "out"

    def get_tensor_dtype(self, name):
        return np.float32

    def create_execution_context(self):
        return FakeContext(self)


PROFILES = GraphProfiles(
    "toy",
    (
        ShapeProfile("short", {"x": ((1, 1, 4), (1, 8, 4), (1, 16, 4))}),
        ShapeProfile("long", {"x": ((1, 1, 4), (1, 64, 4), (1, 128, 4))}),
    ),
)


def _setters(context):
    return [c for c in context.calls if c[0] in ("profile", "shape", "address")]


def test_runner_preallocates_from_profile_maxima_and_never_reallocates(fake_cuda):
    runner = TrtRunner(FakeEngine(), "toy", PROFILES, trt=FAKE_TRT, slots=2)
    max_bytes = 1 * 128 * 4 * 4
    mallocs = [c for c in fake_cuda.calls if c[0] == "malloc"]
    assert len(mallocs) == 4 and all(size >= max_bytes for _, size in mallocs), mallocs  # x and y per slot
    before = len(fake_cuda.calls)
    for frames in (3, 16, 100, 2):
        feed = {"x": np.arange(frames * 4, dtype=np.float32).reshape(1, frames, 4)}
        out = runner.infer(feed)["y"]
        assert out.shape == (1, frames, 4) and np.array_equal(out, 2 * feed["x"])
    assert not [c for c in fake_cuda.calls[before:] if c[0].startswith("malloc")]
    runner.free()
    assert not fake_cuda.blocks


def test_runner_sets_shapes_and_addresses_only_on_change(fake_cuda):
    engine = FakeEngine()
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT)
    context = engine.contexts[-1]  # contexts[0] was the sizing probe
    x5 = {"x": np.ones((1, 5, 4), np.float32)}
    runner.infer(x5)
    first = _setters(context)
    assert first[0] == ("profile", 0) and ("shape", "x", (1, 5, 4)) in first
    assert {c[1] for c in first if c[0] == "address"} == {"x", "y"}
    context.calls.clear()
    runner.infer(x5)  # same shapes, same buffers: nothing to set
    assert _setters(context) == [] and context.calls == [("execute",)]
    runner.infer({"x": np.ones((1, 9, 4), np.float32)})  # new length, same profile
    assert _setters(context) == [("shape", "x", (1, 9, 4))]
    context.calls.clear()
    runner.infer({"x": np.ones((1, 40, 4), np.float32)})  # beyond "short": switch profile, re-set shapes
    assert _setters(context) == [("profile", 1), ("shape", "x", (1, 40, 4))]


def test_runner_refuses_inputs_beyond_the_largest_profile(fake_cuda):
    engine = FakeEngine()
    runner = TrtRunner(engine, "toy", PROFILES, trt=FAKE_TRT)
    engine.contexts[-1].calls.clear()
    with pytest.raises(InputError, match=r"\(1, 129, 4\).*largest TensorRT profile"):
        runner.infer({"x": np.ones((1, 129, 4), np.float32)})
    assert engine.contexts[-1].calls == []  # refused before TensorRT saw it
    with pytest.raises(InputError, match="missing"):
        runner.infer({})


def test_runner_rejects_profile_count_mismatch(fake_cuda):
    one = GraphProfiles("toy", PROFILES.profiles[:1])
    with pytest.raises(EngineMismatchError, match="2 profiles"):
        TrtRunner(FakeEngine(), "toy", one, trt=FAKE_TRT)


def test_enqueue_binds_caller_addresses_and_events(fake_cuda):
    runner = TrtRunner(FakeEngine(), "toy", PROFILES, trt=FAKE_TRT)
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


def test_checkpoint_digest_is_order_free():
    assert checkpoint_digest({"a": "1", "b": "2"}) == checkpoint_digest({"b": "2", "a": "1"})
    assert checkpoint_digest({"a": "1"}) != checkpoint_digest({"a": "2"})


def test_tensorrt_modules_import_without_tensorrt_or_cuda():
    code = textwrap.dedent("""
        import sys
        sys.modules["tensorrt"] = None  # importing it raises ImportError
        sys.modules["cuda"] = None
        import trt_cosy
        import trt_cosy.runtime.trt, trt_cosy.runtime.cuda, trt_cosy.runtime.profiles, trt_cosy.build.tensorrt
        from trt_cosy.runtime.cuda import gpu_unavailable_reason
        print(gpu_unavailable_reason())
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "cuda-python is not installed" in result.stdout, result.stdout


# -- on a GPU -----------------------------------------------------------------------------------------

_NO_GPU = cuda.gpu_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU is not None, reason=f"needs an NVIDIA GPU with TensorRT: {_NO_GPU}")
def test_toy_plan_matches_onnxruntime_on_gpu(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from trt_cosy.build.tensorrt import build_plan
    from trt_cosy.runtime.ort import OrtRunner

    weight = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])],
        "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 4])],
        [numpy_helper.from_array(weight, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "toy.onnx")
    plan = build_plan(tmp_path / "toy.onnx", tmp_path / "toy.plan", PROFILES, tmp_path / "timing.cache")
    assert (tmp_path / "timing.cache").is_file()
    feed = {"x": np.random.default_rng(1).standard_normal((1, 37, 4)).astype(np.float32)}
    with TrtRunner.from_plan(plan, "toy", PROFILES, slots=2) as runner:
        got = runner.infer(feed)["y"]
    expected = OrtRunner.from_path(tmp_path / "toy.onnx", "toy").infer(feed)["y"]
    assert np.abs(got - expected).max() < 1e-4, np.abs(got - expected).max()
