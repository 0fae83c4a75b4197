"""Reduced-precision graphs for the ONNX Runtime backend: weight-only int4/int8 LLM, int8 flow.

Applied by ``build_engines`` to the fp32 graphs of a staging directory (``quantize_engines``), after
their export was checked against torch. What each precision changes (docs/precision.md), for every
family (CosyVoice 1, 2, 3; ``Family.quantized_graphs``):

* ``int4``: the LLM's weights 4-bit (``MatMulNBits``, symmetric, block 128, int8 compute), the flow
  estimators' MatMul weights int8 (dynamic, per-channel; v1/v2 U-Net, v3 DiT), the U-Net estimator's
  middle-block convolutions int8 (static, calibrated through the flow: ``estimator_int8``), HiFT's
  residual-block convolutions int8 (the same way: ``vocoder_int8``); the flow encoder, HiFT's
  f0 predictor and the v1 text encoder stay fp32. The v3 DiT's modulation weights (``Gemm``s, which the dynamic
  quantiser rewrites as float MatMuls and leaves fp32: 142M of its 331M parameters at full size)
  get 8-bit weight-only ``MatMulNBits`` with int8 compute (``quantize_float_matmuls_nbits``, block 32).
* ``int8``: the same with 8-bit LLM weights (block 32).

The block sizes are recorded in the manifest (``nbits_blocks``, from ``nbits_blocks`` here); engines
built before it was recorded hold block 32 everywhere and keep working (the block size is an
attribute of each ``MatMulNBits`` node, read by ONNX Runtime).

Only MatMuls whose weight is a constant are quantised here; RMSNorm/LayerNorm, softmax, attention
scores and the embedding tables stay fp32, and the convolutions too but for the calibrated ones
(``int8_conv``, run by the build once the staging directory loads as engines). Before quantising a
Qwen2 LLM (v2, v3), its RMSNorms are rewritten from ``x * Reciprocal(Sqrt(.))`` into ``x / Sqrt(.)``,
the form ONNX Runtime fuses into one ``SimplifiedLayerNormalization`` node (49 nodes fewer per decode
step at full size); the v1 TransformerLM uses LayerNorm and is left as exported.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import onnx
from onnx import helper

from ...errors import InputError
from ...family_lookup import families_where, family_named
from ...runtime import graphs
from ..onnx.files import save_onnx
from ..quiet_logs import quiet_logger

__all__ = [
    "QUANTIZED_PRECISIONS", "QUANTIZABLE_FAMILIES", "VOCODER_METHOD", "StagePlan", "precision_plan",
    "fuse_rms_norm", "quantize_weights_nbits", "quantize_matmul_int8", "quantize_float_matmuls_nbits",
    "quantize_engines", "nbits_blocks", "derive_engines"
]

_LOGGER = logging.getLogger(__name__)

QUANTIZED_PRECISIONS: Final = ("int8", "int4")
# Per family (config.family): the graphs a reduced precision changes and their role: "llm" gets
# weight-only n-bit weights, "estimator" dynamic int8 MatMuls. Every other graph stays fp32: the
# flow encoders and the v1 text encoder run once per request (compute-bound, a few % of the time),
# HiFT is Conv/Sin-bound and its waveform the most sensitive output.
# "dit": the estimator's int8 MatMuls plus 8-bit weight-only modulation weights (the v3 DiT, whose
# AdaLN linears run on the time embedding only: 2 rows, memory-bound; 567 MB of fp32 weights at full size).
# "vocoder": HiFT's residual-block convolutions int8, calibrated (builder/quantize/vocoder_int8.py).
# Which graph has which role is the family's (``Family.quantized_graphs``).
VOCODER_METHOD: Final = "int8conv"  # calibrated through the flow: vocoder_int8.quantize_vocoders
# Model families whose graph sets precision_plan() knows: those with quantised graph roles.
QUANTIZABLE_FAMILIES: Final = families_where(lambda family: bool(family.quantized_graphs))
_NBITS_BLOCK: Final = 32  # MatMulNBits block along K: the int8 LLM, the v3 DiT's 8-bit AdaLN weights
# The int4 LLM's: blocks of 128. Side by side against 32 (tools/experiments/decode/llm_step_variants.py, docs/benchmarks.md)
# the decode step is 17-31 % faster at every batch size; the quality guard passes on every family's
# golden set and at full size (docs/precision.md).
_INT4_LLM_BLOCK: Final = 128
_DIT_METHOD: Final = "int8+nbits8"  # dynamic int8 MatMuls, then the float MatMuls left 8-bit weight-only
_INT8_COMPUTE: Final = 4  # MatMulNBits accuracy_level 4: int8 activations, integer dot products

Progress = Callable[[str], None]


@dataclass(frozen=True)
class StagePlan:
    """How one graph is reduced: ``"fp32"`` (unchanged), ``"nbits4"``, ``"nbits8"``, ``"int8"`` or
    ``"int8+nbits8"`` (``"int8"``, then ``quantize_float_matmuls_nbits``: the v3 DiT) or ``"int8conv"``
    (the vocoders' calibrated int8 convolutions, ``vocoder_int8.quantize_vocoders``);
    ``fuse_rms_norm``: rewrite its Qwen2 RMSNorms first (n-bit LLMs of v2/v3 only);
    ``nbits_block``: the ``MatMulNBits`` block size along K of its n-bit weights (None: none)."""

    graph: str
    method: str
    fuse_rms_norm: bool = False
    nbits_block: int | None = None


def precision_plan(precision: str, family: str) -> tuple[StagePlan, ...]:
    """The per-graph methods of ``precision`` (``"fp32"``, ``"int8"`` or ``"int4"``) for every graph
    of ``family``'s graph set (``"v1"``, ``"v2"``, ``"v3"``), in the set's order."""
    from ...runtime.engines import graph_specs

    if family not in QUANTIZABLE_FAMILIES:
        known = ", ".join(sorted(QUANTIZABLE_FAMILIES))
        raise InputError(f"model family {family!r} is unknown; precisions are planned for {known}.")
    names = tuple(graph_specs(family))
    if precision == "fp32":
        return tuple(StagePlan(name, "fp32") for name in names)
    if precision not in QUANTIZED_PRECISIONS:
        raise InputError(f"precision {precision!r} is unknown; use fp32, {', '.join(QUANTIZED_PRECISIONS)}.")
    methods = {
        "llm": "nbits4" if precision == "int4" else "nbits8",
        "estimator": "int8",
        "dit": _DIT_METHOD,
        "vocoder": VOCODER_METHOD,
        None: "fp32",
    }
    roles = family_named(family).quantized_graphs
    qwen_llm = family_named(family).qwen_llm  # RMSNorm fusion before n-bit quantisation: Qwen2 LLMs only
    blocks = {"llm": _INT4_LLM_BLOCK if precision == "int4" else _NBITS_BLOCK, "dit": _NBITS_BLOCK}
    return tuple(
        StagePlan(
            name, methods[roles.get(name)], roles.get(name) == "llm" and qwen_llm, blocks.get(roles.get(name))
        )
        for name in names
    )


def fuse_rms_norm(model: onnx.ModelProto) -> int:
    """Rewrite ``Mul(x, Reciprocal(Sqrt(v)))`` as ``Div(x, Sqrt(v))`` in place; return how many.

    The exported RMSNorm uses ``rsqrt``; ONNX Runtime's SimplifiedLayerNormFusion only matches the
    ``Div`` form. The two differ by float rounding only.
    """
    nodes = model.graph.node
    producers = {output: node for node in nodes for output in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in nodes:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    rewrites = []
    for node in nodes:
        source = producers.get(node.input[0]) if node.op_type == "Reciprocal" else None
        users = consumers.get(node.output[0], []) if source is not None else []
        if source is None or source.op_type != "Sqrt" or len(users) != 1 or users[0].op_type != "Mul":
            continue
        mul = users[0]
        other = mul.input[1] if mul.input[0] == node.output[0] else mul.input[0]
        rewrites.append(
            (
                node,
                mul,
                helper.make_node("Div", [other, node.input[0]], list(mul.output), name=f"{mul.name}_div"),
            )
        )
    for reciprocal, mul, div in rewrites:
        index = list(nodes).index(mul)
        nodes.insert(index, div)
        nodes.remove(mul)
        nodes.remove(reciprocal)
    return len(rewrites)


def _constant_matmuls(model: onnx.ModelProto) -> list[str]:
    initializers = {init.name for init in model.graph.initializer}
    return [
        node.name for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in initializers
    ]


def quantize_weights_nbits(
    source: Path, target: Path, bits: int, block_size: int = _NBITS_BLOCK, fuse_norms: bool = True
) -> int:
    """Weight-only ``bits``-bit quantisation (4 or 8) of every constant-weight MatMul into
    ``MatMulNBits`` (symmetric blocks of ``block_size`` along K, int8 compute); with ``fuse_norms``
    (Qwen2 LLMs) the RMSNorms are fused first. Returns the number of quantised MatMuls."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(source))
    fused = fuse_rms_norm(model) if fuse_norms else 0
    quantizer = MatMulNBitsQuantizer(
        model, bits=bits, block_size=block_size, is_symmetric=True, accuracy_level=_INT8_COMPUTE
    )
    with quiet_logger("onnxruntime.quantization"):
        quantizer.process()
    # 2-D weights only: a constant 3-D operand (v1's per-head linear_pos weight) stays a float MatMul.
    count = sum(node.op_type == "MatMulNBits" for node in quantizer.model.model.graph.node)
    save_onnx(quantizer.model.model, target)
    _LOGGER.info("%s: %d MatMuls -> MatMulNBits(%d bits), %d RMSNorms fused", source.name, count, bits, fused)
    return count


def quantize_matmul_int8(source: Path, target: Path) -> int:
    """Dynamic int8 quantisation of the constant-weight MatMuls only (per-channel int8 weights,
    activations quantised at run time); everything else stays fp32. Returns the count."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    nodes = _constant_matmuls(onnx.load(str(source), load_external_data=False))
    with quiet_logger("root"):
        quantize_dynamic(
            str(source),
            str(target),
            op_types_to_quantize=["MatMul"],
            nodes_to_quantize=nodes,
            per_channel=True,
            weight_type=QuantType.QInt8,
            extra_options={"MatMulConstBOnly": True},
        )
    _LOGGER.info("%s: %d MatMuls -> dynamic int8", source.name, len(nodes))
    return len(nodes)


def quantize_float_matmuls_nbits(path: Path, bits: int = 8, block_size: int = _NBITS_BLOCK) -> int:
    """Weight-only ``bits``-bit ``MatMulNBits`` (symmetric, blocks of ``block_size`` along K, int8
    compute as the LLM's) for every MatMul of ``path`` whose weight is a constant float32 matrix, in place; returns
    the count.

    Run after ``quantize_matmul_int8``: what it leaves float are the MatMuls its quantiser wrote for
    the ``Gemm``s (time-embedding MLPs, the DiT's AdaLN modulation). Those multiply the time
    embedding only (M = 2 rows), so their cost is reading the weights.
    """
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    model = onnx.load(str(path))
    matrices = {
        init.name
        for init in model.graph.initializer
        if len(init.dims) == 2 and init.data_type == onnx.TensorProto.FLOAT
    }
    names = [node.name for node in model.graph.node if node.op_type == "MatMul" and node.input[1] in matrices]
    if not names:
        return 0
    quantizer = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=_INT8_COMPUTE,  # float compute dequantises the whole weight per call: 17x slower
        nodes_to_include=names,
    )
    with quiet_logger("onnxruntime.quantization"):
        quantizer.process()
    count = sum(node.op_type == "MatMulNBits" for node in quantizer.model.model.graph.node)
    staged = path.with_name(f".{path.stem}.nbits{bits}.onnx")
    save_onnx(quantizer.model.model, staged)
    path.with_name(path.name + ".data").unlink(missing_ok=True)
    staged.replace(path)
    staged_data = staged.with_name(staged.name + ".data")
    if staged_data.exists():
        _relocate_external_data(path, staged_data)
    _LOGGER.info("%s: %d float MatMuls -> MatMulNBits(%d bits)", path.name, count, bits)
    return count


def quantize_engines(
    directory: Path,
    precision: str,
    family: str,
    progress: Progress | None = None,
    only: Collection[str] | None = None,
) -> dict[str, str]:
    """Replace the fp32 graphs ``<directory>/<graph>.onnx`` of ``family``'s graph set by their
    ``precision`` versions in place (with ``only``: just those graphs; mixed engines run the others
    on OpenVINO).

    Returns ``{graph: method}`` for every graph (``"fp32"`` where unchanged or not in ``only``).
    The vocoders (``"int8conv"``) are not changed here: their calibration runs the checkpoint's flow,
    so ``vocoder_int8.quantize_vocoders`` does it once the directory loads as engines.
    """
    directory = Path(directory)
    methods = {}
    for plan in precision_plan(precision, family):
        skipped = only is not None and plan.graph not in only
        methods[plan.graph] = "fp32" if skipped else plan.method
        if methods[plan.graph] in ("fp32", VOCODER_METHOD):
            continue
        path = directory / f"{plan.graph}.onnx"
        staged = directory / f".{plan.graph}.{plan.method}.onnx"
        start = time.perf_counter()
        if plan.method.startswith("nbits"):
            bits = int(plan.method.removeprefix("nbits"))
            count = quantize_weights_nbits(
                path, staged, bits=bits, block_size=plan.nbits_block, fuse_norms=plan.fuse_rms_norm
            )
        else:
            count = quantize_matmul_int8(path, staged)
        path.with_name(path.name + ".data").unlink(missing_ok=True)
        staged.replace(path)
        staged_data = staged.with_name(staged.name + ".data")
        if staged_data.exists():
            _relocate_external_data(path, staged_data)
        if plan.method == _DIT_METHOD:
            count += quantize_float_matmuls_nbits(path, bits=8, block_size=plan.nbits_block)
        message = (
            f"{plan.graph}: {count} MatMul weights -> {plan.method} in {time.perf_counter() - start:.1f} s"
        )
        _LOGGER.info("%s", message)
        if progress is not None:
            progress(message)
    return methods


def nbits_blocks(precision: str, family: str, names: Collection[str]) -> dict[str, int]:
    """The manifest's ``nbits_blocks``: ``{graph: MatMulNBits block size}`` for each of ``names``
    (the ONNX Runtime graphs of the engines) that ``precision`` gives n-bit weights. The batched
    decode graph (``llm_batch``, derived from the quantised ``llm.onnx``) has the LLM's block."""
    blocks = {plan.graph: plan.nbits_block for plan in precision_plan(precision, family) if plan.nbits_block}
    if graphs.LLM.name in blocks:
        blocks[graphs.LLM_BATCH.name] = blocks[graphs.LLM.name]
    return {name: block for name, block in blocks.items() if name in names}


def _relocate_external_data(path: Path, data: Path) -> None:
    """Point the graph at ``<path>.data`` after its file was renamed."""
    model = onnx.load(str(path), load_external_data=False)
    target = path.with_name(path.name + ".data")
    data.replace(target)
    for tensor in model.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = target.name
    onnx.save(model, str(path))


def derive_engines(fp32_dir: Path, out_dir: Path, precision: str, progress: Progress | None = None) -> Path:
    """Make ``precision`` engines from an existing fp32 engines directory, without re-exporting.

    The fp32 directory is copied (hard links where possible) to a staging directory next to
    ``out_dir``, its graphs are quantised in place, the manifest gets the new precision and file
    sizes, and the result is renamed to ``out_dir`` (which must not exist).
    """
    import dataclasses
    import json

    from ...runtime.engines import MODEL_CONFIG_NAME
    from ...runtime.manifest import MANIFEST_NAME, Manifest, model_config_from_dict
    from ..derived import file_sizes, write_derived_engines
    from ..onnx.llm_batch import BATCH_FILE, batch_graph_record, write_batched_llm
    from .estimator_int8 import quantize_estimators
    from .vocoder_int8 import quantize_vocoders

    fp32_dir, out_dir = Path(fp32_dir), Path(out_dir)
    manifest = Manifest.read(fp32_dir)
    if manifest.precision != "fp32":
        raise InputError(f"{fp32_dir} holds {manifest.precision} engines; derive from fp32 engines.")
    if out_dir.exists():
        raise InputError(f"{out_dir} exists; choose a new directory for the {precision} engines.")
    raw = json.loads((fp32_dir / MODEL_CONFIG_NAME).read_text(encoding="utf-8"))
    family = model_config_from_dict(raw).family
    precision_plan(precision, family)  # an unknown precision or family fails before any copy
    # the fp32 engines' graph names: llm_batch is among them (every ONNX Runtime build writes it)
    manifest = dataclasses.replace(
        manifest, nbits_blocks=nbits_blocks(precision, family, manifest.graphs) or None
    )

    def quantize(staging: Path) -> dict:
        quantize_engines(staging, precision, family, progress)
        incremental = staging / f"{graphs.FLOW_ESTIMATOR_INCREMENTAL.name}.onnx"
        if incremental.is_file():  # the incremental streaming estimator: the estimators' int8 MatMuls
            staged = incremental.with_name(f".{incremental.stem}.int8.onnx")
            quantize_matmul_int8(incremental, staged)
            staged.replace(incremental)  # a new file: the fp32 engines' hard link stays as it was
        added = {}
        if write_batched_llm(staging) is not None:  # from the quantised llm.onnx
            batch = staging / BATCH_FILE
            added[batch.stem] = batch_graph_record(batch, staging)
        # The calibrated int8 convolutions last (estimator, then vocoders), through these engines as a
        # build calibrates through its own, so a derived directory holds the build's graphs byte for
        # byte. A provisional manifest makes the staging directory load; write_derived_engines writes
        # the final one.
        graphs_now = {**manifest.graphs, **added}
        dataclasses.replace(
            manifest, precision=precision, graphs=graphs_now, files=file_sizes(staging)
        ).write(staging)
        quantize_estimators(staging, family, progress)
        quantize_vocoders(staging, family, progress)
        (staging / MANIFEST_NAME).unlink()
        return added

    return write_derived_engines(fp32_dir, out_dir, manifest, precision, quantize)
