"""Which backend and precision ``trt-cosy build`` / ``say`` / ``serve`` use when ``--backend`` is not given.

The machine decides: TensorRT fp16 where a CUDA GPU and TensorRT are present, else the fastest CPU
engines that pass the quality guard and run here (``CPU_PICKS``: bf16-capable CPUs get one, others another). The pick is data, with the reason that the CLI
prints in one line and the build records in the manifest (``backend_reason``).

Detection never creates a TensorRT object: the CUDA device count is asked first (via cuda-python,
``runtime.backends.tensorrt.cuda``) and ``tensorrt`` is imported only when a device was found and the package is
installed (creating a TensorRT runtime without a GPU crashes the process, docs/environment-notes.md).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Final

__all__ = [
    "AUTO", "BackendChoice", "CPU_PICKS", "CpuPick", "cpu_pick", "DEFAULT_PRECISIONS", "GPU_PICK",
    "choose_backend", "gpu_unavailable_reason", "resolve_backend"
]

_LOGGER = logging.getLogger(__name__)

AUTO: Final = "auto"
GPU_PICK: Final = ("tensorrt", "fp16")


@dataclass(frozen=True)
class CpuPick:
    """One CPU default: its engines, whether it needs bfloat16 kernels (OpenVINO's ``BF16`` capability:
    AVX512-BF16 or AMX, with the ``openvino`` package installed) and why it is picked."""

    backend: str
    precision: str
    needs_bf16: bool
    reason: str


# The CPU defaults, best first: the first whose hardware need this machine meets is picked. Measured
# at full size on the 2-core Zen 4 machine (docs/benchmarks.md, "Mixed engines" and "Streaming",
# 2026-12-01): mixed int4 (the ONNX Runtime int4 LLM, OpenVINO bf16 flow and fp32 HiFT) is 6 % faster
# without streaming (RTF 0.825 vs 0.875, median of 3 alternating) but peaks at 2.05 GB against 1.30 GB.
# Both carry the incremental streaming estimator now (mixed: bf16 on OpenVINO; docs/benchmarks.md,
# "Mixed engines with the incremental streaming estimator"). ONNX Runtime int4 stays the default on
# every CPU until mixed wins streaming and memory too; `--backend mixed` is one option away. A bf16-only pick goes first here once it wins
# both ways (CpuPick(..., needs_bf16=True, ...)).
CPU_PICKS: Final = (
    CpuPick("onnxruntime", "int4", False, "ONNX Runtime int4 is the fastest measured CPU engine"),
)
# What each backend builds (builder.engines checks the same; kept here so the runtime needs no build import).
_PRECISIONS: Final = {
    "tensorrt": ("fp16", "fp32"),
    "onnxruntime": ("fp32", "int8", "int4"),
    "openvino": ("fp32", "bf16", "int8", "int4"),
    "mixed": ("fp32", "int8", "int4"),  # the LLM's precision on ONNX Runtime (builder.mixed)
}
DEFAULT_PRECISIONS: Final = {"onnxruntime": "int4", "tensorrt": "fp16", "openvino": "bf16", "mixed": "int4"}


@dataclass(frozen=True)
class BackendChoice:
    """A backend, its precision and why they were chosen (one short clause)."""

    backend: str
    precision: str
    reason: str

    def line(self) -> str:
        """What the CLI prints: ``backend: onnxruntime int4 (<reason>)``."""
        return f"backend: {self.backend} {self.precision} ({self.reason})"


def gpu_unavailable_reason() -> str | None:
    """Why TensorRT engines cannot run here, or None when a CUDA device and TensorRT are present.

    Never raises: a broken cuda-python or driver counts as no GPU.
    """
    try:
        installed = importlib.util.find_spec("tensorrt") is not None
    except (ImportError, ValueError):  # a broken or half-removed installation
        installed = False
    if not installed:
        return "tensorrt is not installed"
    try:
        from .backends.tensorrt.cuda import gpu_unavailable_reason as cuda_reason

        return cuda_reason()  # device count first, then `import tensorrt` (no TensorRT object)
    except Exception as exc:  # a broken install must not stop a CPU build
        _LOGGER.info("CUDA detection failed: %r", exc)
        return f"CUDA detection failed ({type(exc).__name__})"


def cpu_has_bf16_kernels() -> bool:
    """Whether OpenVINO is installed and its CPU plugin has bfloat16 kernels here. Never raises."""
    try:
        if importlib.util.find_spec("openvino") is None:
            return False
        from .backends.openvino.runner import cpu_has_bf16

        return cpu_has_bf16()
    except Exception as exc:  # a broken install must not stop a CPU build
        _LOGGER.info("OpenVINO bf16 detection failed: %r", exc)
        return False


def cpu_pick() -> CpuPick:
    """The first of ``CPU_PICKS`` this machine can run (the last needs nothing)."""
    for pick in CPU_PICKS:
        if not pick.needs_bf16 or cpu_has_bf16_kernels():
            return pick
    return CPU_PICKS[-1]


def choose_backend(precision: str | None = None) -> BackendChoice:
    """The backend for this machine, at ``precision`` when given (else the pick's own precision).

    A CUDA GPU with TensorRT: ``GPU_PICK``; otherwise ``cpu_pick()``. A ``precision`` the picked backend
    does not build moves to the CPU pick's backend, else to the first backend that builds it.
    """
    missing = gpu_unavailable_reason()
    cpu = None
    if missing is None:
        backend, default, reason = *GPU_PICK, "CUDA GPU with TensorRT found"
    else:
        _LOGGER.info("no TensorRT engines here: %s", missing)
        cpu = cpu_pick()
        if precision not in (None, cpu.precision):  # another precision: the portable pick's backend
            cpu = CPU_PICKS[-1]
        backend, default = cpu.backend, cpu.precision
        reason = f"no CUDA GPU with TensorRT here; {cpu.reason}"
    if precision is None or precision in _PRECISIONS[backend]:
        return BackendChoice(backend, precision or default, reason)
    for other in ((cpu or cpu_pick()).backend, *_PRECISIONS):
        if precision in _PRECISIONS[other]:
            return BackendChoice(other, precision, f"{backend} has no {precision} engines; {reason}")
    raise ValueError(f"no backend builds precision {precision!r}")


def resolve_backend(backend: str | None, precision: str | None = None) -> BackendChoice:
    """``choose_backend`` for ``"auto"`` / None; an explicit backend wins (its default precision)."""
    if backend in (None, AUTO):
        return choose_backend(precision)
    return BackendChoice(backend, precision or DEFAULT_PRECISIONS[backend], f"--backend {backend} given")
