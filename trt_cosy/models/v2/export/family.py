"""The CosyVoice2 build steps: the generic exporter (``builder.export``) on ``graphs.GRAPHS``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ....builder.build_family import BuildFamily
from ....builder.export import ExportResult, GraphPlan, Progress, export_model, graph_export_plan
from ....builder.flow_incremental import unet_incremental_graph
from ....builder.quantize.policies import GRAPH_POLICIES
from ....family_lookup import FAMILIES
from ....runtime.model import LoadedModel
from .reference import load_torch_model_v2
from .testmodel import write_release_v2

__all__ = ["V2BuildFamily"]


class V2BuildFamily(BuildFamily):
    family = FAMILIES["v2"]
    precision_policies = GRAPH_POLICIES

    def load_torch_model(
        self, model_dir: Path, threads: int | None = None, *, hift_noise_seconds: float | None = None
    ) -> LoadedModel:
        return load_torch_model_v2(model_dir, threads=threads)

    def export_plan(self, config: Any, name: str) -> GraphPlan:
        return graph_export_plan(name, config)

    def export(self, model: LoadedModel, out_dir: Path, progress: Progress | None = None) -> dict[str, ExportResult]:
        return export_model(model, out_dir, progress=progress)

    def incremental_estimator_graph(self, model: LoadedModel) -> tuple[Any, Any, GraphPlan] | None:
        return unet_incremental_graph(model)

    def write_test_release(self, root: Path, size: str, seed: int) -> None:
        write_release_v2(root, size, seed)
