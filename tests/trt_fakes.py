"""Fake TensorRT engines and contexts that fail the way the real bindings do (TensorRT 10.12 / 11.x).

What the fakes enforce, each from NVIDIA/TensorRT's sources (python/src/infer/pyCore.cpp,
include/NvInferRuntime.h):

* ``set_optimization_profile_async`` raises ``RuntimeError`` on failure (the binding's
  ``PY_ASSERT_RUNTIME_ERROR``), e.g. for an index out of range, and here also when another live
  context of the engine holds that profile ("each execution context in concurrent use must use a
  separate optimization profile", ``class IExecutionContext``).
* ``set_input_shape`` returns False for a shape outside the selected profile (or a "rejected" max
  shape: a stale plan) and the tensor's shape then reads as -1 dims from ``get_tensor_shape``.
* A profile switch forgets the shapes, the bound addresses and the activation memory given with
  ``set_device_memory`` (pessimistic: the header promises none of them survives; Polygraphy binds the
  memory again right before every launch).
* ``set_tensor_address`` returns False for an address that is not 256-byte aligned.
* ``execute_async_v3`` returns False when an address is unset, when the launch stream is not the
  one the profile was switched on (unsynchronised streams), or, for ``USER_MANAGED`` contexts, when
  the activation memory given with ``set_device_memory`` is smaller than the profile needs.
* ``is_shape_inference_io`` and ``get_tensor_profile_shape`` answer from the engine's data.

"Device" memory is host memory (``aligned_block``) so that outputs can be computed with numpy.
``CountingCuda`` (below) is a pessimistic ``cuda.bindings.runtime``: it counts host<->device bytes
and host synchronizations, can keep events "in flight", and records stream captures; with it
installed a context's launch is queued through it (captured into a CUDA graph with the shapes and
addresses of that launch, replayed by ``cudaGraphLaunch``).
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from trt_cosy.runtime.backends.tensorrt import cuda
from trt_cosy.runtime.profiles import GraphProfiles

STATIC, ON_PROFILE_CHANGE, USER_MANAGED = 0, 1, 2
FAKE_TRT = SimpleNamespace(
    TensorIOMode=SimpleNamespace(INPUT="in", OUTPUT="out"),
    nptype=lambda dtype: dtype,
    ExecutionContextAllocationStrategy=SimpleNamespace(
        STATIC=STATIC, ON_PROFILE_CHANGE=ON_PROFILE_CHANGE, USER_MANAGED=USER_MANAGED
    ),
)
ALIGN = 256


def aligned_block(blocks: dict[int, Any], size: int) -> int:
    """A host block whose address is 256-byte aligned, as cudaMalloc's are; kept alive in ``blocks``."""
    raw = ctypes.create_string_buffer(int(size) + ALIGN)
    address = (ctypes.addressof(raw) + ALIGN - 1) // ALIGN * ALIGN
    blocks[address] = raw
    return address


def host_array(ptr: int, shape: Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """A numpy view of fake device memory."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    raw = (ctypes.c_byte * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype).reshape(tuple(shape))


class FakeContext:
    """An ``IExecutionContext`` with the real one's failure modes; ``run`` computes the outputs."""

    def __init__(self, engine: FakeEngine, strategy: int):
        self.engine, self.strategy = engine, strategy
        self.profile, self.profile_stream = 0, None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.memory: tuple[int, int] | None = None
        self.calls: list[tuple] = []

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.calls.append(("profile", index))
        engine = self.engine
        holder = engine.selected.get(index)
        if not 0 <= index < engine.num_optimization_profiles or engine.fail_profile_switch:
            raise RuntimeError("Error in set optimization profile async.")
        if holder is not None and holder() not in (None, self):
            raise RuntimeError(f"profile {index} is in use by another execution context")
        engine.selected = {k: v for k, v in engine.selected.items() if v() is not self}
        engine.selected[index] = weakref.ref(self)
        self.profile, self.profile_stream = index, stream
        self.shapes, self.addresses, self.memory = {}, {}, None
        return True

    def set_input_shape(self, name: str, shape: Sequence[int]) -> bool:
        shape = tuple(int(d) for d in shape)
        self.calls.append(("shape", name, shape))
        low, _, high = self.engine.profile_shapes(self.profile)[name]
        fits = len(shape) == len(low) and all(a <= d <= c for a, d, c in zip(low, shape, high, strict=True))
        if not fits or (self.engine.reject_max and shape == tuple(high)):
            self.shapes.pop(name, None)
            return False
        self.shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        if name in self.engine.inputs:
            return self.shapes.get(name, (-1,) * len(self.engine.profile_shapes(self.profile)[name][0]))
        if set(self.engine.inputs) - set(self.shapes):
            return (-1, -1, -1)  # an input shape is unset (or was rejected)
        return tuple(self.engine.output_shape(self.shapes, name))

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.calls.append(("address", name, ptr))
        if name not in (*self.engine.inputs, *self.engine.outputs) or int(ptr) % ALIGN:
            return False
        self.addresses[name] = int(ptr)
        return True

    def set_device_memory(self, memory: int, size: int) -> None:
        self.calls.append(("memory", memory, size))
        self.memory = (int(memory), int(size))

    def execute_async_v3(self, stream_handle: int) -> bool:
        engine = self.engine
        failure = None
        if set(engine.inputs) - set(self.shapes):
            failure = "input shapes unset"
        elif set(engine.inputs + engine.outputs) - set(self.addresses):
            failure = f"addresses unset: {sorted(set(engine.inputs + engine.outputs) - set(self.addresses))}"
        elif stream_handle != self.profile_stream:
            failure = "launch stream differs from the profile's stream (no synchronisation)"
        elif self.strategy == USER_MANAGED and (
            self.memory is None or self.memory[1] < engine.workspace(self.profile)
        ):
            failure = f"activation memory {self.memory} < {engine.workspace(self.profile)}"
        self.calls.append(("execute", failure))
        engine.failures.extend([failure] if failure else [])
        if failure:
            return False
        launch = getattr(cuda._BINDINGS, "launch", None)  # CountingCuda: recorded while capturing
        if launch is None:
            self.run(stream_handle)
        else:  # what a captured graph bakes in: the shapes and addresses of this launch
            shapes, addresses = dict(self.shapes), dict(self.addresses)
            launch(stream_handle, lambda: self._run_as(shapes, addresses, stream_handle))
        return True

    def _run_as(self, shapes: dict, addresses: dict, stream_handle: int) -> None:
        kept = self.shapes, self.addresses
        self.shapes, self.addresses = shapes, addresses
        try:
            self.run(stream_handle)
        finally:
            self.shapes, self.addresses = kept

    def run(self, stream_handle: int) -> None:
        """Compute the outputs from the bound addresses (the engine's ``compute``)."""
        engine = self.engine
        views = {n: host_array(self.addresses[n], self.shapes[n], engine.get_tensor_dtype(n)) for n in engine.inputs}
        outputs = engine.compute(views)
        for name, value in outputs.items():
            host_array(self.addresses[name], value.shape, engine.get_tensor_dtype(name))[...] = value


class FakeEngine:
    """An ``ICudaEngine`` over plain data: its profiles (× slots), I/O names and a numpy ``compute``.

    ``context``: the context class; ``output_shape(shapes, name)``: an output's shape from the set
    input shapes; ``workspace(profile)``: activation bytes per engine profile.
    """

    def __init__(
        self,
        profiles: GraphProfiles,
        *,
        outputs: Sequence[str],
        compute: Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]],
        output_shape: Callable[[Mapping[str, tuple[int, ...]], str], Sequence[int]],
        slots: int = 1,
        context: type[FakeContext] = FakeContext,
        shape_io: Sequence[str] = (),
        reject_max: bool = False,
        dropped: Sequence[str] = (),
        dtypes: Mapping[str, Any] | None = None,
    ):
        self.profiles, self.context_class = profiles, context
        self.dtypes = dict(dtypes or {})  # tensor name -> numpy dtype (default float32)
        self.inputs = tuple(n for n in profiles.input_names if n not in dropped)
        self.outputs = tuple(outputs)
        self.compute, self.output_shape = compute, output_shape
        self.num_optimization_profiles = len(profiles.profiles) * slots
        self.shape_io, self.reject_max, self.fail_profile_switch = set(shape_io), reject_max, False
        self.contexts: list[weakref.ref] = []
        self.strategies: list[int] = []
        self.selected: dict[int, weakref.ref] = {}
        self.failures: list[str] = []

    @property
    def num_io_tensors(self) -> int:
        return len(self.inputs) + len(self.outputs)

    def get_tensor_name(self, index: int) -> str:
        return (*self.inputs, *self.outputs)[index]

    def get_tensor_mode(self, name: str) -> str:
        return "in" if name in self.inputs else "out"

    def get_tensor_dtype(self, name: str) -> Any:
        return self.dtypes.get(name, np.float32)

    def is_shape_inference_io(self, name: str) -> bool:
        return name in self.shape_io

    def profile_shapes(self, index: int) -> dict[str, tuple[tuple[int, ...], ...]]:
        return self.profiles.profiles[index % len(self.profiles.profiles)].shapes

    def get_tensor_profile_shape(self, name: str, index: int) -> list[tuple[int, ...]]:
        return [tuple(s) for s in self.profile_shapes(index)[name]]

    def workspace(self, index: int) -> int:
        return 4096 * (index % len(self.profiles.profiles) + 1)

    def get_device_memory_size_for_profile_v2(self, index: int) -> int:
        return self.workspace(index)

    def create_execution_context(self, strategy: int = STATIC) -> FakeContext:
        context = self.context_class(self, strategy)
        self.contexts.append(weakref.ref(context))
        self.strategies.append(strategy)
        return context

    @property
    def live_contexts(self) -> list[FakeContext]:
        return [c for c in (ref() for ref in self.contexts) if c is not None]


# -- a counting, pessimistic cuda.bindings.runtime --------------------------------------------------


class CountingCuda:
    """``cuda.bindings.runtime`` over host memory that counts what a GPU run would pay for.

    * ``bytes``: bytes moved per direction ("to_device", "to_host", "device"), 1-D and 3-D copies;
    * ``synchronizes``: host waits (stream and event synchronize);
    * ``events_done``: what ``cudaEventQuery`` answers (False: pessimistic, work still in flight);
    * CUDA graph capture (``cudaStreamBeginCapture`` ... ``cudaGraphLaunch``): launches made while a
      stream captures are recorded, not run, and run on every replay; a host copy or a synchronize on
      a capturing stream fails, as on a GPU (``cudaErrorStreamCaptureUnsupported``).

    ``mark()`` returns a snapshot; ``since(mark)`` the counts after it.
    """

    class cudaError_t:  # noqa: N801 - the bindings' name
        cudaSuccess = 0
        cudaErrorMemoryAllocation = 2
        cudaErrorNotReady = 600
        cudaErrorStreamCaptureUnsupported = 900

    cudaStreamNonBlocking, cudaEventDisableTiming, cudaEventDefault = 1, 2, 0
    cudaMemcpyKind = SimpleNamespace(cudaMemcpyHostToDevice=1, cudaMemcpyDeviceToHost=2, cudaMemcpyDeviceToDevice=3)
    cudaStreamCaptureMode = SimpleNamespace(cudaStreamCaptureModeThreadLocal=1, cudaStreamCaptureModeGlobal=0)
    cudaMemcpy3DParms = SimpleNamespace
    _DIRECTIONS = {1: "to_device", 2: "to_host", 3: "device"}
    OK = (0,)

    def __init__(self) -> None:
        self.blocks: dict[int, Any] = {}
        self.calls: list[tuple] = []
        self.bytes = {"to_device": 0, "to_host": 0, "device": 0}
        self.synchronizes = 0
        self.events_done = True
        self.handles = 1000
        self.capturing: dict[int, list[Callable[[], None]]] = {}  # stream -> recorded work
        self.graphs: dict[int, list[Callable[[], None]]] = {}
        self.replays = 0

    # memory
    def _handle(self) -> tuple[int, int]:
        self.handles += 1
        return (0, self.handles)

    def cudaMalloc(self, size):
        return (0, aligned_block(self.blocks, size))

    cudaMallocHost = cudaMalloc

    def cudaFree(self, ptr):
        self.blocks.pop(ptr)
        return self.OK

    cudaFreeHost = cudaFree

    def _copy(self, stream, kind, count, work):
        if kind != 3 and stream in self.capturing:  # host copies are not captured in this project
            return (self.cudaError_t.cudaErrorStreamCaptureUnsupported,)
        if stream in self.capturing:
            self.capturing[stream].append(work)
        else:
            work()
        self.bytes[self._DIRECTIONS[int(kind)]] += int(count)
        return self.OK

    def cudaMemcpyAsync(self, dst, src, count, kind, stream):
        self.calls.append(("copy", int(kind), int(count)))
        return self._copy(stream, kind, count, lambda: ctypes.memmove(dst, src, count))

    def cudaMemcpy(self, dst, src, count, kind):
        self.synchronizes += 1  # a synchronous copy waits like a synchronize
        return self.cudaMemcpyAsync(dst, src, count, kind, None)

    @staticmethod
    def make_cudaPitchedPtr(ptr, pitch, xsize, ysize):
        return SimpleNamespace(ptr=ptr, pitch=pitch, xsize=xsize, ysize=ysize)

    @staticmethod
    def make_cudaExtent(width, height, depth):
        return SimpleNamespace(width=width, height=height, depth=depth)

    def cudaMemcpy3DAsync(self, params, stream):
        src, dst, extent = params.srcPtr, params.dstPtr, params.extent
        self.calls.append(("copy3d", int(params.kind), extent.width, extent.height, extent.depth))
        if extent.width > min(src.pitch, dst.pitch):
            return (self.cudaError_t.cudaErrorMemoryAllocation,)

        def work():
            for z in range(extent.depth):
                for y in range(extent.height):
                    source = src.ptr + (z * src.ysize + y) * src.pitch
                    ctypes.memmove(dst.ptr + (z * dst.ysize + y) * dst.pitch, source, extent.width)

        return self._copy(stream, params.kind, extent.width * extent.height * extent.depth, work)

    # streams, events
    def cudaStreamCreateWithFlags(self, flags):
        return self._handle()

    cudaEventCreateWithFlags = cudaStreamCreateWithFlags

    def cudaStreamDestroy(self, handle):
        return self.OK

    cudaEventDestroy = cudaStreamDestroy

    def cudaStreamSynchronize(self, stream):
        if stream in self.capturing:
            return (self.cudaError_t.cudaErrorStreamCaptureUnsupported,)
        self.synchronizes += 1
        self.calls.append(("synchronize", stream))
        return self.OK

    def cudaEventSynchronize(self, event):
        self.synchronizes += 1
        self.calls.append(("synchronize", event))
        return self.OK

    def cudaStreamWaitEvent(self, stream, event, flags):
        self.calls.append(("wait", stream, event))
        return self.OK

    def cudaEventRecord(self, event, stream):
        self.calls.append(("record", event, stream))
        return self.OK

    def cudaEventQuery(self, event):
        return self.OK if self.events_done else (self.cudaError_t.cudaErrorNotReady,)

    def cudaGetErrorName(self, err):
        names = {v: k for k, v in vars(self.cudaError_t).items() if not k.startswith("_")}
        return (0, names.get(int(err), "cudaErrorUnknown").encode())

    def cudaGetErrorString(self, err):
        return (0, b"")

    # CUDA graphs
    def cudaStreamBeginCapture(self, stream, mode):
        self.calls.append(("begin_capture", stream))
        self.capturing[stream] = []
        return self.OK

    def cudaStreamEndCapture(self, stream):
        self.calls.append(("end_capture", stream))
        work = self.capturing.pop(stream)
        handle = self._handle()[1]
        self.graphs[handle] = work
        return (0, handle)

    def cudaGraphInstantiate(self, graph, flags):
        executable = self._handle()[1]
        self.graphs[executable] = self.graphs[graph]
        return (0, executable)

    def cudaGraphLaunch(self, executable, stream):
        self.calls.append(("graph_launch", executable, stream))
        self.replays += 1
        for work in self.graphs[executable]:
            work()
        return self.OK

    def cudaGraphDestroy(self, graph):
        self.graphs.pop(graph, None)
        return self.OK

    cudaGraphExecDestroy = cudaGraphDestroy

    def launch(self, stream: Any, work: Callable[[], None]) -> None:
        """A kernel launch on ``stream`` (the fake contexts call this): recorded while capturing."""
        if stream in self.capturing:
            self.capturing[stream].append(work)
        else:
            work()

    def mark(self) -> dict[str, int]:
        return {**self.bytes, "synchronizes": self.synchronizes}

    def since(self, mark: dict[str, int]) -> dict[str, int]:
        now = self.mark()
        return {key: now[key] - mark[key] for key in now}
