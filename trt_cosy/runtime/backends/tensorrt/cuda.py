"""Small cuda-python helpers: error mapping, device and pinned buffers, streams, events.

cuda-python (``cuda.bindings.runtime``, NVIDIA's maintained bindings) is imported on first use,
so importing this module never needs it. Every call goes through ``cuda_call``, which turns
cuda-python's ``(err, *result)`` tuples into a ``CudaError`` naming the error
(``cudaErrorMemoryAllocation``...). Every resource has ``free()`` and a context manager;
``__del__`` is a last resort that logs and never raises.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from ....errors import MissingDependencyError, TrtCosyError

__all__ = [
    "CudaError",
    "bindings",
    "cuda_call",
    "device_count",
    "cuda_unavailable_reason",
    "gpu_unavailable_reason",
    "device_info",
    "memory_info",
    "Pitched",
    "copy_3d_async",
    "DeviceBuffer",
    "PinnedBuffer",
    "Stream",
    "Event",
    "CudaGraph",
]

_LOGGER = logging.getLogger(__name__)

_BINDINGS: Any = None  # the cuda.bindings.runtime module once imported (tests install a fake here)
_NATIVE_HANDLE: Any = None  # handle -> int converter, chosen on first use
_ALIGN: Final = (
    256  # TensorRT wants 256-byte aligned I/O; cudaMalloc already gives that, sizes are rounded too
)


class CudaError(TrtCosyError):
    """A CUDA runtime call failed; ``code`` and ``name`` identify the error."""

    def __init__(self, message: str, code: int, name: str):
        super().__init__(message)
        self.code, self.name = code, name


def bindings() -> Any:
    """The ``cuda.bindings.runtime`` module (imported on first use)."""
    global _BINDINGS
    if _BINDINGS is None:
        try:
            from cuda.bindings import runtime
        except ImportError as exc:
            raise MissingDependencyError(
                f"cuda-python is not installed or too old ({exc}; cuda.bindings needs cuda-python >= 12.6.1). "
                "Install it with: pip install 'trt-cosy[gpu]' (CUDA 13 drivers, >= 580) or "
                "'trt-cosy[gpu-cu12]' (CUDA 12 drivers) on a machine with an NVIDIA GPU."
            ) from exc
        _BINDINGS = runtime
    return _BINDINGS


def _error_name(code: Any) -> tuple[str, str]:
    runtime = bindings()
    try:
        name = runtime.cudaGetErrorName(code)[1]
        text = runtime.cudaGetErrorString(code)[1]
    except Exception:  # a broken driver must not hide the original error
        return f"cudaError {int(code)}", ""
    decode = lambda value: value.decode() if isinstance(value, bytes) else str(value)  # noqa: E731
    return decode(name), decode(text)


def cuda_call(result: Any) -> Any:
    """Check a cuda-python result ``(err, *values)``: raise ``CudaError`` on failure, else return the
    values (None for none, the value for one, a tuple for several)."""
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    code = int(err)
    if code != 0:
        name, text = _error_name(err)
        raise CudaError(f"CUDA call failed: {name} ({code}){': ' + text if text else ''}", code, name)
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def device_count() -> int:
    """Number of visible CUDA devices; 0 when the driver or cuda-python is missing (never raises)."""
    try:
        runtime = bindings()
        err, count = runtime.cudaGetDeviceCount()
    except Exception:  # MissingDependencyError, or a broken install
        return 0
    return int(count) if int(err) == 0 else 0


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used here (no cuda-python, no driver, no device), or None when it can."""
    try:
        runtime = bindings()
    except MissingDependencyError as exc:
        return str(exc)
    err, count = runtime.cudaGetDeviceCount()
    if int(err) != 0 or not count:
        name, _ = _error_name(err) if int(err) != 0 else ("no device", "")
        if name == "cudaErrorInsufficientDriver":
            return f"no CUDA device ({name}: {_driver_hint(runtime)})"
        return f"no CUDA device ({name})"
    return None


def _driver_hint(runtime: Any) -> str:
    """What cudaErrorInsufficientDriver means here: the driver is older than cuda-python's CUDA."""
    try:
        err, version = runtime.cudaDriverGetVersion()  # the newest CUDA the driver supports; 0: none
        driver = (
            f"CUDA {int(version) // 1000}.{int(version) % 1000 // 10}" if int(err) == 0 and version else None
        )
    except Exception:  # the question is only for the message
        driver = None
    try:
        from importlib.metadata import version as package_version

        bindings_version = package_version("cuda-python")
    except Exception:
        bindings_version = "?"
    found = f"this driver supports {driver}" if driver else "no usable NVIDIA driver was found"
    return (
        f"{found}; cuda-python {bindings_version} needs a driver for its CUDA major version: CUDA 13 "
        "(cuda-python 13.x, TensorRT cu13 wheels) needs driver >= 580, CUDA 12 needs >= 525. With an "
        "R525-R575 driver install the CUDA 12 build: pip install 'trt-cosy[gpu-cu12]'"
    )


def gpu_unavailable_reason() -> str | None:
    """Why TensorRT cannot run here (no tensorrt/cuda-python, no device), or None when it can.

    Checks the device count before anything touches TensorRT: creating a TensorRT runtime without a
    GPU crashes the process (docs/environment-notes.md).
    """
    reason = cuda_unavailable_reason()
    if reason is not None:
        return reason
    try:
        import tensorrt  # noqa: F401
    except ImportError as exc:
        return f"tensorrt is not installed ({exc}); pip install 'trt-cosy[gpu]'"
    return None


def native_handle(obj: Any) -> int:
    """The address behind a cuda-python handle (stream, event) as an int, as TensorRT takes it."""
    if obj is None:
        return 0
    global _NATIVE_HANDLE
    if _NATIVE_HANDLE is None:
        try:  # cuda-bindings >= 13: int(handle) is deprecated in favour of this helper
            from cuda.bindings.utils import get_cuda_native_handle as _NATIVE_HANDLE
        except ImportError:
            _NATIVE_HANDLE = int
    try:
        return int(_NATIVE_HANDLE(obj))
    except TypeError:  # a plain int (the CPU tests' fake bindings)
        return int(obj)


def device_info(device: int = 0) -> dict[str, Any]:
    """GPU name and compute capability of ``device`` (what an engine plan is tied to)."""
    prop = cuda_call(bindings().cudaGetDeviceProperties(device))
    name = prop.name.decode(errors="replace") if isinstance(prop.name, bytes) else str(prop.name)
    return {
        "name": name.rstrip("\x00").strip(),
        "compute_capability": f"{prop.major}.{prop.minor}",
        "total_memory": int(prop.totalGlobalMem),
    }


def memory_info() -> tuple[int, int]:
    """(free, total) device memory in bytes."""
    free, total = cuda_call(bindings().cudaMemGetInfo())
    return int(free), int(total)


def _aligned(nbytes: int) -> int:
    return max(_ALIGN, (int(nbytes) + _ALIGN - 1) // _ALIGN * _ALIGN)


@dataclass(frozen=True)
class Pitched:
    """A pitched view of linear memory (``cudaPitchedPtr``): ``ptr`` (device or pinned host address
    of the first byte copied), ``pitch`` bytes between rows, ``rows`` rows per slice (a slice is
    ``pitch · rows`` bytes)."""

    ptr: int
    pitch: int
    rows: int


def copy_3d_async(
    dst: Pitched, src: Pitched, width: int, height: int, depth: int, stream: Stream, kind: str
) -> None:
    """Copy ``depth`` slices of ``height`` rows of ``width`` bytes from ``src`` to ``dst``
    (``cudaMemcpy3DAsync``; ``kind``: "device" for device -> device, "to_device" for pinned host ->
    device). One call moves a strided box, e.g. one row's new position of every layer and head."""
    runtime = bindings()
    kinds = {
        "device": runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
        "to_device": runtime.cudaMemcpyKind.cudaMemcpyHostToDevice,
    }
    params = runtime.cudaMemcpy3DParms()
    params.srcPtr = runtime.make_cudaPitchedPtr(int(src.ptr), int(src.pitch), int(width), int(src.rows))
    params.dstPtr = runtime.make_cudaPitchedPtr(int(dst.ptr), int(dst.pitch), int(width), int(dst.rows))
    params.extent = runtime.make_cudaExtent(int(width), int(height), int(depth))
    params.kind = kinds[kind]
    cuda_call(runtime.cudaMemcpy3DAsync(params, stream.handle))


class _Resource:
    """free() + context manager + a __del__ that logs instead of raising."""

    def free(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __del__(self) -> None:
        try:
            self.free()
        except Exception as exc:  # interpreter shutdown, driver gone: log, never raise from __del__
            _LOGGER.debug("%s not freed cleanly: %r", type(self).__name__, exc)


class _GrowOnlyBuffer(_Resource):
    """Memory that only grows: ``resize`` reallocates only when asked for more bytes."""

    def __init__(self, nbytes: int = 0):
        self.ptr, self.nbytes = 0, 0
        if nbytes:
            self.resize(nbytes)

    def _allocate(self, nbytes: int) -> int:
        raise NotImplementedError

    def _release(self, ptr: int) -> None:
        raise NotImplementedError

    def resize(self, nbytes: int) -> bool:
        """Make room for ``nbytes``; True when it reallocated (old contents are lost then)."""
        if nbytes <= self.nbytes and self.ptr:
            return False
        size = _aligned(nbytes)
        self.free()
        self.ptr = self._allocate(size)
        self.nbytes = size
        return True

    def free(self) -> None:
        if self.ptr:
            ptr, self.ptr, self.nbytes = self.ptr, 0, 0
            self._release(ptr)


class DeviceBuffer(_GrowOnlyBuffer):
    """Device memory that only grows (``cudaMalloc``)."""

    def _allocate(self, nbytes: int) -> int:
        return int(cuda_call(bindings().cudaMalloc(nbytes)))

    def _release(self, ptr: int) -> None:
        cuda_call(bindings().cudaFree(ptr))

    def copy_from_async(self, host: PinnedBuffer, nbytes: int, stream: Stream) -> None:
        kind = bindings().cudaMemcpyKind.cudaMemcpyHostToDevice
        cuda_call(bindings().cudaMemcpyAsync(self.ptr, host.ptr, int(nbytes), kind, stream.handle))

    def copy_to_async(self, host: PinnedBuffer, nbytes: int, stream: Stream) -> None:
        kind = bindings().cudaMemcpyKind.cudaMemcpyDeviceToHost
        cuda_call(bindings().cudaMemcpyAsync(host.ptr, self.ptr, int(nbytes), kind, stream.handle))

    def copy_from_device_async(self, source: int, nbytes: int, stream: Stream) -> None:
        """Copy ``nbytes`` from the device address ``source`` into this buffer (stream ordered)."""
        kind = bindings().cudaMemcpyKind.cudaMemcpyDeviceToDevice
        cuda_call(bindings().cudaMemcpyAsync(self.ptr, int(source), int(nbytes), kind, stream.handle))


class PinnedBuffer(_GrowOnlyBuffer):
    """Page-locked host memory (fast, truly asynchronous copies) with numpy views."""

    def _allocate(self, nbytes: int) -> int:
        return int(cuda_call(bindings().cudaMallocHost(nbytes)))

    def _release(self, ptr: int) -> None:
        cuda_call(bindings().cudaFreeHost(ptr))

    def view(self, dtype: np.dtype | str, shape: tuple[int, ...]) -> np.ndarray:
        """A numpy array over the first bytes of the buffer (valid until the next growing resize)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if count * dtype.itemsize > self.nbytes:
            raise ValueError(
                f"{shape} {dtype} needs {count * dtype.itemsize} bytes; the buffer has {self.nbytes}"
            )
        raw = (ctypes.c_byte * self.nbytes).from_address(self.ptr)
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)


class Stream(_Resource):
    """A non-blocking CUDA stream (it does not synchronise with the legacy default stream)."""

    def __init__(self) -> None:
        runtime = bindings()
        self.handle: Any = cuda_call(runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking))

    @property
    def ptr(self) -> int:
        """The stream as an integer, as TensorRT's ``execute_async_v3(stream_handle)`` takes it."""
        return native_handle(self.handle)

    def synchronize(self) -> None:
        cuda_call(bindings().cudaStreamSynchronize(self.handle))

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event`` (no host synchronisation)."""
        cuda_call(bindings().cudaStreamWaitEvent(self.handle, event.handle, 0))

    def free(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            cuda_call(bindings().cudaStreamDestroy(handle))


class Event(_Resource):
    """A CUDA event: ``record`` on one stage's stream, ``Stream.wait`` on the next's."""

    def __init__(self, timing: bool = False):
        runtime = bindings()
        flags = runtime.cudaEventDefault if timing else runtime.cudaEventDisableTiming
        self.handle: Any = cuda_call(runtime.cudaEventCreateWithFlags(flags))

    def record(self, stream: Stream) -> Event:
        cuda_call(bindings().cudaEventRecord(self.handle, stream.handle))
        return self

    def synchronize(self) -> None:
        cuda_call(bindings().cudaEventSynchronize(self.handle))

    def done(self) -> bool:
        """True when the work before the recorded point has finished (never blocks)."""
        runtime = bindings()
        err = runtime.cudaEventQuery(self.handle)
        err = err[0] if isinstance(err, tuple) else err
        if int(err) == int(runtime.cudaError_t.cudaErrorNotReady):
            return False
        cuda_call(err)
        return True

    def elapsed_ms(self, start: Event) -> float:
        """Milliseconds from ``start`` to this event (both created with ``timing=True``)."""
        return float(cuda_call(bindings().cudaEventElapsedTime(start.handle, self.handle)))

    def free(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            cuda_call(bindings().cudaEventDestroy(handle))


class CudaGraph(_Resource):
    """An executable CUDA graph captured from the work one callable queues on one stream.

    ``capture`` brackets ``work`` with ``cudaStreamBeginCapture`` (thread-local mode: other threads'
    CUDA calls are not disturbed) and ``cudaStreamEndCapture`` and instantiates the graph; ``launch``
    replays it on a stream with one call. The captured launches keep the device addresses they had:
    the caller keys its graphs by everything they bake in (profile, shapes, bound addresses).
    """

    def __init__(self, handle: Any):
        self.handle: Any = handle

    @classmethod
    def capture(cls, stream: Stream, work: Any) -> CudaGraph:
        runtime = bindings()
        mode = runtime.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal
        cuda_call(runtime.cudaStreamBeginCapture(stream.handle, mode))
        try:
            work()
        except BaseException:
            try:  # end the capture whatever happened; the partial graph is dropped
                cuda_call(runtime.cudaGraphDestroy(cuda_call(runtime.cudaStreamEndCapture(stream.handle))))
            except CudaError as exc:
                _LOGGER.debug("ending a failed capture: %s", exc)
            raise
        graph = cuda_call(runtime.cudaStreamEndCapture(stream.handle))
        try:
            executable = cuda_call(runtime.cudaGraphInstantiate(graph, 0))
        finally:
            cuda_call(runtime.cudaGraphDestroy(graph))
        return cls(executable)

    def launch(self, stream: Stream) -> None:
        cuda_call(bindings().cudaGraphLaunch(self.handle, stream.handle))

    def free(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            cuda_call(bindings().cudaGraphExecDestroy(handle))
