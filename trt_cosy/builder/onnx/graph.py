"""A producer/consumer index over an ONNX graph and the small edits the graph rewrites share.

Used by ``builder.onnx.rewrites`` (estimators) and ``builder.onnx.llm_rewrites`` (Qwen2 LLM): constant
lookup, single-consumer walks, the attention head-split trace, dead-node removal, opset imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = [
    "MS_DOMAIN",
    "HEADS_PERM",
    "GraphIndex",
    "HeadInput",
    "attribute",
    "trace_head_input",
    "is_scalar",
    "fuse_sites",
    "replace_nodes",
    "drop_dead_nodes",
    "ensure_opset",
]

MS_DOMAIN: Final = "com.microsoft"
_LAYOUT_OPS: Final = frozenset({"Reshape", "Transpose"})
HEADS_PERM: Final = [0, 2, 1, 3]  # [B, T, H, Dh] <-> [B, H, T, Dh]


class GraphIndex:
    """Producer/consumer index over a graph's nodes plus constant lookup (initializers, Constant)."""

    def __init__(self, graph: onnx.GraphProto):
        self.graph = graph
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.initializers = {tensor.name: tensor for tensor in graph.initializer}
        self.outputs = {value.name for value in graph.output}

    def constant(self, name: str) -> np.ndarray | None:
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    return numpy_helper.to_array(attribute.t)
        return None

    def only_consumer(self, name: str) -> onnx.NodeProto | None:
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None


def attribute(node: onnx.NodeProto, name: str, default=None):
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


@dataclass
class HeadInput:
    """One attention operand traced back to its [B, T, H·Dh] projection."""

    source: str  # tensor name of the projection output
    heads: int
    head_dim: int
    scale: float  # product of scalar Muls met on the way


def trace_head_input(index: GraphIndex, name: str) -> HeadInput | None:
    """Walk up layout ops and scalar Muls to ``Transpose[0,2,1,3](Reshape(proj, [.., .., H, Dh]))``."""
    scale = 1.0
    split = None  # (reshape node, source) of the last head split seen
    current = name
    while True:
        node = index.producer.get(current)
        if node is None:
            break
        if node.op_type == "Mul":
            values = [index.constant(i) for i in node.input]
            scalar = [v for v in values if v is not None and v.size == 1]
            if len(scalar) != 1:
                break
            scale *= float(scalar[0].reshape(()))
            current = node.input[0] if values[1] is not None and values[1].size == 1 else node.input[1]
            continue
        if node.op_type not in _LAYOUT_OPS:
            break
        if node.op_type == "Transpose" and list(attribute(node, "perm", [])) == HEADS_PERM:
            reshape = index.producer.get(node.input[0])
            if reshape is not None and reshape.op_type == "Reshape":
                split = reshape
        current = node.input[0]
    if split is None or current != split.input[0]:
        return None  # the walk must end exactly at the head split's input
    shape = index.constant(split.input[1])
    if shape is None or shape.size != 4 or shape[2] <= 0 or shape[3] <= 0:
        return None
    return HeadInput(split.input[0], int(shape[2]), int(shape[3]), scale)


def is_scalar(index: GraphIndex, name: str, value: float) -> bool:
    array = index.constant(name)
    return (
        array is not None and array.size == 1 and abs(float(array.reshape(())) - value) <= 1e-6 * abs(value)
    )


def fuse_sites(
    model: onnx.ModelProto,
    anchor: str,
    match: Callable[[GraphIndex, onnx.NodeProto, int], onnx.NodeProto | None],
) -> int:
    """Call ``match(index, node, number)`` on every ``anchor``-type node; each node it returns takes
    the place of the node producing its first output (``replace_nodes``). Returns how many did."""
    index = GraphIndex(model.graph)
    replacements: dict[str, onnx.NodeProto] = {}
    for node in [n for n in model.graph.node if n.op_type == anchor]:
        fused = match(index, node, len(replacements))
        if fused is not None:
            replacements[fused.output[0]] = fused
    if replacements:
        replace_nodes(model, replacements)
    return len(replacements)


def replace_nodes(model: onnx.ModelProto, replacements: dict[str, onnx.NodeProto]) -> None:
    """Put ``replacements[first output]`` in place of the node producing that output, then drop
    what no graph output needs any more and import the Microsoft domain."""
    nodes = [replacements.get(node.output[0], node) if node.output else node for node in model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    drop_dead_nodes(model.graph)
    ensure_opset(model, MS_DOMAIN, 1)


def drop_dead_nodes(graph: onnx.GraphProto) -> None:
    """Remove nodes none of whose outputs reach a graph output (iterated to a fixed point)."""
    needed = {value.name for value in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(out in needed for out in node.output):
            keep.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    used = {name for node in graph.node for name in node.input}
    unused = [tensor for tensor in graph.initializer if tensor.name not in used]
    for tensor in unused:
        graph.initializer.remove(tensor)


def ensure_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    if not any(opset.domain == domain for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, version))
