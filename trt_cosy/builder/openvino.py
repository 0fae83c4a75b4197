"""OpenVINO engines: the plain ONNX exports converted to OpenVINO IR, LLM weights 8/4-bit.

``build_engines(..., backend="openvino")`` runs ``convert_engine_graphs`` on the float32 graphs of
the staging directory after their export passed the torch parity check. ONNX Runtime's contrib
rewrites (``builder.onnx.passes``) are never applied: OpenVINO reads standard ONNX and fuses on its own.
Each ``<graph>.onnx`` (and its ``.onnx.data``) is replaced by ``<graph>.xml`` + ``<graph>.bin``
(float32 weights), so the runtime compiles the IR without reconverting.

``int8`` / ``int4`` engines store the LLM's 2-D MatMul weights compressed in the form OpenVINO's CPU
plugin runs as weight-decompressing FullyConnected kernels (``Constant(i8|i4) -> Convert ->
Multiply(scale) [-> Reshape] -> MatMul``, symmetric): int8 per output channel; int4 in groups of
``INT4_GROUP`` along the reduction axis, with the LLM's output projection (``llm_decoder``, the
last MatMul) kept int8 as the most sensitive layer. What each engines precision computes in is
decided at load time (``runtime.backends.openvino.runner.graph_precisions``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from ..errors import BuildError
from ..runtime.backends.openvino.runner import IR_SUFFIX, load_openvino
from ..runtime.manifest import GraphRecord, Manifest

__all__ = [
    "INT4_GROUP",
    "LLM_GRAPHS",
    "check_graph_compiles",
    "convert_engine_graphs",
    "compress_matmul_weights",
    "derive_openvino_engines",
]

_LOGGER = logging.getLogger(__name__)

INT4_GROUP: Final = 128  # int4 weights share one scale per 128 reduction-axis values
LLM_GRAPHS: Final = frozenset({"llm"})  # the graph whose weights int8/int4 compress (every family)
_BITS: Final = {"int8": 8, "int4": 4}
_INT_MAX: Final = {8: 127, 4: 7}

Progress = Callable[[str], None]


def convert_engine_graphs(
    directory: Path,
    graph_names: Iterable[str],
    precision: str,
    progress: Progress | None = None,
    fp16_weights: Collection[str] = frozenset(),
) -> dict[str, str]:
    """Replace each ``<directory>/<graph>.onnx`` by OpenVINO IR ``<graph>.xml``/``.bin`` (LLM weights
    compressed for ``int8``/``int4``); return ``{graph: IR file name}``.

    The graphs in ``fp16_weights`` store their float weights as float16 (``compress_to_fp16``): for
    graphs that compute in bfloat16, so the process does not keep the float32 file mapped beside the
    CPU plugin's bf16 copies (docs/benchmarks.md, "Mixed engines"); the others store float32.
    """
    ov = load_openvino()
    directory = Path(directory)
    files = {}
    for name in graph_names:
        start = time.perf_counter()
        source = directory / f"{name}.onnx"
        model = ov.convert_model(str(source))
        note = ", float16 weights" if name in fp16_weights else ""
        if precision in _BITS and name in LLM_GRAPHS:
            count = compress_matmul_weights(model, _BITS[precision])
            note = f", {count} MatMul weights {precision}"
        target = directory / f"{name}{IR_SUFFIX}"
        ov.save_model(model, str(target), compress_to_fp16=name in fp16_weights)
        del model
        source.unlink()
        source.with_name(source.name + ".data").unlink(missing_ok=True)
        files[name] = target.name
        message = f"{name}: OpenVINO IR{note} in {time.perf_counter() - start:.1f} s"
        _LOGGER.info("%s", message)
        if progress is not None:
            progress(message)
    return files


def check_graph_compiles(
    directory: Path,
    records: Mapping[str, GraphRecord],
    precision: str,
    progress: Progress | None = None,
) -> tuple[dict[str, GraphRecord], dict[str, Any]]:
    """Compile every OpenVINO graph of ``records`` (the IR files in ``directory``) in a child process, in
    the precision it computes in for engines of ``precision``: a native crash there (a signal) must not
    end the build, nor, later, the process that loads the engines (``runtime.native_guard``).

    A graph whose reduced-precision compile crashes falls back to float32: its record gets
    ``compute="fp32"`` and ``compute_reason`` (the signal, CPU and OpenVINO version); one that crashes in
    float32 too raises ``BuildError`` saying to build with ``--backend onnxruntime``. Returns the records
    and the manifest's ``compile_check`` (this machine, the OpenVINO version, each graph's compute), which
    a load on a machine like this one trusts instead of checking again.
    """
    from ..runtime import native_guard
    from ..runtime.backends.onnxruntime.runner import default_threads
    from ..runtime.backends.openvino.runner import (
        COMPILE_CHECK_TARGET,
        OV_BACKEND,
        cpu_has_bf16,
        graph_precisions,
    )

    ov = load_openvino()
    version = ov.get_version()
    here = native_guard.machine()
    names = [
        name
        for name, record in records.items()
        if (record.backend or OV_BACKEND) == OV_BACKEND and record.file.endswith(IR_SUFFIX)
    ]
    planned = graph_precisions(precision, tuple(names))
    bf16 = cpu_has_bf16()
    # The crash depends on the thread count too (the tiny CosyVoice2 LLM in bf16 on Intel AMX: SIGFPE with 1
    # thread, compiles with 2): check with one thread (servers' pinned workers, tests) and the default.
    thread_counts = sorted({1, default_threads()})
    checked: dict[str, GraphRecord] = dict(records)
    computes = {name: planned[name] if bf16 else "fp32" for name in names}  # bf16 runs fp32 without kernels

    def payload(item: tuple[str, int]) -> dict[str, Any]:
        name, threads = item
        return {"path": str(Path(directory) / records[name].file), "name": name, "compute": computes[name],
                "threads": threads}  # fmt: skip

    start = time.perf_counter()
    pending = [(name, threads) for name in names for threads in thread_counts]
    while pending:  # one child compiles them in order; after a crash, a new one goes on from that graph
        done, outcome = native_guard.run_each_in_child(COMPILE_CHECK_TARGET, [payload(item) for item in pending])
        if outcome.ok:
            break
        name, threads = pending[done]
        if not outcome.crashed:
            raise BuildError(f"OpenVINO could not compile graph '{name}':\n{outcome.detail}")
        if computes[name] == "fp32":
            raise BuildError(
                f"OpenVINO {version} crashed ({outcome.signal}) compiling graph '{name}' in fp32 with "
                f"{threads} thread(s) on {here.describe()}. Build ONNX Runtime engines on this machine "
                "instead: `trt-cosy build --backend onnxruntime ...`."
            )
        reason = (
            f"OpenVINO {version} crashed ({outcome.signal}) compiling it in {computes[name]} with {threads} "
            f"thread(s) on {here.describe()}; it computes in fp32"
        )
        _LOGGER.warning("graph '%s': %s", name, reason)
        computes[name] = "fp32"
        checked[name] = dataclasses.replace(records[name], compute="fp32", compute_reason=reason)
        if progress is not None:
            progress(f"{name}: falls back to fp32 ({reason})")
        rest = [item for item in pending[done:] if item[0] != name]
        pending = [(name, count) for count in thread_counts] + rest  # that graph again in fp32, then the rest
    if progress is not None and names:
        progress(f"{len(names)} OpenVINO graphs compile here ({time.perf_counter() - start:.1f} s, in a child process)")
    record = {
        "machine": here.key,
        "cpu": here.describe(),
        "backend_version": version,
        "threads": thread_counts,
        "graphs": computes,
    }
    return checked, record


def _weight_matmuls(model: Any) -> list[tuple[Any, Any]]:
    """(MatMul, its 2-D float32 Constant weight) pairs, in graph order."""
    pairs = []
    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul":
            continue
        weight = node.input_value(1).get_node()
        if (
            weight.get_type_name() == "Constant"
            and len(weight.get_output_shape(0)) == 2
            and weight.get_output_element_type(0).get_type_name() == "f32"
        ):
            pairs.append((node, weight))
    return pairs


def compress_matmul_weights(model: Any, bits: int, group: int = INT4_GROUP) -> int:
    """Store the 2-D constant MatMul weights of ``model`` (an ``ov.Model``) as symmetric ``bits``-bit
    integers with float32 scales, in place; return how many. With ``bits=4`` the last such MatMul
    (the output projection) is stored int8. A weight whose reduction axis does not split into
    ``group``-sized blocks gets int8 too."""
    ov = load_openvino()
    from openvino import opset13 as ops

    pairs = _weight_matmuls(model)
    for index, (matmul, constant) in enumerate(pairs):
        weight = constant.get_data()  # [K, N], or [N, K] when the MatMul transposes it
        axis = 1 if matmul.get_transpose_b() else 0  # the reduction axis of the weight
        layer_bits = bits
        if bits == 4 and (index == len(pairs) - 1 or weight.shape[axis] % group):
            layer_bits = 8
        decompressed = _decompression(ops, ov, weight, axis, layer_bits, group)
        matmul.input(1).replace_source_output(decompressed)
    model.validate_nodes_and_infer_types()
    if not pairs:
        raise BuildError("found no constant MatMul weights to compress in the LLM graph (a trt-cosy bug).")
    return len(pairs)


def _decompression(ops: Any, ov: Any, weight: np.ndarray, axis: int, bits: int, group: int) -> Any:
    """The subgraph ``Constant(int) -> Convert(f32) -> Multiply(scale) [-> Reshape]`` equal to
    ``weight`` up to rounding (symmetric, per output channel for 8 bits, per ``group`` for 4)."""
    limit = _INT_MAX[bits]
    if bits == 8:
        blocks = weight  # [K, N]: one scale per output channel
        scale_axis = axis
    else:  # split the reduction axis into [K / group, group]
        shape = list(weight.shape)
        shape[axis : axis + 1] = [shape[axis] // group, group]
        blocks = weight.reshape(shape)  # [K/g, g, N] or [N, K/g, g]
        scale_axis = axis + 1
    scale = np.abs(blocks).max(axis=scale_axis, keepdims=True) / limit
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    quantised = np.clip(np.rint(blocks / scale), -limit - 1, limit).astype(np.int8)
    node = ops.constant(quantised) if bits == 8 else ov.op.Constant(_int4_tensor(ov, quantised))
    node = ops.convert(node, ov.Type.f32)
    node = ops.multiply(node, ops.constant(scale))
    if bits == 4:
        node = ops.reshape(node, ops.constant(np.asarray(weight.shape, dtype=np.int64)), special_zero=False)
    return node.output(0)


def _int4_tensor(ov: Any, values: np.ndarray) -> Any:
    """An ``ov.Tensor`` of element type i4 holding ``values`` (int8 in [-8, 7]), two per byte."""
    flat = values.reshape(-1).astype(np.uint8) & 0x0F  # two's complement nibbles
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    packed = flat[0::2] | (flat[1::2] << 4)  # low nibble first
    tensor = ov.Tensor(ov.Type.i4, ov.Shape(list(values.shape)))
    tensor.data[...] = packed.view(np.int8)
    return tensor


def derive_openvino_engines(
    fp32_dir: Path, out_dir: Path, precision: str, progress: Progress | None = None
) -> Path:
    """Make ``precision`` OpenVINO engines from fp32 OpenVINO engines without re-exporting.

    The fp32 directory is copied (hard links; a rewritten graph is written to a new file) to a
    staging directory next to ``out_dir`` (which must not exist); ``int8``/``int4`` compress the
    LLM's weights (``compress_matmul_weights``); ``bf16`` changes only the manifest (what a graph
    computes in is decided at load time). The manifest gets the new precision and file sizes.
    """
    from ..errors import InputError
    from ..runtime.backends.openvino.runner import OV_BACKEND, OV_PRECISIONS
    from .derived import write_derived_engines

    fp32_dir, out_dir = Path(fp32_dir), Path(out_dir)
    manifest = Manifest.read(fp32_dir)
    if manifest.backend != OV_BACKEND or manifest.precision != "fp32":
        raise InputError(
            f"{fp32_dir} holds {manifest.backend}/{manifest.precision} engines; derive from OpenVINO fp32 "
            "engines (`trt-cosy build --backend openvino --precision fp32`)."
        )
    if precision not in OV_PRECISIONS:
        raise InputError(f"precision {precision!r} is unknown; use {', '.join(OV_PRECISIONS)}.")
    if out_dir.exists():
        raise InputError(f"{out_dir} exists; choose a new directory for the {precision} engines.")
    ov = load_openvino()

    def compress(staging: Path) -> None:
        for name in LLM_GRAPHS & set(manifest.graphs) if precision in _BITS else ():
            start = time.perf_counter()
            xml = staging / manifest.graphs[name].file
            model = ov.Core().read_model(str(fp32_dir / manifest.graphs[name].file))
            count = compress_matmul_weights(model, _BITS[precision])
            xml.unlink()
            xml.with_suffix(".bin").unlink()
            ov.save_model(model, str(xml), compress_to_fp16=False)
            del model
            message = f"{name}: {count} MatMul weights {precision} in {time.perf_counter() - start:.1f} s"
            _LOGGER.info("%s", message)
            if progress is not None:
                progress(message)

    def check(staging: Path, derived: Manifest) -> Manifest:  # each graph compiled in a child, once
        records, compile_check = check_graph_compiles(staging, derived.graphs, precision, progress)
        return dataclasses.replace(derived, graphs=records, compile_check=compile_check)

    return write_derived_engines(fp32_dir, out_dir, manifest, precision, compress, finish=check)
