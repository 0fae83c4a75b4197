"""The incremental streaming estimator ``flow_estimator_incremental.onnx`` (contract
``graphs.FLOW_ESTIMATOR_INCREMENTAL``; CosyVoice3: ``graphs_v3.FLOW_ESTIMATOR_INCREMENTAL_V3``) for
the ONNX Runtime engines of CosyVoice2 and CosyVoice3.

Exported beside the other graphs by ``trt-cosy build`` (onnxruntime backend, CosyVoice2 and 3),
checked against torch like every graph, then given the estimators' treatment: Mish and GELU
rewritten for ONNX Runtime (proven equal) and, for the int8/int4 precisions, dynamic int8 MatMuls.
``add_incremental_estimator`` adds it to engines built before it existed. Engines without it still
load: their streaming chunks recompute the flow from the start (``stages.flow``).

CosyVoice 1 has no chunk-attention estimator (its streaming recomputes with full attention): it
keeps the recomputation. CosyVoice3's DiT graph is ``build.models.v3.dit_incremental``.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import numpy as np
import onnx
from torch import nn
from torch.export import Dim

from ..config import ModelConfig
from ..errors import InputError
from ..models.v3 import graphs as graphs_v3
from ..runtime import graphs
from ..runtime.graphs import GraphSpec
from ..runtime.manifest import MANIFEST_NAME, GraphRecord, Manifest
from ..runtime.model import LoadedModel
from ..stages.flow_incremental import cache_layout
from .export import ExportResult, GraphPlan, export_graph, graph_record
from .modules.flow_estimator import CausalConditionalDecoder
from .modules.flow_estimator_incremental import IncrementalEstimatorGraph, incremental_cache_layout
from .onnx_files import save_onnx
from .ort_passes import INCREMENTAL_REWRITES, check_equivalent, rewrite_model
from .quantize import quantize_matmul_int8

__all__ = [
    "INCREMENTAL_FILE",
    "incremental_export_plan",
    "write_incremental_estimator",
    "add_incremental_estimator",
]

_LOGGER = logging.getLogger(__name__)

INCREMENTAL_FILE: Final = f"{graphs.FLOW_ESTIMATOR_INCREMENTAL.name}.onnx"
_TOLERANCE: Final = 1e-4  # as the other estimators (export.TOLERANCES)

Progress = Callable[[str], None]


def _estimator(model: LoadedModel) -> CausalConditionalDecoder | None:
    """The torch CosyVoice2 estimator of a reference model, or None for other families."""
    if model.config.family != "v2":
        return None
    runner = model.runners.get(graphs.FLOW_ESTIMATOR.name)
    estimator = getattr(getattr(runner, "module", None), "estimator", None)
    return estimator if isinstance(estimator, CausalConditionalDecoder) else None


def incremental_export_plan(
    config: ModelConfig, estimator: CausalConditionalDecoder | None = None, seed: int = 0
) -> GraphPlan:
    """Sample and parity feeds (P = 0 and a single new frame included) and the dynamic dims.

    Without ``estimator`` the cache layout comes from ``config`` (``stages.flow_incremental.cache_layout``,
    tested equal): the TensorRT fp16 pass calibrates on these feeds without the torch model.
    """
    rng = np.random.default_rng(seed)
    mels = config.flow.output_size
    if estimator is None:
        blocks, width, channels = cache_layout(config.flow.estimator)
        chunk = config.flow.estimator.static_chunk_size
    else:
        blocks, width, channels = incremental_cache_layout(estimator)
        chunk = estimator.config.static_chunk_size

    def feed(new: int, past: int) -> dict[str, np.ndarray]:
        return {
            "x": rng.standard_normal((2, mels, new), dtype=np.float32),  # [2, 80, T]
            "mu": rng.standard_normal((2, mels, new), dtype=np.float32),  # [2, 80, T]
            "t": rng.uniform(0.0, 1.0, 2).astype(np.float32),  # [2]
            "spks": rng.standard_normal((2, mels), dtype=np.float32),  # [2, 80]
            "cond": rng.standard_normal((2, mels, new), dtype=np.float32),  # [2, 80, T]
            "past_blocks": rng.standard_normal((past, blocks, 2, width), dtype=np.float32),  # [P, L, 2, D]
            "past_tails": rng.standard_normal((2, channels, 2), dtype=np.float32),  # [2, C, 2]
        }

    new, past = Dim("T", min=1), Dim("P", min=0)
    dynamic = {name: {2: new} for name in ("x", "mu", "cond")} | {"past_blocks": {0: past}}
    return GraphPlan(
        feed(chunk + 13, 2 * chunk), (feed(2 * chunk + 7, 0), feed(1, chunk), feed(37, 3 * chunk)), dynamic
    )


def write_incremental_estimator(
    model: LoadedModel, out_dir: Path, precision: str, progress: Progress | None = None
) -> tuple[Path, GraphRecord] | None:
    """Export, rewrite and (int8/int4) quantise the incremental estimator into ``out_dir``.

    Returns the graph file and its manifest record, or None where the family has none (v1).
    """
    graph = _incremental_graph(model)
    if graph is None:
        return None
    spec, module, plan = graph
    out_dir = Path(out_dir)
    path = out_dir / INCREMENTAL_FILE
    result = export_graph(
        spec,
        module,
        plan.sample,
        path,
        plan.dynamic_shapes,
        parity_inputs=plan.parity,
        tolerance=_TOLERANCE,
        progress=progress,
    )
    _rewrite(path, [plan.sample, *plan.parity], progress)
    if precision != "fp32":
        start = time.perf_counter()
        staged = path.with_name(f".{path.stem}.int8.onnx")
        count = quantize_matmul_int8(path, staged)
        staged.replace(path)
        _emit(progress, f"{spec.name}: {count} MatMul weights -> int8 in {time.perf_counter() - start:.1f} s")
    return path, _record(result, out_dir)


def _incremental_graph(model: LoadedModel) -> tuple[GraphSpec, nn.Module, GraphPlan] | None:
    """(contract, torch module, export plan) of the family's incremental estimator, or None (v1)."""
    if model.config.family == "v3":
        from .models.v3.dit_incremental import V3IncrementalEstimatorGraph, v3_incremental_export_plan

        runner = model.runners.get(graphs.FLOW_ESTIMATOR.name)
        dit = getattr(getattr(runner, "module", None), "estimator", None)  # EstimatorGraph(flow).estimator
        if dit is None:
            return None
        spec = graphs_v3.FLOW_ESTIMATOR_INCREMENTAL_V3
        return spec, V3IncrementalEstimatorGraph(dit), v3_incremental_export_plan(model.config)
    estimator = _estimator(model)
    if estimator is None:
        return None
    plan = incremental_export_plan(model.config, estimator)
    return graphs.FLOW_ESTIMATOR_INCREMENTAL, IncrementalEstimatorGraph(estimator), plan


def _rewrite(path: Path, feeds: list[dict[str, np.ndarray]], progress: Progress | None) -> None:
    """Attention fused (chunk mask kept as its bias), Mish and GELU in ONNX Runtime's faster forms,
    proven equal on the export feeds."""
    model = onnx.load(str(path))
    counts = rewrite_model(model, INCREMENTAL_REWRITES)
    if not counts.total():
        return
    with tempfile.TemporaryDirectory(prefix=".rewrite-", dir=path.parent) as scratch:
        staged = save_onnx(model, Path(scratch) / path.name)
        del model
        worst = check_equivalent(path, staged, feeds, path.stem)
        for file in Path(scratch).iterdir():
            file.replace(path.parent / file.name)
    _emit(
        progress,
        f"{path.stem}: {counts.describe()} rewritten for ONNX Runtime (max relative change {worst:.1e})",
    )


def _record(result: ExportResult, root: Path) -> GraphRecord:
    return graph_record(result.path, root, result.max_errors)


def _emit(progress: Progress | None, message: str) -> None:
    _LOGGER.info("%s", message)
    if progress is not None:
        progress(message)


def add_incremental_estimator(engines_dir: Path, model_dir: Path, progress: Progress | None = None) -> Path:
    """Add ``flow_estimator_incremental.onnx`` to existing CosyVoice2/3 ONNX Runtime engines of this
    version (built from ``model_dir``, checked by hash) and record it in the manifest."""
    from .family_engines import load_model_for_build

    engines_dir = Path(engines_dir)
    manifest = Manifest.read(engines_dir)
    manifest.check(engines_dir, Path(model_dir), backend="onnxruntime")
    model = load_model_for_build(Path(model_dir))
    written = write_incremental_estimator(model, engines_dir, manifest.precision, progress)
    if written is None:
        raise InputError(
            f"{model_dir} is a CosyVoice 1 release: only CosyVoice2 and CosyVoice3 have an incremental "
            "streaming estimator."
        )
    path, record = written
    files = {
        item.relative_to(engines_dir).as_posix(): item.stat().st_size
        for item in sorted(engines_dir.rglob("*"))
        if item.is_file() and item.name != MANIFEST_NAME and item.relative_to(engines_dir).parts[0] != "plans"
    }
    graphs_ = {**manifest.graphs, graphs.FLOW_ESTIMATOR_INCREMENTAL.name: record}
    dataclasses.replace(manifest, graphs=graphs_, files=files).write(engines_dir)
    return path
