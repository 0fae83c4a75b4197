"""TrtRunner's CUDA plumbing on a GPU without TensorRT: launch overhead and copy bandwidth.

    python bench/gpu_plumbing.py [--launches 2000] [--json OUT]

TrtRunner is driven by ``CopyEngine``, an engine-like object whose ``execute_async_v3`` queues a
device-to-device copy of its input to its output on the launch stream. What it measures is what
the runtime adds around a real TensorRT launch: ``infer`` (profile/shape bookkeeping, pinned
staging, two copies, one stream synchronize) and ``enqueue`` (address binding + launch, no sync),
in microseconds per call, plus pinned host<->device bandwidth. tests/test_cuda_gpu.py uses the
same ``CopyEngine`` to check correctness on a real device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from trt_cosy.runtime.backends.tensorrt import cuda
from trt_cosy.runtime.backends.tensorrt.runner import TrtRunner
from trt_cosy.runtime.profiles import GraphProfiles, ShapeProfile

# What TrtRunner asks of the tensorrt module: tensor directions, dtype conversion, allocation strategies.
COPY_TRT = SimpleNamespace(
    TensorIOMode=SimpleNamespace(INPUT="in", OUTPUT="out"),
    nptype=lambda dtype: dtype,
    ExecutionContextAllocationStrategy=SimpleNamespace(STATIC=0, ON_PROFILE_CHANGE=1, USER_MANAGED=2),
)

# Mel-shaped frames [1, T, 80]: a short (streaming chunk) and a long (utterance) profile.
COPY_PROFILES = GraphProfiles(
    "copy",
    (
        ShapeProfile("short", {"x": ((1, 1, 80), (1, 64, 80), (1, 256, 80))}),
        ShapeProfile("long", {"x": ((1, 1, 80), (1, 1024, 80), (1, 4096, 80))}),
    ),
)


class CopyContext:
    """y = x as a device-to-device copy queued on the launch stream (an execution-context stand-in)."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.addresses: dict[str, int] = {}
        self.memory: tuple[int, int] | None = None
        self.launches = 0

    def set_device_memory(self, memory: int, size: int) -> None:
        self.memory = (int(memory), int(size))  # a copy needs no activation memory; kept for the report

    def set_optimization_profile_async(self, index: int, stream: int) -> bool:
        self.shapes = {}
        return True

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        self.shapes[name] = tuple(shape)
        return True

    def get_tensor_shape(self, name: str) -> tuple[int, ...]:
        return self.shapes["x"]

    def set_tensor_address(self, name: str, ptr: int) -> bool:
        self.addresses[name] = int(ptr)
        return True

    def execute_async_v3(self, stream_handle: int) -> bool:
        runtime = cuda.bindings()
        nbytes = int(np.prod(self.shapes["x"])) * 4  # float32
        kind = runtime.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        cuda.cuda_call(
            runtime.cudaMemcpyAsync(self.addresses["y"], self.addresses["x"], nbytes, kind, stream_handle)
        )
        self.launches += 1
        return True


class CopyEngine:
    """An engine-like object with one float32 input ``x`` and one output ``y`` of the same shape,
    holding ``COPY_PROFILES`` once per slot as a plan built with ``build_plan(slots=...)`` does."""

    num_io_tensors = 2

    def __init__(self, slots: int = 1) -> None:
        self.contexts: list[CopyContext] = []
        self.num_optimization_profiles = len(COPY_PROFILES.profiles) * slots

    def is_shape_inference_io(self, name: str) -> bool:
        return False

    def get_tensor_profile_shape(self, name: str, index: int) -> list[tuple[int, ...]]:
        return list(COPY_PROFILES.profiles[index % len(COPY_PROFILES.profiles)].shapes[name])

    def get_device_memory_size_for_profile_v2(self, index: int) -> int:
        return 0

    def get_tensor_name(self, index: int) -> str:
        return ("x", "y")[index]

    def get_tensor_mode(self, name: str) -> str:
        return "in" if name == "x" else "out"

    def get_tensor_dtype(self, name: str) -> type:
        return np.float32

    def create_execution_context(self, strategy: int = 0) -> CopyContext:
        self.contexts.append(CopyContext())
        return self.contexts[-1]


def copy_runner(slots: int = 1) -> TrtRunner:
    """A TrtRunner over a fresh ``CopyEngine``."""
    return TrtRunner(CopyEngine(slots), "copy", COPY_PROFILES, trt=COPY_TRT, slots=slots)


def _per_call_us(call, count: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean microseconds per call of ``count`` calls."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            call()
        samples.append((time.perf_counter() - start) / count * 1e6)
    return statistics.median(samples)


def _bandwidth_gbs(nbytes: int, upload: bool) -> float:
    with cuda.PinnedBuffer(nbytes) as host, cuda.DeviceBuffer(nbytes) as device, cuda.Stream() as stream:
        start, end = cuda.Event(timing=True), cuda.Event(timing=True)
        copy = device.copy_from_async if upload else device.copy_to_async
        copy(host, nbytes, stream)  # warm-up
        start.record(stream)
        for _ in range(10):
            copy(host, nbytes, stream)
        end.record(stream)
        end.synchronize()
        return 10 * nbytes / end.elapsed_ms(start) / 1e6


def measure(launches: int) -> dict[str, float]:
    """Launch overheads (µs per call) and pinned copy bandwidths (GB/s)."""
    results: dict[str, float] = {}
    with copy_runner() as runner:
        for frames in (64, 1024):
            feed = {"x": np.zeros((1, frames, 80), np.float32)}  # [1, T, 80]
            runner.infer(feed)
            results[f"infer_us_{frames}_frames"] = _per_call_us(lambda f=feed: runner.infer(f), launches // 4)
        runner.set_shapes({"x": (1, 64, 80)})
        results["enqueue_us"] = _per_call_us(runner.enqueue, launches)
        runner.stream().synchronize()
    size = 256 << 20
    results["upload_gbs"] = _bandwidth_gbs(size, upload=True)
    results["download_gbs"] = _bandwidth_gbs(size, upload=False)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launches", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    reason = cuda.cuda_unavailable_reason()
    if reason is not None:
        print(f"cannot measure: {reason}", file=sys.stderr)
        return 2
    report = {"device": cuda.device_info(), **measure(args.launches)}
    for key, value in report.items():
        print(f"{key:<24} {value:.2f}" if isinstance(value, float) else f"{key:<24} {value}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
