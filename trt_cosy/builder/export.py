"""ONNX export of one graph with the dynamo exporter, checked by ``onnx.checker`` and an ORT parity run.

``export_graph`` is the generic step (one module, one contract, one file). ``graph_export_plan``
holds, per graph of ``trt_cosy.runtime.graphs``, the sample feeds (export lengths plus parity
lengths) and the dynamic dims; ``export_model`` runs the five exports of a reference model.

The legacy TorchScript exporter bakes attention sequence lengths into the graph
(docs/environment-notes.md), so only ``torch.onnx.export(..., dynamo=True)`` is used. Sample
lengths avoid 0 and 1 (torch.export specialises such sizes) and avoid equal values for different
dims; the parity feeds then cover the edge lengths (T = 1, P = 0, S = 0).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import onnx
import torch
from torch import nn
from torch.export import Dim

from ..config import HiFTConfig, ModelConfig
from ..errors import TrtCosyError
from ..runtime import graphs
from ..runtime.backends.onnxruntime.runner import OrtRunner
from ..runtime.graphs import GraphSpec
from ..runtime.manifest import GraphRecord, TensorRecord
from ..runtime.model import LoadedModel
from . import export_reuse
from .progress import emitter

__all__ = [
    "OPSET",
    "TOLERANCES",
    "ExportResult",
    "graph_record",
    "GraphPlan",
    "export_graph",
    "graph_export_plan",
    "export_model",
    "export_graphs",
    "hift_plan",
    "onnx_io_specs",
]

_LOGGER = logging.getLogger(__name__)

OPSET: Final = 18  # the official estimator export uses opset 18
# Parity tolerance per graph, on max |ort - torch| / max(1, max |torch|): absolute for outputs within
# ±1, relative above (f0 in Hz, large logits of the full-size LLM).
TOLERANCES: Final = {
    graphs.LLM.name: 1e-4,
    graphs.FLOW_ENCODER.name: 1e-4,
    graphs.FLOW_ESTIMATOR.name: 1e-4,
    graphs.FLOW_ESTIMATOR_STREAM.name: 1e-4,
    graphs.HIFT.name: 1e-3,
}
_DEFAULT_TOLERANCE: Final = 1e-4
# Protobuf caps a file at 2 GiB; above this many parameter bytes the weights go to <graph>.onnx.data.
_EXTERNAL_DATA_BYTES: Final = 1 << 30
_EXPORTER_LOGGERS: Final = ("onnx_ir", "onnxscript", "torch.onnx")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ExportResult:
    """One exported graph: its file(s) and the measured ORT-vs-torch error per output."""

    name: str
    path: Path
    files: tuple[Path, ...]  # the graph and, for large models, its external data file
    max_errors: dict[str, float]  # output name -> max scaled error over every parity feed
    seconds: float


@dataclass(frozen=True)
class GraphPlan:
    """What ``export_graph`` needs for one graph besides the module."""

    sample: dict[str, np.ndarray]  # the feed the graph is traced with
    parity: tuple[dict[str, np.ndarray], ...]  # further feeds at other lengths (edge lengths included)
    dynamic_shapes: dict[str, dict[int, Any]]  # input name -> {axis: Dim or derived dim}


def export_graph(
    spec: GraphSpec,
    module: nn.Module,
    sample_inputs: Mapping[str, np.ndarray],
    path: Path,
    dynamic_shapes: Mapping[str, Mapping[int, Any]],
    *,
    parity_inputs: Sequence[Mapping[str, np.ndarray]] = (),
    tolerance: float | None = None,
    opset: int = OPSET,
    progress: Progress | None = None,
) -> ExportResult:
    """Export ``module`` (forward follows ``spec``) to ``path`` and check it against torch.

    The graph is traced on ``sample_inputs``; ``dynamic_shapes`` maps input names to their dynamic
    axes. After ``onnx.checker`` the graph runs on ONNX Runtime for the sample and every feed of
    ``parity_inputs``; an error above ``tolerance`` (default ``TOLERANCES[spec.name]``, else 1e-4) raises
    ``TrtCosyError`` naming the output and the error.
    """
    path = Path(path)
    emit = emitter(_LOGGER, progress)
    key = export_reuse.export_key(
        spec.name, path.name, module, [sample_inputs, *parity_inputs], dynamic_shapes, opset, tolerance
    )
    with export_reuse.claimed(key):  # another process making the same export: wait, then reuse it
        if (kept := export_reuse.reused(key, spec.name, path, emit)) is not None:  # an earlier build's export
            return ExportResult(spec.name, path, kept.files, kept.max_errors, kept.seconds)
        result = _export_and_check(
            spec, module, sample_inputs, path, dynamic_shapes, parity_inputs, tolerance, opset, emit
        )
        export_reuse.remember(key, result)
    return result


def _export_and_check(
    spec: GraphSpec,
    module: nn.Module,
    sample_inputs: Mapping[str, np.ndarray],
    path: Path,
    dynamic_shapes: Mapping[str, Mapping[int, Any]],
    parity_inputs: Sequence[Mapping[str, np.ndarray]],
    tolerance: float | None,
    opset: int,
    emit: Callable[[str], None],
) -> ExportResult:
    """``export_graph``'s work where no earlier export is reused: export, check the graph, compare with torch."""
    start = time.perf_counter()
    module = module.eval()
    emit(f"{spec.name}: exporting to {path.name} (opset {opset})")
    _export_to_file(spec, module, sample_inputs, path, dynamic_shapes, opset)
    onnx.checker.check_model(str(path))  # a path, so graphs with external data are checked too
    _check_io_names(spec, path)
    emit(f"{spec.name}: checking ONNX Runtime against torch on {1 + len(parity_inputs)} feeds")
    errors = _parity(spec, module, path, [sample_inputs, *parity_inputs])
    limit = TOLERANCES.get(spec.name, _DEFAULT_TOLERANCE) if tolerance is None else tolerance
    worst = max(errors, key=errors.__getitem__)
    if errors[worst] > limit:
        raise TrtCosyError(
            f"exported graph {path} differs from torch: output '{worst}' max error {errors[worst]:.3e} "
            f"> tolerance {limit:.0e} (all: {_format_errors(errors)}). This is a bug in the export of "
            f"'{spec.name}'; report it with the model release you used."
        )
    data = path.with_name(path.name + ".data")
    files = (path, data) if data.exists() else (path,)
    seconds = time.perf_counter() - start
    emit(f"{spec.name}: done in {seconds:.1f} s, max error {_format_errors(errors)}")
    return ExportResult(spec.name, path, files, errors, seconds)


def _export_to_file(
    spec: GraphSpec,
    module: nn.Module,
    sample_inputs: Mapping[str, np.ndarray],
    path: Path,
    dynamic_shapes: Mapping[str, Mapping[int, Any]],
    opset: int,
) -> None:
    """Trace with the dynamo exporter and save; weights go to ``<path>.data`` for large modules."""
    args = tuple(torch.from_numpy(np.ascontiguousarray(sample_inputs[name])) for name in spec.input_names)
    shapes = tuple(
        dict(dynamic_shapes[name]) if name in dynamic_shapes else None for name in spec.input_names
    )
    with torch.no_grad(), _quiet_exporter():
        program = torch.onnx.export(
            module,
            args,
            input_names=list(spec.input_names),
            output_names=list(spec.output_names),
            opset_version=opset,
            dynamo=True,
            dynamic_shapes=shapes,
            report=False,
            verbose=False,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=_parameter_bytes(module) > _EXTERNAL_DATA_BYTES)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Hold the exporter's own INFO chatter (one line per optimisation pass) unless we log at DEBUG."""
    if _LOGGER.isEnabledFor(logging.DEBUG):
        yield
        return
    loggers = [logging.getLogger(name) for name in _EXPORTER_LOGGERS]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message=".*axis name.*will not be used", category=UserWarning)
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def _parameter_bytes(module: nn.Module) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def _format_errors(errors: Mapping[str, float]) -> str:
    return ", ".join(f"{name} {value:.2e}" for name, value in errors.items())


def _check_io_names(spec: GraphSpec, path: Path) -> None:
    inputs, outputs = onnx_io_specs(path)
    found = (tuple(item["name"] for item in inputs), tuple(item["name"] for item in outputs))
    if found != (spec.input_names, spec.output_names):
        raise TrtCosyError(
            f"exported graph {path} has inputs {found[0]} and outputs {found[1]}; the contract "
            f"'{spec.name}' wants {spec.input_names} -> {spec.output_names}. This is an export bug."
        )


def onnx_io_specs(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Inputs and outputs of an ONNX file as ``{name, dtype, shape}`` (symbolic dims as strings)."""
    model = onnx.load(str(path), load_external_data=False)

    def describe(value: onnx.ValueInfoProto) -> dict[str, Any]:
        tensor = value.type.tensor_type
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)).name
        shape = [
            dim.dim_param if dim.HasField("dim_param") else int(dim.dim_value) for dim in tensor.shape.dim
        ]
        return {"name": value.name, "dtype": dtype, "shape": shape}

    return [describe(v) for v in model.graph.input], [describe(v) for v in model.graph.output]


def graph_record(path: Path, root: Path, max_errors: Mapping[str, float] | None = None) -> GraphRecord:
    """The manifest record of the graph at ``path`` (its I/O as ``onnx_io_specs`` reads them), named
    relative to the engines folder ``root``; ``max_errors``: its measured parity, when it had a check."""
    inputs, outputs = onnx_io_specs(path)

    def record(item: dict) -> TensorRecord:
        return TensorRecord(item["name"], item["dtype"], tuple(item["shape"]))

    return GraphRecord(
        file=path.relative_to(root).as_posix(),
        inputs=tuple(record(item) for item in inputs),
        outputs=tuple(record(item) for item in outputs),
        max_errors=dict(max_errors or {}),
    )


def _parity(
    spec: GraphSpec, module: nn.Module, path: Path, feeds: Sequence[Mapping[str, np.ndarray]]
) -> dict[str, float]:
    """Max over ``feeds`` of max |ort - torch| / max(1, max |torch|), per output."""
    runner = OrtRunner.from_path(path, spec.name, exported=True)
    errors = dict.fromkeys(spec.output_names, 0.0)
    for feed in feeds:
        args = [torch.from_numpy(np.ascontiguousarray(feed[name])) for name in spec.input_names]
        with torch.no_grad():
            expected = module(*args)
        expected = (expected,) if isinstance(expected, torch.Tensor) else expected
        got = runner.infer(feed)
        for name, reference in zip(spec.output_names, expected, strict=True):
            reference = reference.numpy()
            if got[name].shape != reference.shape:
                raise TrtCosyError(
                    f"exported graph {path}: output '{name}' has shape {got[name].shape} on ONNX Runtime "
                    f"but {reference.shape} in torch. This is an export bug (a length baked into the graph?)."
                )
            if reference.size and not (np.isfinite(got[name]).all() and np.isfinite(reference).all()):
                errors[name] = math.inf  # NaN would vanish in max(); a non-finite output is never parity
            elif reference.size:
                scale = max(1.0, float(np.abs(reference).max()))
                error = float(np.abs(got[name].astype(np.float64) - reference).max()) / scale
                errors[name] = max(errors[name], error)
    return errors


def graph_export_plan(name: str, config: ModelConfig, seed: int = 0) -> GraphPlan:
    """Sample feed, parity feeds and dynamic dims of graph ``name`` for a model of ``config``."""
    builders = {
        graphs.LLM.name: _llm_plan,
        graphs.FLOW_ENCODER.name: _flow_encoder_plan,
        graphs.FLOW_ESTIMATOR.name: _estimator_plan,
        graphs.FLOW_ESTIMATOR_STREAM.name: _estimator_plan,
        graphs.HIFT.name: _hift_plan,
    }
    return builders[name](config, np.random.default_rng(seed))


def _llm_plan(config: ModelConfig, rng: np.random.Generator) -> GraphPlan:
    qwen = config.llm.qwen

    def feed(new: int, past: int) -> dict[str, np.ndarray]:
        cache = (qwen.num_layers, 1, qwen.num_kv_heads, past, qwen.head_dim)
        return {
            "inputs_embeds": rng.standard_normal((1, new, qwen.hidden_size), dtype=np.float32),  # [1, T, D]
            "past_keys": rng.standard_normal(cache, dtype=np.float32),  # [L, 1, H, P, Dh]
            "past_values": rng.standard_normal(cache, dtype=np.float32),  # [L, 1, H, P, Dh]
        }

    new, past = Dim("T", min=1), Dim("P", min=0)
    dynamic = {"inputs_embeds": {1: new}, "past_keys": {3: past}, "past_values": {3: past}}
    return GraphPlan(feed(5, 7), (feed(1, 9), feed(6, 0)), dynamic)


def _flow_encoder_plan(config: ModelConfig, rng: np.random.Generator) -> GraphPlan:
    flow = config.flow

    def feed(tokens: int, context_valid: float, streaming: float) -> dict[str, np.ndarray]:
        return {
            "tokens": rng.integers(0, flow.vocab_size, (1, tokens), dtype=np.int64),  # [1, N]
            "context": rng.integers(0, flow.vocab_size, (1, flow.encoder.pre_lookahead_len), dtype=np.int64),
            "context_valid": np.array([context_valid], dtype=np.float32),  # [1]
            "streaming": np.array([streaming], dtype=np.float32),  # [1]
            "embedding": rng.standard_normal((1, flow.spk_embed_dim), dtype=np.float32),  # [1, 192]
        }

    dynamic = {"tokens": {1: Dim("N", min=1)}}
    chunk = flow.encoder.static_chunk_size
    return GraphPlan(feed(30, 1.0, 0.0), (feed(2 * chunk + 7, 1.0, 1.0), feed(13, 0.0, 0.0)), dynamic)


def _estimator_plan(config: ModelConfig, rng: np.random.Generator) -> GraphPlan:
    mels = config.flow.output_size

    def feed(frames: int, valid: int) -> dict[str, np.ndarray]:
        mask = np.zeros((2, 1, frames), dtype=np.float32)  # [2, 1, F]
        mask[:, :, :valid] = 1.0
        return {
            "x": rng.standard_normal((2, mels, frames), dtype=np.float32),  # [2, 80, F]
            "mask": mask,
            "mu": rng.standard_normal((2, mels, frames), dtype=np.float32),  # [2, 80, F]
            "t": rng.uniform(0.0, 1.0, 2).astype(np.float32),  # [2]
            "spks": rng.standard_normal((2, mels), dtype=np.float32),  # [2, 80]
            "cond": rng.standard_normal((2, mels, frames), dtype=np.float32),  # [2, 80, F]
        }

    frames = Dim("F", min=1)
    dynamic = {name: {2: frames} for name in ("x", "mask", "mu", "cond")}
    chunk = config.flow.estimator.static_chunk_size
    return GraphPlan(feed(60, 60), (feed(2 * chunk + 23, 2 * chunk + 23), feed(37, 30)), dynamic)


def _hift_plan(config: ModelConfig, rng: np.random.Generator) -> GraphPlan:
    return hift_plan(config.hift, rng)


def hift_plan(hift: HiFTConfig, rng: np.random.Generator, rand_phase: bool = False) -> GraphPlan:
    """The plan of a HiFT graph with a cached source (CosyVoice 1 and 2); ``rand_phase`` adds the
    CosyVoice 1 ``SineGen``'s random initial phases."""
    hop = hift.samples_per_frame
    harmonics = hift.nb_harmonics + 1

    def feed(frames: int, cached: int) -> dict[str, np.ndarray]:
        mel = rng.standard_normal((1, hift.in_channels, frames), dtype=np.float32) - 4.0  # [1, 80, F]
        noise = rng.standard_normal((1, frames * hop, harmonics), dtype=np.float32)  # [1, hop F, 9]
        inputs = {"mel": mel.astype(np.float32), "sine_noise": noise}
        if rand_phase:
            inputs["rand_phase"] = rng.random((1, harmonics), dtype=np.float32)  # [1, 9]
        inputs["cache_source"] = 0.1 * rng.standard_normal((1, 1, cached), dtype=np.float32)  # [1, 1, S]
        return inputs

    frames = Dim("F", min=1)
    dynamic = {"mel": {2: frames}, "sine_noise": {1: hop * frames}, "cache_source": {2: Dim("S", min=0)}}
    return GraphPlan(feed(12, 2 * hop), (feed(20, 0), feed(7, 3 * hop + 11)), dynamic)


def export_model(
    model: LoadedModel, out_dir: Path, progress: Progress | None = None
) -> dict[str, ExportResult]:
    """Export every graph of ``graphs.GRAPHS`` from a torch reference model to ``out_dir/<name>.onnx``."""
    return export_graphs(
        model, out_dir, graphs.GRAPHS, lambda name: graph_export_plan(name, model.config), progress=progress
    )


def export_graphs(
    model: LoadedModel,
    out_dir: Path,
    specs: Mapping[str, GraphSpec],
    plan_of: Callable[[str], GraphPlan],
    tolerance_of: Callable[[str], float | None] = lambda name: None,
    progress: Progress | None = None,
) -> dict[str, ExportResult]:
    """Export each graph of ``specs`` (any family's) from a torch reference model to ``out_dir/<name>.onnx``:
    the module of its runner, fed ``plan_of(name)``, checked within ``tolerance_of(name)`` (None: the
    ``export_graph`` default)."""
    results = {}
    for name, spec in specs.items():
        plan = plan_of(name)
        results[name] = export_graph(
            spec,
            model.runners[name].module,  # a TorchRunner's module
            plan.sample,
            Path(out_dir) / f"{name}.onnx",
            plan.dynamic_shapes,
            parity_inputs=plan.parity,
            tolerance=tolerance_of(name),
            progress=progress,
        )
    return results
