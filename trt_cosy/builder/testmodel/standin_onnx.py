"""Small stand-ins for the release's ``campplus.onnx`` and speech tokenizer ONNX files.

Test models need both so the whole pipeline runs end to end without real weights. The
stand-ins have the official input/output names, ranks and dtypes and behave plausibly:
the speaker model averages fbank frames through a random projection to 192 dims; the 25 Hz
tokenizers (``speech_tokenizer_v2.onnx``, ``speech_tokenizer_v3.onnx``) pool the whisper log-mel
4:1 in time (100 Hz → 25 Hz), project to 8 dims and quantise each to 3 levels (an FSQ 3^8 code in
[0, 6561)); the 50 Hz ``speech_tokenizer_v1.onnx`` pools 2:1 and quantises 6 dims to 4 levels
(a code in [0, 4096)), like the real tokenizers' output ranges.
They are NOT the real models and are only written by ``trt-cosy make-test-model``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "write_standin_campplus",
    "write_standin_speech_tokenizer",
    "write_standin_speech_tokenizer_v1",
]

_OPSET = 18


def _save(graph: onnx.GraphProto, path: Path) -> None:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", _OPSET)], producer_name="trt-cosy"
    )
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


def write_standin_speech_tokenizer(
    path: Path, rng: np.random.Generator, graph_name: str = "speech_tokenizer_v2_standin"
) -> None:
    """25 Hz: ``feats`` float32 [1, 128, T], ``feats_length`` int32 [1] → ``indices`` int32 [1, T // 4].

    ``graph_name``: ``speech_tokenizer_v2_standin`` (CosyVoice2) or ``speech_tokenizer_v3_standin``.
    """
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
    initializers = [
        numpy_helper.from_array(weight, "weight"),
        numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"),
        numpy_helper.from_array(powers, "powers"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "last_axis"),
    ]
    _save(_tokenizer_graph(nodes, graph_name, initializers), path)


def write_standin_speech_tokenizer_v1(path: Path, rng: np.random.Generator) -> None:
    """50 Hz: ``feats`` float32 [1, 128, T], ``feats_length`` int32 [1] → ``indices`` int32 [1, T // 2].

    Each token is 6 projected dims quantised to 4 levels: a code in [0, 4096) like CosyVoice 1's.
    """
    digits, levels = 6, 4
    weight = (rng.standard_normal((128, digits)) / np.sqrt(128) * 3.0).astype(np.float32)
    powers = (float(levels) ** np.arange(digits)).astype(np.float32).reshape(digits, 1)
    half_range = np.array((levels - 1) / 2, dtype=np.float32)
    nodes = [
        helper.make_node("AveragePool", ["feats"], ["pooled"], kernel_shape=[2], strides=[2]),  # [1, 128, T']
        helper.make_node("Transpose", ["pooled"], ["frames"], perm=[0, 2, 1]),  # [1, T', 128]
        helper.make_node("MatMul", ["frames", "weight"], ["projected"]),  # [1, T', 6]
        helper.make_node("Tanh", ["projected"], ["bounded"]),  # (-1, 1)
        helper.make_node("Mul", ["bounded", "half_range"], ["scaled"]),  # (-1.5, 1.5)
        helper.make_node("Add", ["scaled", "half_range"], ["shifted"]),  # (0, 3)
        helper.make_node("Round", ["shifted"], ["digits"]),  # {0, 1, 2, 3}
        helper.make_node("MatMul", ["digits", "powers"], ["code"]),  # [1, T', 1]
        helper.make_node("Squeeze", ["code", "last_axis"], ["code_flat"]),  # [1, T']
        helper.make_node("Cast", ["code_flat"], ["indices"], to=TensorProto.INT32),
    ]
    initializers = [
        numpy_helper.from_array(weight, "weight"),
        numpy_helper.from_array(half_range, "half_range"),
        numpy_helper.from_array(powers, "powers"),
        numpy_helper.from_array(np.array([2], dtype=np.int64), "last_axis"),
    ]
    _save(_tokenizer_graph(nodes, "speech_tokenizer_v1_standin", initializers), path)


def _tokenizer_graph(
    nodes: list[onnx.NodeProto], name: str, initializers: list[onnx.TensorProto]
) -> onnx.GraphProto:
    """The official speech tokenizer I/O around ``nodes``."""
    return helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "T_tokens"])],
        initializer=initializers,
    )
