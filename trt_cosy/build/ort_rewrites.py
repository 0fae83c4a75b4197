"""Graph rewrites that make the exported graphs faster on ONNX Runtime's CPU provider.

Applied to onnxruntime engines only (TensorRT gets the exported graphs through ``build.precision``):

* **Attention** — the exporter spells ``scaled_dot_product_attention`` as
  ``MatMul(q·s, kᵀ·s) [+ bias] → Softmax → MatMul(·, v)`` with head split/merge transposes around it,
  which writes the [B, H, T, T] score tensor to memory four times per block. It becomes one
  ``com.microsoft.MultiHeadAttention`` on the [B, T, H·Dh] projections. Without a bias input ORT
  runs its tiled (flash) kernel, which keeps score tiles in cache: that is the non-streaming
  estimator, whose bias is the key-padding mask and therefore all zeros for unpadded rows — and
  trt-cosy never pads (``FlowStage`` feeds an all-ones mask; the fused graph documents this in its
  ``doc_string``). The chunk-streaming estimator keeps its bias as ``attention_bias``.
* **Mish** — ORT expands ``Mish`` into ``Softplus → Tanh → Mul``, whose Softplus is scalar code.
  ``tanh(softplus(x)) = n / (n + 2)`` with ``n = eˣ(eˣ + 2)`` is exact algebra on vectorised ops
  (x is clamped at 20, where the ratio is 1 in float32).
* **GELU** — the exported erf GELU ``x · (erf(x / √2) + 1) · 0.5`` becomes ``com.microsoft.Gelu``.

Every rewrite is matched structurally and then proven numerically: ``rewrite_graph`` runs the
graph before and after on a sample feed and refuses a result that differs by more than
``EQUIVALENCE_TOLERANCE`` (relative to the output's scale).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import BuildError
from ..runtime.graphs import FLOW_ESTIMATOR, FLOW_ESTIMATOR_STREAM
from .onnx_files import save_onnx

__all__ = [
    "EQUIVALENCE_TOLERANCE",
    "RewriteCounts",
    "fuse_attention",
    "fuse_gelu",
    "rewrite_mish",
    "convs_as_matmuls",
    "rewrite_model",
    "check_equivalent",
    "ATTENTION_GRAPHS",
    "rewrite_engine_graphs",
]

_LOGGER = logging.getLogger(__name__)

MS_DOMAIN: Final = "com.microsoft"
EQUIVALENCE_TOLERANCE: Final = 1e-4  # max |after - before| / max |before|; float32 reassociation is ~1e-6
_MISH_CLAMP: Final = 20.0  # n / (n + 2) == 1.0 in float32 well before x = 20; e^40 is still finite
_LAYOUT_OPS: Final = frozenset({"Reshape", "Transpose"})
_HEADS_PERM: Final = [0, 2, 1, 3]  # [B, T, H, Dh] <-> [B, H, T, Dh]
# The graphs rewritten, and whether their attention bias is dropped (key padding only, see above).
ATTENTION_GRAPHS: Final = {FLOW_ESTIMATOR.name: True, FLOW_ESTIMATOR_STREAM.name: False}

Feed = Mapping[str, np.ndarray]


@dataclass
class RewriteCounts:
    """How many sites each rewrite replaced in one graph."""

    attention: int = 0
    mish: int = 0
    gelu: int = 0

    def total(self) -> int:
        return self.attention + self.mish + self.gelu


class _Graph:
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


def _attribute(node: onnx.NodeProto, name: str, default=None):
    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return default


@dataclass
class _HeadInput:
    """One attention operand traced back to its [B, T, H·Dh] projection."""

    source: str  # tensor name of the projection output
    heads: int
    head_dim: int
    scale: float  # product of scalar Muls met on the way


def _trace_head_input(index: _Graph, name: str) -> _HeadInput | None:
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
        if node.op_type == "Transpose" and list(_attribute(node, "perm", [])) == _HEADS_PERM:
            reshape = index.producer.get(node.input[0])
            if reshape is not None and reshape.op_type == "Reshape":
                split = reshape
        current = node.input[0]
    if split is None or current != split.input[0]:
        return None  # the walk must end exactly at the head split's input
    shape = index.constant(split.input[1])
    if shape is None or shape.size != 4 or shape[2] <= 0 or shape[3] <= 0:
        return None
    return _HeadInput(split.input[0], int(shape[2]), int(shape[3]), scale)


def _merged_output(index: _Graph, attention_out: str) -> str | None:
    """``Reshape(Transpose[0,2,1,3](attention_out))`` -> the merged [B, T, H·Dh] tensor name."""
    transpose = index.only_consumer(attention_out)
    if transpose is None or transpose.op_type != "Transpose":
        return None
    if list(_attribute(transpose, "perm", [])) != _HEADS_PERM:
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
    index = _Graph(model.graph)
    replacements: dict[str, onnx.NodeProto] = {}  # merged output name -> fused node
    for softmax in [n for n in model.graph.node if n.op_type == "Softmax"]:
        fused = _fuse_site(index, softmax, drop_bias, len(replacements))
        if fused is not None:
            replacements[fused.output[0]] = fused
    if not replacements:
        return 0
    nodes = [replacements.get(node.output[0], node) if node.output else node for node in model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _drop_dead_nodes(model.graph)
    _ensure_opset(model, MS_DOMAIN, 1)
    return len(replacements)


def _fuse_site(index: _Graph, softmax: onnx.NodeProto, drop_bias: bool, number: int) -> onnx.NodeProto | None:
    if _attribute(softmax, "axis", -1) not in (-1, 3):
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
    query = _trace_head_input(index, scores.input[0])
    key = _trace_head_input(index, scores.input[1])
    value = _trace_head_input(index, apply.input[1])
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
    index = _Graph(model.graph)
    replacements: dict[str, onnx.NodeProto] = {}
    for erf in [n for n in model.graph.node if n.op_type == "Erf"]:
        fused = _gelu_site(index, erf, len(replacements))
        if fused is not None:
            replacements[fused.output[0]] = fused
    if not replacements:
        return 0
    nodes = [replacements.get(node.output[0], node) if node.output else node for node in model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    _drop_dead_nodes(model.graph)
    _ensure_opset(model, MS_DOMAIN, 1)
    return len(replacements)


def _gelu_site(index: _Graph, erf: onnx.NodeProto, number: int) -> onnx.NodeProto | None:
    divide = index.producer.get(erf.input[0])
    if divide is None or divide.op_type != "Div" or not _is_scalar(index, divide.input[1], np.sqrt(2.0)):
        return None
    x = divide.input[0]
    plus_one = index.only_consumer(erf.output[0])
    if plus_one is None or plus_one.op_type != "Add":
        return None
    other = [i for i in plus_one.input if i != erf.output[0]]
    if len(other) != 1 or not _is_scalar(index, other[0], 1.0):
        return None
    first = index.only_consumer(plus_one.output[0])
    second = index.only_consumer(first.output[0]) if first is not None else None
    if first is None or second is None or first.op_type != "Mul" or second.op_type != "Mul":
        return None
    others = [i for i in first.input if i != plus_one.output[0]] + [
        i for i in second.input if i != first.output[0]
    ]
    if len(others) != 2 or x not in others:
        return None
    half = others[1 - others.index(x)]
    if not _is_scalar(index, half, 0.5):
        return None
    return helper.make_node(
        "Gelu", [x], [second.output[0]], name=f"ort_rewrites/gelu_{number}", domain=MS_DOMAIN
    )


def convs_as_matmuls(model: onnx.ModelProto) -> int:
    """1-D ``Conv`` with a constant weight (group 1, stride 1) -> a channels-last ``MatMul``.

    ``conv(x)[o, t] = Σ_j Σ_c W[o, c, j] · x_padded[c, t + j·d]``: the k dilated taps of the padded
    input are concatenated on the channel axis ([B, T', k·Ci]) and multiplied by W laid out as
    [k·Ci, Co] (row ``j·Ci + c``). The int8 quantiser (``build.quantize``) turns a MatMul with a
    constant weight into an int8 GEMM, which it cannot do for a Conv.
    """
    graph = model.graph
    index = _Graph(graph)
    nodes, count = [], 0
    for node in graph.node:
        weight = index.constant(node.input[1]) if node.op_type == "Conv" and len(node.input) > 1 else None
        if weight is None or weight.ndim != 3 or not _plain_conv(node):
            nodes.append(node)
            continue
        nodes += _conv_matmul_nodes(graph, node, weight, f"ort_rewrites/conv_{count}/")
        count += 1
    if count:
        del graph.node[:]
        graph.node.extend(nodes)
        _drop_dead_nodes(graph)
    return count


def _plain_conv(node: onnx.NodeProto) -> bool:
    auto_pad = _attribute(node, "auto_pad", b"NOTSET")
    return (
        _attribute(node, "group", 1) == 1
        and list(_attribute(node, "strides", [1])) == [1]
        and auto_pad in (b"NOTSET", "NOTSET")
    )


def _conv_matmul_nodes(
    graph: onnx.GraphProto, conv: onnx.NodeProto, weight: np.ndarray, tag: str
) -> list[onnx.NodeProto]:
    outputs, inputs, kernel = weight.shape  # W: [Co, Ci, k]
    dilation = int(_attribute(conv, "dilations", [1])[0])
    left, right = (int(p) for p in _attribute(conv, "pads", [0, 0]))
    span = (kernel - 1) * dilation

    def constant(name: str, value: np.ndarray) -> str:
        graph.initializer.append(numpy_helper.from_array(value, tag + name))
        return tag + name

    nodes = [
        helper.make_node("Transpose", [conv.input[0]], [tag + "x"], perm=[0, 2, 1], name=tag + "to_last")
    ]
    current = tag + "x"  # [B, T, Ci]
    if left or right:
        pads = constant("pads", np.array([0, left, 0, 0, right, 0], np.int64))
        nodes.append(helper.make_node("Pad", [current, pads], [tag + "padded"], name=tag + "pad"))
        current = tag + "padded"  # [B, T + left + right, Ci]
    if kernel > 1:
        axis = constant("axis", np.array([1], np.int64))
        taps = []
        for j in range(kernel):
            stop = j * dilation - span  # negative (from the end) except for the last tap
            start = constant(f"start{j}", np.array([j * dilation], np.int64))
            end = constant(f"end{j}", np.array([stop if stop else np.iinfo(np.int64).max], np.int64))
            nodes.append(
                helper.make_node(
                    "Slice", [current, start, end, axis], [tag + f"tap{j}"], name=tag + f"tap{j}"
                )
            )
            taps.append(tag + f"tap{j}")  # [B, T', Ci]
        nodes.append(helper.make_node("Concat", taps, [tag + "taps"], axis=2, name=tag + "taps"))
        current = tag + "taps"  # [B, T', k·Ci]
    matrix = np.ascontiguousarray(weight.transpose(2, 1, 0).reshape(kernel * inputs, outputs))  # [k·Ci, Co]
    product = tag + "product"
    nodes.append(
        helper.make_node("MatMul", [current, constant("weight", matrix)], [product], name=tag + "matmul")
    )
    if len(conv.input) > 2 and conv.input[2]:
        nodes.append(helper.make_node("Add", [product, conv.input[2]], [tag + "biased"], name=tag + "bias"))
        product = tag + "biased"  # [B, T', Co]
    nodes.append(
        helper.make_node("Transpose", [product], [conv.output[0]], perm=[0, 2, 1], name=tag + "to_first")
    )
    return nodes


def _is_scalar(index: _Graph, name: str, value: float) -> bool:
    array = index.constant(name)
    return (
        array is not None and array.size == 1 and abs(float(array.reshape(())) - value) <= 1e-6 * abs(value)
    )


def _add_scalar(graph: onnx.GraphProto, name: str, value: float) -> str:
    """A float32 scalar initializer (the rewrites run on float32 exports only)."""
    if not any(tensor.name == name for tensor in graph.initializer):
        graph.initializer.append(numpy_helper.from_array(np.array(value, dtype=np.float32), name))
    return name


def _drop_dead_nodes(graph: onnx.GraphProto) -> None:
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


def _ensure_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    if not any(opset.domain == domain for opset in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, version))


def rewrite_model(
    model: onnx.ModelProto, *, attention: bool, drop_attention_bias: bool = False
) -> RewriteCounts:
    """Apply the rewrites to a float32 graph in place and return what was replaced.

    ``attention``: fuse attention sites (estimators); ``drop_attention_bias`` as in ``fuse_attention``.
    """
    counts = RewriteCounts()
    if attention:
        counts.attention = fuse_attention(model, drop_bias=drop_attention_bias)
        if drop_attention_bias and counts.attention:
            model.doc_string = (
                model.doc_string + "\n" if model.doc_string else ""
            ) + "trt-cosy: attention ignores key padding here; every row must be unpadded (all-ones mask)."
    counts.mish = rewrite_mish(model)
    counts.gelu = fuse_gelu(model)
    return counts


def check_equivalent(
    before: onnx.ModelProto, after: onnx.ModelProto, feeds: Iterable[dict[str, np.ndarray]], what: str
) -> float:
    """Run both graphs on ONNX Runtime (CPU) and return the worst relative difference over ``feeds``.

    Raises:
        BuildError: the difference exceeds ``EQUIVALENCE_TOLERANCE`` (a rewrite changed the maths).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    sessions = [
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for model in (before, after)
    ]
    worst = 0.0
    for feed in feeds:
        reference, candidate = (session.run(None, feed) for session in sessions)
        for want, got in zip(reference, candidate, strict=True):
            scale = max(float(np.abs(want).max()), 1e-12)
            worst = max(worst, float(np.abs(got - want).max()) / scale)
    if not worst <= EQUIVALENCE_TOLERANCE:
        raise BuildError(
            f"{what}: the ONNX Runtime rewrites changed the outputs (max relative difference {worst:.2e} > "
            f"{EQUIVALENCE_TOLERANCE:g}). This is a trt-cosy bug: please report it with the model name."
        )
    return worst


def rewrite_engine_graphs(
    directory: Path, feeds_for: Callable[[str], Iterable[Feed]], progress: Callable[[str], None] | None = None
) -> dict[str, RewriteCounts]:
    """Rewrite the ``ATTENTION_GRAPHS`` present in an engines directory in place (float32 graphs).

    Args:
        directory: a staging engines directory holding ``<graph>.onnx`` as exported.
        feeds_for: sample feeds per graph name for the equivalence proof (the export plan's feeds);
            where the bias is dropped, only feeds with an all-ones ``mask`` are used.
        progress: optional callback for one line per graph.

    Returns:
        ``{graph: counts}`` for every graph rewritten.
    """
    done = {}
    for name, drop_bias in ATTENTION_GRAPHS.items():
        path = Path(directory) / f"{name}.onnx"
        if not path.is_file():
            continue
        start = time.perf_counter()
        model = onnx.load(str(path))
        before = copy.deepcopy(model)
        counts = rewrite_model(model, attention=True, drop_attention_bias=drop_bias)
        if not counts.total():
            continue
        feeds = [
            f for f in feeds_for(name) if not drop_bias or "mask" not in f or bool(np.all(f["mask"] == 1))
        ]
        worst = check_equivalent(before, model, feeds, name)
        save_onnx(model, path)
        done[name] = counts
        message = (
            f"{name}: {counts.attention} attention, {counts.mish} Mish, {counts.gelu} GELU rewritten for ONNX "
            f"Runtime (max relative change {worst:.1e}, {time.perf_counter() - start:.1f} s)"
        )
        _LOGGER.info("%s", message)
        if progress is not None:
            progress(message)
    return done
