"""Writing ONNX graphs the way every build step does: weights beside the graph when they are large.

Protobuf caps one file at 2 GiB, so a graph whose weights pass ``EXTERNAL_DATA_BYTES`` keeps them in
``<file>.data`` next to it (one file, tensors over 1 KiB); a stale ``.data`` from an earlier write is
removed first. Used by the fp16 pass, the quantiser and the flow step wrapper (the exporter writes
its own files through torch's ONNX program, with the same threshold).
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

import onnx
from onnx import external_data_helper

__all__ = ["EXTERNAL_DATA_BYTES", "save_onnx"]

EXTERNAL_DATA_BYTES: Final = 1 << 30
_EXTERNAL_TENSOR_BYTES: Final = 1024  # smaller tensors stay in the graph file


def save_onnx(model: onnx.ModelProto, path: Path, *, check: bool = False, full_check: bool = False) -> Path:
    """Save ``model`` to ``path`` (weights in ``<path>.data`` above ``EXTERNAL_DATA_BYTES``); with
    ``check`` run ``onnx.checker`` on the saved file (``full_check``: with shape and type inference)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    if sum(tensor.ByteSize() for tensor in model.graph.initializer) > EXTERNAL_DATA_BYTES:
        # Marked here rather than with save_model(save_as_external_data=True): onnx refuses that when
        # a file named like the data file exists in the *current* directory (it tests the bare name).
        for tensor in model.graph.initializer:
            if tensor.HasField("raw_data") and len(tensor.raw_data) >= _EXTERNAL_TENSOR_BYTES:
                external_data_helper.set_external_data(tensor, data.name)
    onnx.save_model(model, str(path))  # writes the marked tensors to <path>.data
    if check or full_check:
        onnx.checker.check_model(str(path), full_check=full_check)
    return path
