"""Qwen2 decoder attention -> ``com.microsoft.GroupQueryAttention`` for ONNX Runtime on CPU.

The exported Qwen2 LLM (``builder.modules.qwen2``) spells every layer's attention in about 40 small
nodes: head split/merge reshapes and transposes, rotary embedding (``rotate_half``: two Slices, a
Neg, a Concat, two Muls and an Add, for q and for k), the KV-cache Concat, the grouped-query
matmuls, the causal ``Where`` and the Softmax. A decode step is dominated by per-node overhead
once the weights are 4-bit, so each layer's attention becomes one ``GroupQueryAttention`` node
(rotary inside, ``do_rotary=1``, non-interleaved like ``rotate_half``) fed by the projections. The
graph contract does not change: the node's ``present_key/value`` outputs are the tensors the
graph already stacks into ``present_keys/values``.

The rotary tables are rebuilt in the graph from the export's ``inv_freq`` for positions
``0 … P+S-1`` (GQA reads rows ``P … P+S-1``), and ``seqlens_k`` / ``total_sequence_length`` come
from the shapes (batch 1: no padding). Matching is structural; ``ort_passes.check_equivalent``
then proves each rewritten graph equal on the export plan's feeds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .graph import MS_DOMAIN, GraphIndex, attribute, drop_dead_nodes, ensure_opset, trace_head_input

__all__ = ["fuse_qwen2_attention"]

_TAG: Final = "ort_llm_rewrites/"
_SKIP: Final = frozenset({"Reshape", "Transpose", "Unsqueeze"})


@dataclass
class _Site:
    query: str  # [1, S, H·Dh] projections (with bias)
    key: str  # [1, S, KV·Dh]
    value: str
    past_key: str  # [1, KV, P, Dh]
    past_value: str
    present_key: str  # the existing Concat outputs, [1, KV, P+S, Dh]
    present_value: str
    merged: str  # attention output [1, S, H·Dh], input of o_proj
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    inv_freq: np.ndarray  # [Dh/2]


def _skip_up(index: GraphIndex, name: str) -> str:
    node = index.producer.get(name)
    while node is not None and node.op_type in _SKIP:
        name = node.input[0]
        node = index.producer.get(name)
    return name


def _skip_down(index: GraphIndex, name: str) -> str:
    node = index.only_consumer(name)
    while node is not None and node.op_type in _SKIP:
        name = node.output[0]
        node = index.only_consumer(name)
    return name


def _rotary_input(index: GraphIndex, name: str) -> tuple[str, np.ndarray] | None:
    """``x·cos + rotate_half(x)·sin`` -> (x, inv_freq), where cos = Cos(Concat(θ, θ)), θ = pos·inv_freq."""
    add = index.producer.get(name)
    if add is None or add.op_type != "Add":
        return None
    for term in (index.producer.get(i) for i in add.input):
        if term is None or term.op_type != "Mul":
            continue
        for x, table in (term.input, reversed(term.input)):
            cos = index.producer.get(table)
            if cos is None or cos.op_type != "Cos":
                continue
            inv_freq = _inv_freq(index, cos.input[0])
            if inv_freq is not None:
                return x, inv_freq
    return None


def _inv_freq(index: GraphIndex, angles: str) -> np.ndarray | None:
    concat = index.producer.get(angles)
    if concat is None or concat.op_type != "Concat" or len(set(concat.input)) != 1:
        return None
    product = index.producer.get(concat.input[0])
    if product is None or product.op_type != "Mul":
        return None
    for name in product.input:
        value = index.constant(name)
        if value is not None and value.size > 1:
            return value.reshape(-1).astype(np.float32)
    return None


def _kv_concat(index: GraphIndex, name: str) -> onnx.NodeProto | None:
    node = index.producer.get(_skip_up(index, name))
    if node is None or node.op_type != "Concat" or len(node.input) != 2 or attribute(node, "axis") != 2:
        return None
    return node


def _match(index: GraphIndex, softmax: onnx.NodeProto) -> _Site | None:
    scores = index.producer.get(softmax.input[0])
    if scores is not None and scores.op_type == "Where":
        scores = index.producer.get(scores.input[2])  # Where(masked, -inf, scores)
    if scores is None or scores.op_type != "Mul":
        return None
    scale = [index.constant(i) for i in scores.input]
    product = [index.producer.get(i) for i in scores.input]
    if scale[1] is None or scale[1].size != 1 or product[0] is None or product[0].op_type != "MatMul":
        return None
    apply = index.only_consumer(softmax.output[0])
    if apply is None or apply.op_type != "MatMul":
        return None
    keys, values = _kv_concat(index, product[0].input[1]), _kv_concat(index, apply.input[1])
    q_rope, k_rope = _rotary_input(index, _skip_up(index, product[0].input[0])), None
    if keys is not None:
        k_rope = _rotary_input(index, keys.input[1])
    if None in (keys, values, q_rope, k_rope) or not np.array_equal(q_rope[1], k_rope[1]):
        return None
    query, key = trace_head_input(index, q_rope[0]), trace_head_input(index, k_rope[0])
    value = trace_head_input(index, values.input[1])
    if None in (query, key, value) or query.head_dim != 2 * q_rope[1].size:
        return None
    return _Site(
        query.source, key.source, value.source, keys.input[0], values.input[0], keys.output[0],
        values.output[0], _skip_down(index, apply.output[0]), query.heads, key.heads, query.head_dim,
        float(scale[1].reshape(())), q_rope[1],
    )  # fmt: skip


def _linear(index: GraphIndex, name: str) -> tuple[str, np.ndarray, np.ndarray | None] | None:
    """``Add(MatMul(x, W), b)`` or ``MatMul(x, W)`` with constant W [D, N] (and b [N]) -> (x, W, b)."""
    node, bias = index.producer.get(name), None
    if node is not None and node.op_type == "Add":
        values = [index.constant(i) for i in node.input]
        producers = [index.producer.get(i) for i in node.input]
        for value, producer in ((values[1], producers[0]), (values[0], producers[1])):
            if (
                value is not None
                and value.ndim == 1
                and producer is not None
                and producer.op_type == "MatMul"
            ):
                node, bias = producer, value
                break
        else:
            return None
    if node is None or node.op_type != "MatMul":
        return None
    weight = index.constant(node.input[1])
    if weight is None or weight.ndim != 2:
        return None
    return node.input[0], weight, bias


def _packed_projection(
    index: GraphIndex, site: _Site, number: int
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str] | None:
    """One MatMul for q, k and v (GroupQueryAttention's packed-QKV input) when they share their input."""
    parts = [_linear(index, name) for name in (site.query, site.key, site.value)]
    if None in parts or len({x for x, _, _ in parts}) != 1:
        return None
    tag = f"{_TAG}qkv_{number}/"
    weight = np.concatenate([w for _, w, _ in parts], axis=1)  # [D, (H + 2 KV)·Dh]
    constants = [numpy_helper.from_array(weight.astype(np.float32), tag + "weight")]
    nodes = [
        helper.make_node("MatMul", [parts[0][0], tag + "weight"], [tag + "product"], name=tag + "matmul")
    ]
    packed = tag + "product"
    if any(b is not None for _, _, b in parts):
        bias = np.concatenate([b if b is not None else np.zeros(w.shape[1], np.float32) for _, w, b in parts])
        constants.append(numpy_helper.from_array(bias.astype(np.float32), tag + "bias"))
        nodes.append(helper.make_node("Add", [packed, tag + "bias"], [tag + "packed"], name=tag + "bias"))
        packed = tag + "packed"  # [1, S, (H + 2 KV)·Dh]
    return nodes, constants, packed


def _shared_nodes(site: _Site) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """seqlens_k [1] int32, total_sequence_length [] int32, cos/sin tables [P+S, Dh/2]."""
    t = _TAG

    def const(name: str, value) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(value), t + name)

    constants = [
        const("axis1", np.array([1], np.int64)),
        const("axis2", np.array([2], np.int64)),
        const("axis_end", np.array([3], np.int64)),
        const("zero", np.array(0, np.int64)),
        const("one", np.array(1, np.int64)),
        const("scalar", np.zeros(0, np.int64)),
        const("inv_freq", site.inv_freq.reshape(1, -1)),
    ]
    nodes = [
        helper.make_node("Shape", [site.query], [t + "q_shape"]),
        helper.make_node("Slice", [t + "q_shape", t + "axis1", t + "axis2"], [t + "new"]),  # [1]: S
        helper.make_node("Shape", [site.past_key], [t + "past_shape"]),
        helper.make_node("Slice", [t + "past_shape", t + "axis2", t + "axis_end"], [t + "past"]),  # [1]: P
        helper.make_node("Add", [t + "past", t + "new"], [t + "total"]),  # [1]: P + S
        helper.make_node("Sub", [t + "total", t + "one"], [t + "last"]),
        helper.make_node("Cast", [t + "last"], [t + "seqlens_k"], to=onnx.TensorProto.INT32),
        helper.make_node("Reshape", [t + "total", t + "scalar"], [t + "total_scalar"]),
        helper.make_node("Cast", [t + "total_scalar"], [t + "total_length"], to=onnx.TensorProto.INT32),
        helper.make_node("Range", [t + "zero", t + "total_scalar", t + "one"], [t + "positions"]),
        helper.make_node("Cast", [t + "positions"], [t + "positions_f"], to=onnx.TensorProto.FLOAT),
        helper.make_node("Unsqueeze", [t + "positions_f", t + "axis1"], [t + "column"]),  # [P+S, 1]
        helper.make_node("Mul", [t + "column", t + "inv_freq"], [t + "angles"]),  # [P+S, Dh/2]
        helper.make_node("Cos", [t + "angles"], [t + "cos"]),
        helper.make_node("Sin", [t + "angles"], [t + "sin"]),
    ]
    return nodes, constants


def fuse_qwen2_attention(model: onnx.ModelProto) -> int:
    """Replace each matched Qwen2 layer attention by ``GroupQueryAttention`` (in place); returns the count."""
    index = GraphIndex(model.graph)
    sites = [s for s in (_match(index, n) for n in model.graph.node if n.op_type == "Softmax") if s]
    if not sites:
        return 0
    by_output = {site.merged: site for site in sites}
    replaced = {name for site in sites for name in (site.present_key, site.present_value)}  # KV Concats
    shared, constants = _shared_nodes(sites[0])
    nodes, first = [], True
    for node in model.graph.node:
        if node.output and node.output[0] in replaced:
            continue  # GroupQueryAttention writes these now
        site = by_output.get(node.output[0]) if node.output else None
        if site is None:
            nodes.append(node)
            continue
        if first:
            nodes += shared
            first = False
        qkv = [site.query, site.key, site.value]
        packed = _packed_projection(index, site, len(nodes))
        if packed is not None:
            nodes += packed[0]
            constants += packed[1]
            qkv = [packed[2], "", ""]
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [
                    *qkv,
                    site.past_key,
                    site.past_value,
                    _TAG + "seqlens_k",
                    _TAG + "total_length",
                    _TAG + "cos",
                    _TAG + "sin",
                ],
                [site.merged, site.present_key, site.present_value],
                name=f"{_TAG}gqa_{len(nodes)}",
                domain=MS_DOMAIN,
                num_heads=site.heads,
                kv_num_heads=site.kv_heads,
                scale=site.scale,
                do_rotary=1,
                rotary_interleaved=0,
            )  # fmt: skip
        )
    model.graph.initializer.extend(constants)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    drop_dead_nodes(model.graph)
    ensure_opset(model, MS_DOMAIN, 1)
    return len(sites)
