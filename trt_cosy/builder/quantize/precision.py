"""fp32 ONNX -> strongly typed fp16 ONNX with fp32 islands, for TensorRT's strongly typed networks.

TensorRT 11 has no weak typing (``BuilderFlag.FP16`` is gone): every tensor's type comes from the
graph. This pass decides a precision per node and writes it into the graph with Cast nodes at the
borders, so the builder needs no precision flags at all.

Rules, in order (``PrecisionPolicy``):

1. **Islands** stay fp32: op types where fp16 overflows or loses the answer (softmax, layer norm,
   reductions, exp/log, sin/cos, pow, cumulative sums, ranges), and whole torch modules named by the
   exporter's metadata (``pkg.torch.onnx.class_hierarchy``/``name_scopes``): RMSNorm and LayerNorm,
   rotary embeddings, the HiFT f0 predictor, NSF source and (i)STFT, and the LLM's logits head;
   the own nodes of named classes (the DiT's residual stream); and, given calibration feeds, every
   node whose fp32 output exceeds ``PrecisionPolicy.data_max`` (``tensor_ranges``). The tables per
   family and graph are in ``builder.quantize.policies``.
2. **Index math** stays fp32: int -> float casts, float tensors made from shapes, and the float32
   graph inputs (the flow time step ``t``, speaker vectors, flags, the cached HiFT source) seed it.
3. **Growth**: an elementwise or data-movement node whose non-constant float inputs are all fp32
   stays fp32 (so an island's epilogue is not rounded in between). MatMul/Gemm/Conv never grow:
   they are fp16 unless an island names them.
4. Everything else is fp16. Nodes without float outputs (Shape, comparisons, casts to int) take
   the highest precision among their inputs, so a comparison never rounds a fp32 value.

float64 is refused (``TrtCosyError``): TensorRT has none, so a graph must do without it.

Graph inputs and outputs stay fp32 unless named in ``PrecisionPolicy.fp16_io``: the runners and the
numpy stages see the same dtypes on every backend. Initializers are converted where every user is
fp16; shared by both kinds, a fp16 copy is added. Finite values beyond fp16's range are clamped to
+-65504 (a -1e9 mask bias must not become -inf); inf and nan are kept.

We write the pass ourselves: ``onnxruntime.transformers.float16`` casts every blocked node's inputs
and outputs separately (an island of several nodes is rounded to fp16 between each of them) and
needs value_info for every tensor; NVIDIA's ModelOpt AutoCast pulls in onnxruntime-gpu and cupy.
"""

from __future__ import annotations

import ast
import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import numpy as np
import onnx
import onnx.inliner
from onnx import TensorProto, helper, numpy_helper

from ...errors import TrtCosyError
from ..onnx.files import save_onnx
from .policies import FP32_OP_TYPES, GRAPH_POLICIES, PrecisionPolicy
from .precision_ort import compare_fp16, tensor_ranges

__all__ = [
    "FP32",
    "FP16",
    "FP32_OP_TYPES",
    "PrecisionPolicy",
    "GRAPH_POLICIES",
    "Fp16Report",
    "tensor_ranges",
    "convert_model_fp16",
    "to_fp16_graph",
    "compare_fp16",
]

_LOGGER = logging.getLogger(__name__)

FP32: Final = TensorProto.FLOAT
FP16: Final = TensorProto.FLOAT16
_FP16_MAX: Final = float(np.finfo(np.float16).max)  # 65504

# Heavy ops never become fp32 by growth: they are the point of fp16 (tensor cores).
_HEAVY_OPS: Final = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "MatMulInteger"})
# Inputs that ONNX requires to be float32 whatever the data type (Resize roi/scales).
_ALWAYS_FP32_INPUTS: Final = {"Resize": frozenset({1, 2})}
_METADATA_KEYS: Final = ("pkg.torch.onnx.class_hierarchy", "pkg.torch.onnx.name_scopes")


@dataclass
class Fp16Report:
    """What the pass did: node counts per precision, why nodes stayed fp32, inserted casts."""

    nodes: int = 0
    fp16_nodes: int = 0
    fp32_nodes: int = 0
    casts: int = 0
    fp16_initializers: int = 0
    fp32_initializers: int = 0
    reasons: Counter = field(default_factory=Counter)
    has_metadata: bool = True

    def summary(self) -> str:
        why = ", ".join(f"{k} {v}" for k, v in self.reasons.most_common())
        return (
            f"{self.fp16_nodes} fp16 / {self.fp32_nodes} fp32 nodes ({why}); {self.casts} casts; "
            f"initializers {self.fp16_initializers} fp16 / {self.fp32_initializers} fp32"
        )


def to_fp16_graph(
    onnx_path: Path,
    out_path: Path,
    policy: PrecisionPolicy | None = None,
    *,
    graph: str | None = None,
    calibration: Iterable[Mapping[str, np.ndarray]] = (),
) -> Fp16Report:
    """Convert the fp32 graph at ``onnx_path`` to a strongly typed fp16 graph at ``out_path``.

    ``policy`` defaults to ``GRAPH_POLICIES[graph]`` (graph defaults to the file stem). With
    ``policy.data_max``, the fp32 graph first runs on the ``calibration`` feeds (ONNX Runtime) and
    every node with an output beyond that magnitude stays fp32. Weights over 1 GiB are written to
    ``<out_path>.data``. The result passes ``onnx.checker`` (full type check).
    """
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    graph = graph or onnx_path.stem
    policy = policy or GRAPH_POLICIES.get(graph, PrecisionPolicy())
    model = onnx.load(str(onnx_path), load_external_data=False)
    feeds = list(calibration) if policy.data_max is not None else []
    model, report = convert_model_fp16(model, policy, base_dir=onnx_path.parent, calibration=feeds)
    save_onnx(model, out_path, full_check=True)
    _LOGGER.info("%s: fp16 graph %s: %s", graph, out_path, report.summary())
    return report


def convert_model_fp16(
    model: onnx.ModelProto,
    policy: PrecisionPolicy | None = None,
    *,
    base_dir: Path | None = None,
    calibration: Iterable[Mapping[str, np.ndarray]] = (),
) -> tuple[onnx.ModelProto, Fp16Report]:
    """The pass on an in-memory model (modified in place and returned). External weights are read
    from ``base_dir``; shapes and types are inferred on a copy without weights (graphs > 2 GiB).
    ``calibration`` feeds (used with ``policy.data_max``) run the fp32 model on ONNX Runtime first."""
    policy = policy or PrecisionPolicy()
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    _reject_subgraphs(model.graph)
    _constants_to_initializers(model.graph)
    types = _infer_types(model)
    _reject_float64(model.graph, types)
    hot: set[str] = set()
    feeds = list(calibration)
    if policy.data_max is not None and feeds:
        ranges = tensor_ranges(model, types, feeds, base_dir)
        hot = {name for name, peak in ranges.items() if not peak <= policy.data_max}
    assigner = _Assigner(model.graph, types, policy, hot)
    precisions = assigner.assign()
    rewriter = _Rewriter(model.graph, types, policy, base_dir)
    rewriter.rewrite(precisions)
    report = assigner.report
    report.casts, report.fp16_initializers, report.fp32_initializers = rewriter.counts()
    return model, report


def _reject_float64(graph: onnx.GraphProto, types: Mapping[str, int]) -> None:
    double = [out for node in graph.node for out in node.output if types.get(out) == TensorProto.DOUBLE]
    double += [t.name for t in graph.initializer if t.data_type == TensorProto.DOUBLE]
    double += [v.name for v in (*graph.input, *graph.output) if types.get(v.name) == TensorProto.DOUBLE]
    if double:
        raise TrtCosyError(
            f"the graph computes in float64 ({len(double)} tensors, e.g. {double[:3]}); TensorRT has no "
            "float64. Re-export the stage in float32 (see trt_cosy/models/v1/export/hift.py for an example)."
        )


def _reject_subgraphs(graph: onnx.GraphProto) -> None:
    for node in graph.node:
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
            raise TrtCosyError(
                f"node '{node.name}' ({node.op_type}) has a subgraph; the fp16 pass handles "
                "straight-line graphs only. Export the stage without control flow."
            )


def _constants_to_initializers(graph: onnx.GraphProto) -> None:
    """Float ``Constant`` nodes become initializers, so one rule decides every constant's dtype."""
    kept = []
    for node in graph.node:
        value = _float_constant(node)
        if value is None:
            kept.append(node)
        else:
            graph.initializer.append(numpy_helper.from_array(value, node.output[0]))
    del graph.node[:]
    graph.node.extend(kept)


def _float_constant(node: onnx.NodeProto) -> np.ndarray | None:
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    for attr in node.attribute:
        if attr.name == "value" and attr.t.data_type == FP32:
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.array(attr.floats, dtype=np.float32)
    return None


def _infer_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor, from ONNX shape inference on a weightless copy."""
    light = onnx.ModelProto()
    light.CopyFrom(model)
    # Weights become typed graph inputs (inference needs their dtype and dims, never their values),
    # so a graph with external or > 2 GiB weights is inferred without reading them.
    weights = [t for t in light.graph.initializer if t.data_type in (FP32, FP16)]
    for tensor in weights:
        light.graph.input.append(
            helper.make_tensor_value_info(tensor.name, tensor.data_type, list(tensor.dims))
        )
    keep = [t for t in light.graph.initializer if t.data_type not in (FP32, FP16)]
    del light.graph.initializer[:]
    light.graph.initializer.extend(keep)
    inferred = onnx.shape_inference.infer_shapes(light, strict_mode=True, data_prop=False)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*inferred.graph.input, *inferred.graph.output, *inferred.graph.value_info)
    }
    types.update({t.name: t.data_type for t in model.graph.initializer})
    unknown = [out for node in model.graph.node for out in node.output if out and not types.get(out)]
    if unknown:
        raise TrtCosyError(
            f"ONNX type inference left {len(unknown)} tensors untyped ({unknown[:5]}); the fp16 "
            "pass needs every type. Re-export the graph with the dynamo exporter."
        )
    return types


class _Assigner:
    """Decides each node's precision (FP16, FP32, or None for nodes that touch no float tensor)."""

    def __init__(
        self,
        graph: onnx.GraphProto,
        types: Mapping[str, int],
        policy: PrecisionPolicy,
        hot: set[str] | frozenset[str] = frozenset(),
    ):
        self.graph, self.types, self.policy, self.hot = graph, types, policy, hot
        self.initializers = {t.name for t in graph.initializer}
        self.physical: dict[str, int] = {}  # float tensor -> the dtype it has after the pass
        self.prefers32: set[str] = set()  # float tensors that count as fp32 for the growth rule
        self.report = Fp16Report(nodes=len(graph.node))
        for value in graph.input:
            if types.get(value.name) != FP32:
                continue
            self.physical[value.name] = FP16 if value.name in policy.fp16_io else FP32
            if value.name not in policy.fp16_io:  # fp32 inputs stay fp32 up to their first fp16 consumer
                self.prefers32.add(value.name)
        self.report.has_metadata = any(p.key in _METADATA_KEYS for n in graph.node for p in n.metadata_props)
        if not self.report.has_metadata and (policy.modules or policy.scopes):
            _LOGGER.warning("graph has no torch module metadata: fp32 islands come from op types only")

    def assign(self) -> list[int | None]:
        result = []
        for node in self.graph.node:
            precision, reason = self._decide(node)
            result.append(precision)
            if precision is None:
                continue
            for out in node.output:
                if out and self.types.get(out) == FP32:
                    self.physical[out] = precision
                    if precision == FP32:
                        self.prefers32.add(out)
            if precision == FP32:
                self.report.fp32_nodes += 1
                self.report.reasons[reason] += 1
            else:
                self.report.fp16_nodes += 1
        return result

    def _decide(self, node: onnx.NodeProto) -> tuple[int | None, str]:
        floats_in = [n for n in node.input if n and self.types.get(n) == FP32]
        floats_out = [n for n in node.output if n and self.types.get(n) == FP32]
        if not floats_in and not floats_out:
            return None, ""
        island = self._island(node)
        if island:
            return FP32, island
        if not floats_out:  # Shape, comparisons, casts to int: never round an fp32 input
            dynamic = [n for n in floats_in if n not in self.initializers]
            keep = not dynamic or any(self.physical.get(n) == FP32 for n in dynamic)
            return (FP32 if keep else FP16), "consumer of fp32"
        if not floats_in:
            return FP32, "index math"  # int -> float casts, ConstantOfShape: positions, lengths, masks
        if node.op_type in _HEAVY_OPS:
            return FP16, ""
        dynamic = [n for n in floats_in if n not in self.initializers]
        if all(n in self.prefers32 for n in dynamic):
            return FP32, "growth"
        return FP16, ""

    def _island(self, node: onnx.NodeProto) -> str:
        if node.op_type in self.policy.op_types:
            return f"op {node.op_type}"
        if any(out in self.hot for out in node.output):
            return "range"
        if not (self.policy.modules or self.policy.scopes or self.policy.own_nodes):
            return ""
        meta = {p.key: p.value for p in node.metadata_props}
        classes = [name.rsplit(".", 1)[-1] for name in _literal_list(meta.get(_METADATA_KEYS[0]))]
        for short in classes[:-1]:  # the last entry is the aten op itself
            if short in self.policy.modules:
                return f"module {short}"
        if len(classes) >= 2 and classes[-2] in self.policy.own_nodes:
            return f"own {classes[-2]}"
        for scope in _literal_list(meta.get(_METADATA_KEYS[1])):
            for prefix in self.policy.scopes:
                if scope == prefix or scope.startswith(prefix + "."):
                    return f"scope {prefix}"
        return ""


def _literal_list(text: str | None) -> list[str]:
    if not text:
        return []
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return []
    return [str(v) for v in value] if isinstance(value, list) else []


class _Rewriter:
    """Applies the precisions: retypes attributes, inserts Casts, converts initializers."""

    def __init__(
        self, graph: onnx.GraphProto, types: Mapping[str, int], policy: PrecisionPolicy, base_dir: Path | None
    ):
        self.graph, self.types, self.policy, self.base_dir = graph, types, policy, base_dir
        self.initializers = {t.name: t for t in graph.initializer}
        self.physical: dict[str, int] = {}
        for value in graph.input:
            if types.get(value.name) == FP32:
                self.physical[value.name] = FP16 if value.name in policy.fp16_io else FP32
        self.casts: dict[tuple[str, int], str] = {}
        self.initializer_copies: dict[tuple[str, int], str] = {}
        self.new_nodes: list[onnx.NodeProto] = []

    def counts(self) -> tuple[int, int, int]:
        fp16 = sum(1 for t in self.graph.initializer if t.data_type == FP16)
        fp32 = sum(1 for t in self.graph.initializer if t.data_type == FP32)
        return len(self.casts), fp16, fp32

    def rewrite(self, precisions: list[int | None]) -> None:
        outputs = {v.name: v for v in self.graph.output}
        wanted = self._initializer_wants(precisions)
        for name, dtypes in wanted.items():
            self._convert_initializer(name, dtypes)
        for node, precision in zip(list(self.graph.node), precisions, strict=True):
            if precision is not None:
                self._retype_inputs(node, precision)
                _retype_attributes(node, precision)
            self.new_nodes.append(node)
            for index, out in enumerate(node.output):
                if out and self.types.get(out) == FP32 and precision is not None:
                    self.physical[out] = precision
                    if out in outputs:
                        self._fix_output(node, index, precision)
        del self.graph.node[:]
        self.graph.node.extend(self.new_nodes)
        for value in self.graph.input:
            if value.name in self.policy.fp16_io and self.types.get(value.name) == FP32:
                value.type.tensor_type.elem_type = FP16
        dtypes = {**self.physical, **{t.name: t.data_type for t in self.graph.initializer}}
        for value in self.graph.value_info:
            if value.name in dtypes:
                value.type.tensor_type.elem_type = dtypes[value.name]

    def _wanted_dtype(self, node: onnx.NodeProto, index: int, precision: int) -> int:
        return FP32 if index in _ALWAYS_FP32_INPUTS.get(node.op_type, ()) else precision

    def _initializer_wants(self, precisions: list[int | None]) -> dict[str, set[int]]:
        wanted: dict[str, set[int]] = {}
        for node, precision in zip(self.graph.node, precisions, strict=True):
            for index, name in enumerate(node.input):
                tensor = self.initializers.get(name)
                if precision is not None and tensor is not None and tensor.data_type == FP32:
                    wanted.setdefault(name, set()).add(self._wanted_dtype(node, index, precision))
        return wanted

    def _convert_initializer(self, name: str, dtypes: Iterable[int]) -> None:
        tensor = self.initializers[name]
        array = numpy_helper.to_array(tensor, base_dir=str(self.base_dir or ""))
        if FP16 not in dtypes:
            tensor.CopyFrom(numpy_helper.from_array(array, name))  # materialise external data
            return
        half = numpy_helper.from_array(_to_float16(array), name if FP32 not in dtypes else f"{name}__fp16")
        if FP32 in dtypes:
            tensor.CopyFrom(numpy_helper.from_array(array, name))
            self.graph.initializer.append(half)
            self.initializer_copies[(name, FP16)] = half.name
        else:
            tensor.CopyFrom(half)

    def _retype_inputs(self, node: onnx.NodeProto, precision: int) -> None:
        for index, name in enumerate(node.input):
            if not name or self.types.get(name) != FP32:
                continue
            want = self._wanted_dtype(node, index, precision)
            if name in self.initializers:
                node.input[index] = self.initializer_copies.get((name, want), name)
            elif self.physical.get(name, FP32) != want:
                node.input[index] = self._cast(name, want)

    def _cast(self, name: str, dtype: int) -> str:
        key = (name, dtype)
        if key not in self.casts:
            suffix = "fp16" if dtype == FP16 else "fp32"
            out = f"{name}__to_{suffix}"
            self.new_nodes.append(helper.make_node("Cast", [name], [out], name=f"{out}_cast", to=dtype))
            self.casts[key] = out
        return self.casts[key]

    def _fix_output(self, node: onnx.NodeProto, index: int, precision: int) -> None:
        """Graph outputs keep their declared dtype: cast the node's result into them."""
        name = node.output[index]
        declared = FP16 if name in self.policy.fp16_io else FP32
        if declared == precision:
            return
        inner = f"{name}__{'fp16' if precision == FP16 else 'fp32'}"
        node.output[index] = inner
        self.new_nodes.append(helper.make_node("Cast", [inner], [name], name=f"{name}_out_cast", to=declared))
        self.casts[(inner, declared)] = name
        self.physical[name] = declared
        for value in self.graph.output:
            if value.name == name:
                value.type.tensor_type.elem_type = declared


def _retype_attributes(node: onnx.NodeProto, precision: int) -> None:
    """In fp16 nodes, attributes that name or hold float32 (Cast ``to``, ConstantOfShape ``value``) follow."""
    if precision != FP16:
        return
    for attr in node.attribute:
        if attr.name in ("to", "dtype") and attr.type == onnx.AttributeProto.INT and attr.i == FP32:
            attr.i = FP16
        elif node.op_type == "ConstantOfShape" and attr.name == "value" and attr.t.data_type == FP32:
            attr.t.CopyFrom(numpy_helper.from_array(_to_float16(numpy_helper.to_array(attr.t)), attr.t.name))


def _to_float16(array: np.ndarray) -> np.ndarray:
    """float32 -> float16, finite values clamped to +-65504 (inf and nan kept)."""
    array = np.asarray(array, dtype=np.float32)
    finite = np.isfinite(array)
    clipped = np.where(finite, np.clip(array, -_FP16_MAX, _FP16_MAX), array)
    return clipped.astype(np.float16)
