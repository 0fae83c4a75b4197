"""The incremental streaming estimator ``flow_estimator_incremental`` (contract
``graphs.FLOW_ESTIMATOR_INCREMENTAL``; CosyVoice3: ``graphs_v3.FLOW_ESTIMATOR_INCREMENTAL_V3``) for
CosyVoice2 engines on ONNX Runtime, OpenVINO and mixed, and CosyVoice3 engines on ONNX Runtime.

Exported beside the other graphs by ``trt-cosy build`` and checked against torch like every graph
(``export_incremental_estimator``). ONNX Runtime engines then give it the estimators' treatment
(``write_incremental_estimator``): attention fused into ``MultiHeadAttention`` with the chunk mask
as its bias, Mish and GELU rewritten for ONNX Runtime (``ort_passes.INCREMENTAL_REWRITES``, proven
equal) and, for the int8/int4 precisions, dynamic int8 MatMuls. OpenVINO and mixed engines
(CosyVoice2) convert the plain export to OpenVINO IR like their other estimators (``builder.openvino``,
``builder.mixed``): in mixed engines it computes in bfloat16 with float16-stored weights, as the flow
estimators (docs/benchmarks.md, "Mixed engines"). ``add_incremental_estimator`` adds it to engines
of any of these backends built before it existed. Engines without it still load: their streaming
chunks recompute the flow from the start (``stages.flow``).

CosyVoice 1 has no chunk-attention estimator (its streaming recomputes with full attention): it
keeps the recomputation. CosyVoice3's DiT graph is ``models.v3.export.dit_incremental``.
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
from ..family_lookup import family_named
from ..runtime import graphs
from ..runtime.engines import MIXED_BACKEND, ORT_BACKEND, OV_BACKEND
from ..runtime.graphs import GraphSpec
from ..runtime.manifest import MANIFEST_NAME, GraphRecord, Manifest
from ..runtime.model import LoadedModel
from ..stages.flow_incremental import cache_layout
from .export import ExportResult, GraphPlan, export_graph, graph_record
from .modules.flow_estimator import CausalConditionalDecoder
from .modules.flow_estimator_incremental import IncrementalEstimatorGraph, incremental_cache_layout
from .onnx.files import save_onnx
from .onnx.passes import INCREMENTAL_REWRITES, check_equivalent, rewrite_model
from .progress import emitter
from .quantize.engines import quantize_matmul_int8
from .registry import build_family_of

__all__ = [
    "INCREMENTAL_FILE",
    "INCREMENTAL_BACKENDS",
    "incremental_export_plan",
    "incremental_feeds_plan",
    "unet_incremental_graph",
    "export_incremental_estimator",
    "export_incremental_graph",
    "write_incremental_estimator",
    "add_incremental_estimator",
]

_LOGGER = logging.getLogger(__name__)

INCREMENTAL_FILE: Final = f"{graphs.FLOW_ESTIMATOR_INCREMENTAL.name}.onnx"
# The engines that carry it (TensorRT engines do not yet: their streaming recomputes).
INCREMENTAL_BACKENDS: Final = (ORT_BACKEND, OV_BACKEND, MIXED_BACKEND)
_TOLERANCE: Final = 1e-4  # as the other estimators (export.TOLERANCES)

Progress = Callable[[str], None]


def _estimator(model: LoadedModel) -> CausalConditionalDecoder | None:
    """The torch CosyVoice2 estimator of a reference model, or None for other families."""
    if family_named(model.config.family).incremental_estimator != "unet":
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
    if estimator is None:
        blocks, width, channels = cache_layout(config.flow.estimator)
        chunk = config.flow.estimator.static_chunk_size
    else:
        blocks, width, channels = incremental_cache_layout(estimator)
        chunk = estimator.config.static_chunk_size
    return incremental_feeds_plan(config.flow.output_size, (blocks, width, channels, 2), chunk, 37, seed)


def incremental_feeds_plan(
    mels: int, layout: tuple[int, int, int, int], chunk: int, longest: int, seed: int
) -> GraphPlan:
    """An incremental estimator's seeded sample and parity feeds and dynamic dims (any family):
    ``layout`` = (L cached blocks, D their width, C tail channels, the tail's frames); the parity feeds
    hold P = 0, a single new frame and ``longest`` new frames after three chunks."""
    rng = np.random.default_rng(seed)
    blocks, width, channels, tail = layout

    def feed(new: int, past: int) -> dict[str, np.ndarray]:
        return {
            "x": rng.standard_normal((2, mels, new), dtype=np.float32),  # [2, 80, T]
            "mu": rng.standard_normal((2, mels, new), dtype=np.float32),  # [2, 80, T]
            "t": rng.uniform(0.0, 1.0, 2).astype(np.float32),  # [2]
            "spks": rng.standard_normal((2, mels), dtype=np.float32),  # [2, 80]
            "cond": rng.standard_normal((2, mels, new), dtype=np.float32),  # [2, 80, T]
            "past_blocks": rng.standard_normal((past, blocks, 2, width), dtype=np.float32),  # [P, L, 2, D]
            "past_tails": rng.standard_normal((2, channels, tail), dtype=np.float32),  # [2, C, tail]
        }

    new, past = Dim("T", min=1), Dim("P", min=0)
    dynamic = {name: {2: new} for name in ("x", "mu", "cond")} | {"past_blocks": {0: past}}
    parity = (feed(2 * chunk + 7, 0), feed(1, chunk), feed(longest, 3 * chunk))
    return GraphPlan(feed(chunk + 13, 2 * chunk), parity, dynamic)


def export_incremental_estimator(
    model: LoadedModel, out_dir: Path, progress: Progress | None = None
) -> tuple[ExportResult, GraphPlan] | None:
    """Export the plain incremental estimator to ``out_dir/flow_estimator_incremental.onnx``, checked
    against torch (1e-4); return the export and its plan (feeds), or None where the family has none
    (v1). OpenVINO and mixed engines convert this file to IR (``builder.openvino``)."""
    graph = build_family_of(model.config).incremental_estimator_graph(model)
    return export_incremental_graph(graph, out_dir, progress)


def export_incremental_graph(
    graph: tuple[GraphSpec, nn.Module, GraphPlan] | None, out_dir: Path, progress: Progress | None = None
) -> tuple[ExportResult, GraphPlan] | None:
    """Export ``graph`` (contract, torch module, plan; None: nothing) to
    ``out_dir/flow_estimator_incremental.onnx``, checked against torch (1e-4)."""
    if graph is None:
        return None
    spec, module, plan = graph
    result = export_graph(
        spec,
        module,
        plan.sample,
        Path(out_dir) / INCREMENTAL_FILE,
        plan.dynamic_shapes,
        parity_inputs=plan.parity,
        tolerance=_TOLERANCE,
        progress=progress,
    )
    return result, plan


def unet_incremental_graph(model: LoadedModel) -> tuple[GraphSpec, nn.Module, GraphPlan] | None:
    """(contract, torch module, export plan) of CosyVoice2's incremental U-Net estimator, or None where the
    model's flow is not the torch U-Net (``BuildFamily.incremental_estimator_graph`` of CosyVoice2)."""
    estimator = _estimator(model)
    if estimator is None:
        return None
    plan = incremental_export_plan(model.config, estimator)
    return graphs.FLOW_ESTIMATOR_INCREMENTAL, IncrementalEstimatorGraph(estimator), plan


def write_incremental_estimator(
    model: LoadedModel, out_dir: Path, precision: str, progress: Progress | None = None
) -> tuple[Path, GraphRecord] | None:
    """Export, rewrite and (int8/int4) quantise the incremental estimator of ONNX Runtime engines
    into ``out_dir``.

    Returns the graph file and its manifest record, or None where the family has none (v1).
    """
    exported = export_incremental_estimator(model, out_dir, progress)
    if exported is None:
        return None
    result, plan = exported
    out_dir, path = Path(out_dir), result.path
    _rewrite(path, [plan.sample, *plan.parity], progress)
    if precision != "fp32":
        start = time.perf_counter()
        staged = path.with_name(f".{path.stem}.int8.onnx")
        count = quantize_matmul_int8(path, staged)
        staged.replace(path)
        message = f"{path.stem}: {count} MatMul weights -> int8 in {time.perf_counter() - start:.1f} s"
        emitter(_LOGGER, progress)(message)
    return path, _record(result, out_dir)


def _write_incremental_ir(
    model: LoadedModel, out_dir: Path, manifest: Manifest, progress: Progress | None
) -> tuple[Path, GraphRecord] | None:
    """The incremental estimator of OpenVINO or mixed engines (``manifest``) as OpenVINO IR in
    ``out_dir``, stored as their builds store the flow estimators: float16 weights where it computes
    in bfloat16 in mixed engines (``builder.mixed``), float32 in OpenVINO engines (``builder.engines``)."""
    from ..runtime.backends.openvino.runner import graph_precisions
    from .openvino import convert_engine_graphs

    name = graphs.FLOW_ESTIMATOR_INCREMENTAL.name
    if not family_named(model.config.family).openvino_incremental:  # built and tested for CosyVoice2 only
        return None
    exported = export_incremental_estimator(model, out_dir, progress)
    if exported is None:
        return None
    record = _record(exported[0], out_dir)  # I/O as exported, before the .onnx is replaced
    mixed = manifest.backend == MIXED_BACKEND
    fp16 = {name} if mixed and graph_precisions(manifest.precision, (name,))[name] == "bf16" else set()
    files = convert_engine_graphs(out_dir, [name], manifest.precision, progress, fp16_weights=fp16)
    record = dataclasses.replace(record, file=files[name], backend=OV_BACKEND if mixed else None)
    return out_dir / files[name], record


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
    emitter(_LOGGER, progress)(
        f"{path.stem}: {counts.describe()} rewritten for ONNX Runtime (max relative change {worst:.1e})",
    )


def _record(result: ExportResult, root: Path) -> GraphRecord:
    return graph_record(result.path, root, result.max_errors)


def add_incremental_estimator(engines_dir: Path, model_dir: Path, progress: Progress | None = None) -> Path:
    """Add the incremental estimator to existing engines of this version (CosyVoice2: ONNX Runtime,
    OpenVINO or mixed; CosyVoice3: ONNX Runtime; built from ``model_dir``, checked by hash), as their build would write it
    (``flow_estimator_incremental.onnx``, or OpenVINO IR ``.xml``/``.bin``), and record it in the manifest."""
    from .registry import build_family_of_release

    engines_dir = Path(engines_dir)
    manifest = Manifest.read(engines_dir)
    if manifest.backend not in INCREMENTAL_BACKENDS:
        raise InputError(
            f"{engines_dir} holds {manifest.backend} engines; the incremental streaming estimator is "
            f"added to {', '.join(INCREMENTAL_BACKENDS)} engines only."
        )
    manifest.check(engines_dir, Path(model_dir))
    model = build_family_of_release(Path(model_dir)).load_for_build(Path(model_dir))
    # Written aside, then moved in: never through a hard link of engines this directory was copied from.
    with tempfile.TemporaryDirectory(prefix=".incremental-", dir=engines_dir) as scratch:
        if manifest.backend == ORT_BACKEND:
            written = write_incremental_estimator(model, Path(scratch), manifest.precision, progress)
        else:
            written = _write_incremental_ir(model, Path(scratch), manifest, progress)
        if written is None:
            raise InputError(
                f"{model_dir} has no incremental streaming estimator for {manifest.backend} engines: "
                "CosyVoice2 has one on every CPU backend, CosyVoice3 on onnxruntime, CosyVoice 1 none."
            )
        for item in Path(scratch).iterdir():  # the graph and its weights (.onnx.data or .bin)
            item.replace(engines_dir / item.name)
    record = written[1]
    files = {
        item.relative_to(engines_dir).as_posix(): item.stat().st_size
        for item in sorted(engines_dir.rglob("*"))
        if item.is_file() and item.name != MANIFEST_NAME and item.relative_to(engines_dir).parts[0] != "plans"
    }
    graphs_ = {**manifest.graphs, graphs.FLOW_ESTIMATOR_INCREMENTAL.name: record}
    with tempfile.TemporaryDirectory(prefix=".manifest-", dir=engines_dir) as scratch:
        staged = dataclasses.replace(manifest, graphs=graphs_, files=files).write(Path(scratch))
        staged.replace(engines_dir / MANIFEST_NAME)  # a new file, not a write through a hard link
    return engines_dir / record.file
