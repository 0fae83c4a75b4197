"""Small stand-ins for the release's ``campplus.onnx`` and ``speech_tokenizer_v2.onnx``.

Test models need both files so the whole pipeline runs end to end without real weights. The
stand-ins have the official input/output names, ranks and dtypes and behave plausibly:
the speaker model averages fbank frames through a random projection to 192 dims; the tokenizer
pools the whisper log-mel 4:1 in time (100 Hz → 25 Hz), projects to 8 dims and quantises each
to 3 levels (an FSQ 3^8 code in [0, 6561)), like the real 25 Hz tokenizer's output range.
They are NOT the real models and are only written by ``trt-cosy make-test-model``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["write_standin_campplus", "write_standin_speech_tokenizer"]

_OPSET = 18


def _save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="trt-cosy")
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def write_standin_campplus(path: Path, rng: np.random.Generator) -> None:
    """``input`` float32 [1, T, 80] (mean-normalised kaldi fbank) → ``output`` float32 [1, 192]."""
    weight = (rng.standard_normal((80, 192)) / np.sqrt(80)).astype(np.float32)
    bias = (0.1 * rng.standard_normal(192)).astype(np.float32)
    nodes = [
        helper.make_node("ReduceMean", ["input", "axes"], ["pooled"], keepdims=0),  # [1, 80]
        helper.make_node("MatMul", ["pooled", "weight"], ["projected"]),  # [1, 192]
        helper.make_node("Add", ["projected", "bias"], ["output"]),
    ]
    graph = helper.make_graph(
        nodes,
        "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 192])],
        initializer=[
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
            numpy_helper.from_array(weight, "weight"),
            numpy_helper.from_array(bias, "bias"),
        ],
    )
    _save(graph, path)


def write_standin_speech_tokenizer(path: Path, rng: np.random.Generator) -> None:
    """``feats`` float32 [1, 128, T], ``feats_length`` int32 [1] → ``indices`` int32 [1, T // 4]."""
    weight = (rng.standard_normal((128, 8)) / np.sqrt(128) * 3.0).astype(np.float32)
    powers = (3.0 ** np.arange(8)).astype(np.float32).reshape(8, 1)
    nodes = [
        helper.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[4], strides=[4]),  # [1, 128, T']
        helper.make_node("Transpose", ["pooled"], ["frames"], perm=[0, 2, 1]),  # [1, T', 128]
        helper.make_node("MatMul", ["frames", "weight"], ["projected"]),  # [1, T', 8]
        helper.make_node("Tanh", ["projected"], ["bounded"]),  # (-1, 1)
        helper.make_node("Add", ["bounded", "one"], ["shifted"]),  # (0, 2)
        helper.make_node("Round", ["shifted"], ["digits"]),  # {0, 1, 2}
        helper.make_node("MatMul", ["digits", "powers"], ["code"]),  # [1, T', 1]
        helper.make_node("Squeeze", ["code", "last_axis"], ["code_flat"]),  # [1, T']
        helper.make_node("Cast", ["code_flat"], ["indices"], to=TensorProto.INT32),
    ]
    graph = helper.make_graph(
        nodes,
        "speech_tokenizer_v2_standin",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "T_tokens"])],
        initializer=[
            numpy_helper.from_array(weight, "weight"),
            numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
            numpy_helper.from_array(powers, "powers"),
            numpy_helper.from_array(np.array([2], dtype=np.int64), "last_axis"),
        ],
    )
    _save(graph, path)
