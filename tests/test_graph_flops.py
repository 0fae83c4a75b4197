"""bench/graph_flops.py counts weight MatMul, activation MatMul and Conv work of a graph."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

from onnx import TensorProto, helper, numpy_helper

_SPEC = importlib.util.spec_from_file_location(
    "graph_flops", Path(__file__).parents[1] / "bench" / "graph_flops.py"
)
graph_flops = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(graph_flops)


def _toy_model():
    weight = numpy_helper.from_array(np.zeros((16, 8), np.float32), "w")  # [K, N]
    kernel = numpy_helper.from_array(np.zeros((4, 1, 3), np.float32), "k")  # [C_out, C_in, 3]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),  # [2, T, 16] x [16, 8]
        helper.make_node("Transpose", ["h"], ["ht"], perm=[0, 2, 1]),  # [2, 8, T]
        helper.make_node("MatMul", ["h", "ht"], ["scores"]),  # [2, T, 8] x [2, 8, T]
        helper.make_node("Conv", ["sig", "k"], ["y"], pads=[1, 1]),  # [1, 1, S] -> [1, 4, S]
    ]
    graph = helper.make_graph(
        nodes,
        "toy",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "T", 16]),
            helper.make_tensor_value_info("sig", TensorProto.FLOAT, [1, 1, "S"]),
        ],
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
        ],
        [weight, kernel],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_counts_each_kind_at_the_given_sizes():
    totals = graph_flops.count_flops(_toy_model(), {"T": 10, "S": 100})
    assert abs(totals["weight_matmul"] - 2 * 2 * 10 * 16 * 8 / 1e9) < 1e-12, totals
    assert abs(totals["activation_matmul"] - 2 * 2 * 10 * 8 * 10 / 1e9) < 1e-12, totals
    assert abs(totals["conv"] - 2 * 4 * 100 * 3 / 1e9) < 1e-12, totals
    assert totals["unknown"] == 0, totals


def test_unresolved_sizes_are_reported_not_guessed():
    totals = graph_flops.count_flops(_toy_model(), {"T": 10})  # S left symbolic
    assert totals["conv"] == 0 and totals["unknown"] == 1, totals
