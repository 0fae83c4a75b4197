"""Estimator graph rewrites for ONNX Runtime's CPU provider (the U-Net and DiT flow estimators).

Applied to onnxruntime engines only (TensorRT gets the exported graphs through ``builder.quantize.precision``);
``builder.onnx.passes`` chooses them per graph and proves each rewritten graph equal to the export.

* **Attention** — the exporter spells ``scaled_dot_product_attention`` as
  ``MatMul(q·s, kᵀ·s) [+ bias] → Softmax → MatMul(·, v)`` with head split/merge transposes around it,
  which writes the [B, H, T, T] score tensor to memory four times per block. It becomes one
  ``com.microsoft.MultiHeadAttention`` on the [B, T, H·Dh] projections. Without a bias input ORT
  runs its tiled (flash) kernel, which keeps score tiles in cache: that is the non-streaming
  estimator, whose bias is the key-padding mask and therefore all zeros for unpadded rows — and
  trt-cosy never pads (``FlowStage`` feeds an all-ones mask; the fused graph says so in its
  ``doc_string``). The chunk-streaming estimator keeps its bias as ``attention_bias``.
* **Mish** — ORT expands ``Mish`` into ``Softplus → Tanh → Mul``, whose Softplus is scalar code.
  ``tanh(softplus(x)) = n / (n + 2)`` with ``n = eˣ(eˣ + 2)`` is exact algebra on vectorised ops
  (x is clamped at 20, where the ratio is 1 in float32).
* **GELU** — the exported erf GELU ``x · (erf(x / √2) + 1) · 0.5`` becomes ``com.microsoft.Gelu``;
  the tanh GELU of the CosyVoice3 DiT (``nn.GELU(approximate="tanh")``, exported as
  ``x · (tanh(√(2/π) · (x + 0.044715 · x³)) + 1) · 0.5``: eight elementwise passes over the FFN's
  [B, T, 2·D] activations, which ONNX Runtime does not fuse itself) becomes ``com.microsoft.FastGelu``.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graph import (
    HEADS_PERM,
    MS_DOMAIN,
    GraphIndex,
    attribute,
    fuse_sites,
    is_scalar,
    trace_head_input,
)

__all__ = ["fuse_attention", "rewrite_mish", "fuse_gelu", "fuse_tanh_gelu"]

_TANH_GELU_CUBIC: Final = 0.044715
_TANH_GELU_SCALE: Final = float(np.sqrt(2.0 / np.pi))
_MISH_CLAMP: Final = 20.0  # n / (n + 2) == 1.0 in float32 well before x = 20; e^40 is still finite


def _merged_output(index: GraphIndex, attention_out: str) -> str | None:
    """``Reshape(Transpose[0,2,1,3](attention_out))`` -> the merged [B, T, H·Dh] tensor name."""
    transpose = index.only_consumer(attention_out)
    if transpose is None or transpose.op_type != "Transpose":
        return None
    if list(attribute(transpose, "perm", [])) != HEADS_PERM:
        return None
    reshape = index.only_consumer(transpose.output[0])
    if reshape is None or reshape.op_type != "Reshape":
        return None
    return reshape.output[0]


def fuse_attention(model: onnx.ModelProto, drop_bias: bool) -> int:
    """Replace exported scaled-dot-product attention with ``com.microsoft.MultiHeadAttention``.

    Args:
        model: modified in place.
        drop_bias: drop the additive score bias (only valid where it is all zeros at run time:
            the non-streaming estimator on unpadded rows). Otherwise it becomes ``attention_bias``.

    Returns:
        The number of attention sites fused (sites that do not match are left as they are).
    """
    return fuse_sites(
        model, "Softmax", lambda index, softmax, number: _fuse_site(index, softmax, drop_bias, number)
    )


def _fuse_site(
    index: GraphIndex, softmax: onnx.NodeProto, drop_bias: bool, number: int
) -> onnx.NodeProto | None:
    if attribute(softmax, "axis", -1) not in (-1, 3):
        return None
    scores = index.producer.get(softmax.input[0])
    bias = ""
    if scores is not None and scores.op_type == "Add":
        first, second = (index.producer.get(i) for i in scores.input)
        if first is not None and first.op_type == "MatMul":
            scores, bias = first, scores.input[1]
        elif second is not None and second.op_type == "MatMul":
            scores, bias = second, scores.input[0]
        else:
            return None
    if scores is None or scores.op_type != "MatMul" or index.only_consumer(scores.output[0]) is None:
        return None
    apply = index.only_consumer(softmax.output[0])
    if apply is None or apply.op_type != "MatMul" or apply.input[0] != softmax.output[0]:
        return None
    query = trace_head_input(index, scores.input[0])
    key = trace_head_input(index, scores.input[1])
    value = trace_head_input(index, apply.input[1])
    merged = _merged_output(index, apply.output[0])
    if None in (query, key, value, merged) or value.scale != 1.0:
        return None
    if len({(x.heads, x.head_dim) for x in (query, key, value)}) != 1:
        return None
    inputs = [query.source, key.source, value.source]
    if bias and not drop_bias:
        inputs += ["", "", bias]  # bias (of the projections), key_padding_mask, attention_bias
    return helper.make_node(
        "MultiHeadAttention",
        inputs,
        [merged],
        name=f"ort_rewrites/attention_{number}",
        domain=MS_DOMAIN,
        num_heads=query.heads,
        scale=query.scale * key.scale,
    )


def rewrite_mish(model: onnx.ModelProto) -> int:
    """Replace every ``Mish`` node by ``x · n / (n + 2)``, ``n = e^min(x, 20) · (e^min(x, 20) + 2)``."""
    graph = model.graph
    if not any(node.op_type == "Mish" for node in graph.node):
        return 0
    clamp = _add_scalar(graph, "ort_rewrites/mish_clamp", _MISH_CLAMP)
    two = _add_scalar(graph, "ort_rewrites/two", 2.0)
    nodes, count = [], 0
    for node in graph.node:
        if node.op_type != "Mish":
            nodes.append(node)
            continue
        x, out, tag = node.input[0], node.output[0], f"ort_rewrites/mish_{count}/"
        nodes += [
            helper.make_node("Min", [x, clamp], [tag + "clamped"], name=tag + "min"),
            helper.make_node("Exp", [tag + "clamped"], [tag + "e"], name=tag + "exp"),
            helper.make_node("Add", [tag + "e", two], [tag + "e2"], name=tag + "add_e"),
            helper.make_node("Mul", [tag + "e", tag + "e2"], [tag + "n"], name=tag + "n"),
            helper.make_node("Add", [tag + "n", two], [tag + "d"], name=tag + "add_n"),
            helper.make_node("Div", [tag + "n", tag + "d"], [tag + "ratio"], name=tag + "ratio"),
            helper.make_node("Mul", [x, tag + "ratio"], [out], name=tag + "out"),
        ]
        count += 1
    del graph.node[:]
    graph.node.extend(nodes)
    return count


def fuse_gelu(model: onnx.ModelProto) -> int:
    """``x · (erf(x / √2) + 1) · 0.5`` (the two Muls in either order) -> ``com.microsoft.Gelu``."""
    return fuse_sites(model, "Erf", _gelu_site)


def _gelu_site(index: GraphIndex, erf: onnx.NodeProto, number: int) -> onnx.NodeProto | None:
    divide = index.producer.get(erf.input[0])
    if divide is None or divide.op_type != "Div" or not is_scalar(index, divide.input[1], np.sqrt(2.0)):
        return None
    x = divide.input[0]
    output = _gelu_tail(index, erf, x)
    if output is None:
        return None
    return helper.make_node("Gelu", [x], [output], name=f"ort_rewrites/gelu_{number}", domain=MS_DOMAIN)


def _gelu_tail(index: GraphIndex, activation: onnx.NodeProto, x: str) -> str | None:
    """The output of ``(activation + 1) · x · 0.5`` after ``activation`` (the two Muls in either
    order), the tail both GELU forms share; None where the graph differs."""
    plus_one = index.only_consumer(activation.output[0])
    if plus_one is None or plus_one.op_type != "Add":
        return None
    other = [i for i in plus_one.input if i != activation.output[0]]
    if len(other) != 1 or not is_scalar(index, other[0], 1.0):
        return None
    first = index.only_consumer(plus_one.output[0])
    second = index.only_consumer(first.output[0]) if first is not None else None
    if first is None or second is None or first.op_type != "Mul" or second.op_type != "Mul":
        return None
    others = [i for i in first.input if i != plus_one.output[0]] + [
        i for i in second.input if i != first.output[0]
    ]
    if len(others) != 2 or x not in others or not is_scalar(index, others[1 - others.index(x)], 0.5):
        return None
    return second.output[0]


def fuse_tanh_gelu(model: onnx.ModelProto) -> int:
    """``x · (tanh(√(2/π) · (x + 0.044715 · x³)) + 1) · 0.5`` (the two last Muls in either order)
    -> ``com.microsoft.FastGelu``."""
    return fuse_sites(model, "Tanh", _tanh_gelu_site)


def _scaled_by(index: GraphIndex, node: onnx.NodeProto | None, value: float) -> str | None:
    """The other input of ``node`` when it is ``Mul(t, value)`` (either order), else None."""
    if node is None or node.op_type != "Mul":
        return None
    for position in (0, 1):
        if is_scalar(index, node.input[position], value):
            return node.input[1 - position]
    return None


def _tanh_gelu_site(index: GraphIndex, tanh: onnx.NodeProto, number: int) -> onnx.NodeProto | None:
    inner = _scaled_by(index, index.producer.get(tanh.input[0]), _TANH_GELU_SCALE)  # x + c·x³
    add = index.producer.get(inner) if inner is not None else None
    if add is None or add.op_type != "Add" or index.only_consumer(inner) is None:
        return None
    left, right = add.input
    for x, cubic_term in ((left, right), (right, left)):
        cube = _scaled_by(index, index.producer.get(cubic_term), _TANH_GELU_CUBIC)
        power = index.producer.get(cube) if cube is not None else None
        if (
            power is not None
            and power.op_type == "Pow"
            and power.input[0] == x
            and is_scalar(index, power.input[1], 3.0)
        ):
            break
    else:
        return None
    output = _gelu_tail(index, tanh, x)
    if output is None:
        return None
    return helper.make_node(
        "FastGelu", [x], [output], name=f"ort_rewrites/fast_gelu_{number}", domain=MS_DOMAIN
    )


def _add_scalar(graph: onnx.GraphProto, name: str, value: float) -> str:
    """A float32 scalar initializer (the rewrites run on float32 exports only)."""
    if not any(tensor.name == name for tensor in graph.initializer):
        graph.initializer.append(numpy_helper.from_array(np.array(value, dtype=np.float32), name))
    return name
