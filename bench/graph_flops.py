"""Count the arithmetic of an exported graph at given input sizes: weight MatMul, activation MatMul, Conv.

    python bench/graph_flops.py ENGINES/flow_estimator.onnx --dim F=600
    python bench/graph_flops.py ENGINES/hift.onnx --dim F=500 --dim 480*F=240000 --dim S=0

Symbolic input dimensions are set with ``--dim NAME=VALUE`` and ONNX shape inference propagates
them. A MatMul whose second input is an initializer is a weight MatMul (what weight quantisation
speeds up); one with two activations (attention scores and values) is not. Prints GFLOP per call
(multiply-add = 2 FLOP) and how many nodes' shapes stayed unknown.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import shape_inference


def _set_dims(model: onnx.ModelProto, dims: dict[str, int]) -> None:
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in dims:
                dim.dim_value = dims[dim.dim_param]


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    shapes = {}
    for value in (*model.graph.value_info, *model.graph.input, *model.graph.output):
        dims = value.type.tensor_type.shape.dim
        shapes[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    return shapes


def count_flops(model: onnx.ModelProto, dims: dict[str, int]) -> dict[str, float]:
    """GFLOP per call by kind, plus ``unknown`` (nodes whose shapes inference could not resolve)."""
    _set_dims(model, dims)
    model = shape_inference.infer_shapes(model, data_prop=True)
    shapes, weights = _shapes(model), {init.name: list(init.dims) for init in model.graph.initializer}
    totals = {"weight_matmul": 0.0, "activation_matmul": 0.0, "conv": 0.0, "unknown": 0.0}
    for node in model.graph.node:
        if node.op_type == "MatMul":
            a = shapes.get(node.input[0]) or weights.get(node.input[0])
            b = weights.get(node.input[1]) or shapes.get(node.input[1])
            if not a or not b or None in a or None in b:
                totals["unknown"] += 1
                continue
            batch = int(np.prod(a[:-2])) if len(a) > 2 else 1
            kind = "weight_matmul" if node.input[1] in weights else "activation_matmul"
            totals[kind] += 2.0 * batch * a[-2] * a[-1] * b[-1] / 1e9
        elif node.op_type in ("Conv", "ConvTranspose"):
            kernel = weights.get(node.input[1])
            sized = shapes.get(node.output[0] if node.op_type == "Conv" else node.input[0])
            if not kernel or not sized or None in sized:
                totals["unknown"] += 1
                continue
            totals["conv"] += 2.0 * float(np.prod(sized)) * float(np.prod(kernel[1:])) / 1e9
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graph", type=Path)
    parser.add_argument("--dim", action="append", default=[], help="NAME=VALUE for a symbolic input dim")
    args = parser.parse_args(argv)
    try:
        dims = {name: int(value) for name, value in (item.split("=", 1) for item in args.dim)}
    except ValueError:
        parser.error("--dim takes NAME=VALUE with an integer VALUE")
    totals = count_flops(onnx.load(str(args.graph)), dims)
    for kind, value in totals.items():
        print(f"{kind:<18} {value:10.1f}" + ("" if kind == "unknown" else " GFLOP"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
