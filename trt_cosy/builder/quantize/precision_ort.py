"""The fp16 pass's ONNX Runtime measurements: fp32 activation ranges (calibration) and fp16-vs-fp32 error.

Build time only (onnx, onnxruntime); ``builder.quantize.precision`` re-exports both functions.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ...errors import TrtCosyError

__all__ = ["compare_fp16", "tensor_ranges"]

FP32 = TensorProto.FLOAT


def compare_fp16(
    fp32_path: Path, fp16_path: Path, feeds: Iterable[Mapping[str, np.ndarray]], threads: int | None = None
) -> dict[str, float]:
    """Run both graphs on ONNX Runtime (CPU) and return, per output, the max over ``feeds`` of
    max |fp16 - fp32| / max(1, max |fp32|). A NaN or inf in the fp16 outputs raises ``TrtCosyError``.

    ORT's CPU provider stores fp16 tensors in fp16 but computes ops without fp16 kernels in fp32
    (it inserts the casts), so this measures the storage rounding and the fp32 islands, much as
    TensorRT's fp16 kernels with fp32 accumulation do; it is an estimate, not a TensorRT run.
    """
    from ...runtime.backends.onnxruntime.runner import OrtRunner  # onnxruntime is needed only here

    reference = OrtRunner.from_path(fp32_path, "fp32", threads, exported=True)
    candidate = OrtRunner.from_path(fp16_path, "fp16", threads, exported=True)
    errors = dict.fromkeys(reference.output_names, 0.0)
    for feed in feeds:
        expected, got = reference.infer(feed), candidate.infer(feed)
        for name, value in expected.items():
            result = got[name].astype(np.float64)
            if not np.isfinite(result).all():
                raise TrtCosyError(
                    f"fp16 graph {fp16_path}: output '{name}' has NaN/inf; an fp32 island is missing "
                    "(see trt_cosy/builder/quantize/policies.py)."
                )
            if value.size:
                scale = max(1.0, float(np.abs(value).max()))
                errors[name] = max(errors[name], float(np.abs(result - value).max()) / scale)
    return errors


def tensor_ranges(
    model: onnx.ModelProto,
    types: Mapping[str, int],
    feeds: Iterable[Mapping[str, np.ndarray]],
    base_dir: Path | None = None,
) -> dict[str, float]:
    """Max |value| of every float32 node output of ``model`` over ``feeds`` (ONNX Runtime, CPU, no
    graph optimisation; NaN/inf give inf). External weights are resolved next to ``base_dir``."""
    import onnxruntime as ort  # build time only

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    declared = {v.name for v in probe.graph.output}
    names = [
        o for n in probe.graph.node for o in n.output if o and types.get(o) == FP32 and o not in declared
    ]
    probe.graph.output.extend(helper.make_tensor_value_info(name, FP32, None) for name in names)
    directory = Path(base_dir) if base_dir is not None else Path(tempfile.gettempdir())
    handle, temp = tempfile.mkstemp(prefix=".calibrate.", suffix=".onnx", dir=directory)
    os.close(handle)
    try:
        onnx.save_model(probe, temp)  # weights stay where they were: external data resolves next to it
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(temp, options, providers=["CPUExecutionProvider"])
    finally:
        Path(temp).unlink(missing_ok=True)
    outputs = [o.name for o in session.get_outputs()]
    peaks = dict.fromkeys(outputs, 0.0)
    for feed in feeds:
        for name, value in zip(outputs, session.run(outputs, dict(feed)), strict=True):
            if value.size and np.issubdtype(value.dtype, np.floating):
                peak = float(np.abs(value).max())
                peaks[name] = max(peaks[name], peak if np.isfinite(peak) else np.inf)
    return peaks
