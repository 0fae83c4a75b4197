"""The engines folder of a tuned build: each stage's graphs from the candidate chosen for it.

``compose_tuned_engines`` links (or copies) into a staging folder the graph files of each stage's chosen
candidate (``builder.tuning``), with their weights beside them (``x.onnx.data``, IR ``x.bin``), and the
files every candidate shares (tables, noise, tokenizer, frontend models, config) from the LLM's
candidate; the manifest names each graph's backend (``"mixed"`` when they differ; the loader runs each
graph on its own, ``runtime.engines``), the precision OpenVINO graphs compute in, the n-bit block sizes
and OpenVINO compile checks of the chosen graphs, and the tuning record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..runtime.manifest import MANIFEST_NAME, Manifest
from ..runtime.tuning_record import TuningRecord, stage_of_graph
from .derived import link_or_copy

__all__ = ["compose_tuned_engines"]


def compose_tuned_engines(record: TuningRecord, dirs: Mapping[tuple[str, str], Path], staging: Path) -> None:
    """Write the chosen graphs of each stage and the shared files into ``staging``, with the manifest."""
    from ..runtime.backends.openvino.runner import graph_precisions

    chosen = {stage: (choice.backend, choice.precision) for stage, choice in record.stages.items()}
    base_key = chosen["llm"]
    manifests = {key: Manifest.read(dirs[key]) for key in set(chosen.values())}
    base = manifests[base_key]
    graphs = {}
    owner: dict[str, tuple[str, str]] = {}  # file -> the candidate it comes from
    backends = set()
    for key, manifest in manifests.items():
        for name, graph in manifest.graphs.items():
            if chosen[stage_of_graph(name)] != key:
                continue
            graph_backend = manifest.graph_backend(name)
            backends.add(graph_backend)
            compute = graph.compute
            if graph_backend == "openvino" and compute is None:
                compute = graph_precisions(manifest.precision, (name,))[name]
            graphs[name] = dataclasses.replace(graph, backend=graph_backend, compute=compute)
            for file in _graph_files(graph.file, manifest.files):
                owner[file] = key
    for file in base.files:  # shared files (tables, noise, tokenizer, frontend models, config)
        if file not in owner and not _is_graph_file(file, base):
            owner[file] = base_key
    for file, key in sorted(owner.items()):
        target = staging / file
        target.parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(str(dirs[key] / file), str(target))
    mixed = len(backends) > 1
    if not mixed:
        graphs = {name: dataclasses.replace(graph, backend=None) for name, graph in graphs.items()}
    nbits = {}
    for key, manifest in manifests.items():
        for name, block in (manifest.nbits_blocks or {}).items():
            if name in graphs and chosen[stage_of_graph(name)] == key:
                nbits[name] = block
    manifest = Manifest(
        trt_cosy_version=base.trt_cosy_version,
        backend="mixed" if mixed else next(iter(backends)),
        precision=base_key[1],
        opset=base.opset,
        checkpoint=dict(base.checkpoint),
        graphs=graphs,
        files={
            path.relative_to(staging).as_posix(): path.stat().st_size
            for path in sorted(staging.rglob("*"))
            if path.is_file() and path.name != MANIFEST_NAME
        },
        backend_reason=f"tuned on this CPU ({record.summary()}; the manifest's 'tuning' says why)",
        nbits_blocks=nbits or None,
        compile_check=_merged_compile_check(manifests, chosen, graphs),
        tuning=record,
    )
    manifest.write(staging)


def _graph_files(file: str, files: Mapping[str, int]) -> list[str]:
    """A graph's file and its weights beside it (``x.onnx.data``; ``x.bin`` for IR ``x.xml``)."""
    stem = Path(file).name.split(".", 1)[0]
    folder = Path(file).parent
    return [
        name for name in files if Path(name).parent == folder and Path(name).name.split(".", 1)[0] == stem
    ]


def _is_graph_file(file: str, manifest: Manifest) -> bool:
    return any(file in _graph_files(graph.file, manifest.files) for graph in manifest.graphs.values())


def _merged_compile_check(
    manifests: Mapping[tuple[str, str], Manifest],
    chosen: Mapping[str, tuple[str, str]],
    graphs: Mapping[str, Any],
) -> dict[str, Any] | None:
    """The OpenVINO candidates' compile checks of the chosen graphs (one machine, one version)."""
    merged: dict[str, Any] | None = None
    for key, manifest in manifests.items():
        check = manifest.compile_check
        if not check:
            continue
        kept = {
            name: compute
            for name, compute in dict(check.get("graphs", {})).items()
            if name in graphs and chosen[stage_of_graph(name)] == key
        }
        if not kept:
            continue
        if merged is None:
            merged = {**check, "graphs": kept}
            continue
        if (merged.get("machine"), merged.get("backend_version")) != (
            check.get("machine"),
            check.get("backend_version"),
        ):
            return None  # checked apart: the loader checks each graph again
        threads = set(_as_list(merged.get("threads"))) & set(_as_list(check.get("threads")))
        merged = {**merged, "threads": sorted(threads), "graphs": {**merged["graphs"], **kept}}
    return merged


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]
