"""The Fun-CosyVoice3 build steps: its torch modules, export plans and test-model writer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from ....builder.build_family import BuildFamily
from ....builder.export import ExportResult, GraphPlan, Progress
from ....builder.quantize.policies import DATA_MAX, LOGITS, NORMS, STFT, PrecisionPolicy
from ....family_lookup import FAMILIES
from ....runtime.model import LoadedModel
from ....runtime.profiles import ProfileLimits
from ..config import V3ModelConfig
from ..graphs import FLOW_ESTIMATOR, FLOW_ESTIMATOR_INCREMENTAL_V3
from .dit_incremental import V3IncrementalEstimatorGraph, v3_incremental_export_plan
from .export import export_model_v3, v3_graph_export_plan
from .reference import load_torch_model_v3
from .testmodel import write_release_v3

__all__ = ["V3BuildFamily", "hift_noise_seconds"]


def hift_noise_seconds(config: V3ModelConfig, limits: ProfileLimits | None = None) -> float:
    """Seconds of the v3 HiFT noise buffer the engines keep: the longest synthesis the limits allow.

    One segment's flow runs on at most ``limits.max_tokens`` speech tokens (prompt included; 1500
    tokens = 3000 mel frames = 60 s, the official TensorRT maximum), and the vocoder renders at most
    that much mel, so 60 s of the official 300 s buffer (52 MB instead of 259 MB) cover every call.
    """
    limits = limits or ProfileLimits()
    frames = limits.max_tokens * config.token_mel_ratio
    return frames * config.hift.samples_per_frame / config.hift.sampling_rate


_DIT: Final = PrecisionPolicy(modules=NORMS, own_nodes=frozenset({"DiTBlock", "DiT"}), data_max=DATA_MAX)
_CAUSAL_HIFT: Final = PrecisionPolicy(
    modules=NORMS | STFT | {"CausalF0Predictor", "CausalSourceModule"}, data_max=DATA_MAX
)


class V3BuildFamily(BuildFamily):
    family = FAMILIES["v3"]
    precision_policies = {
        "llm": PrecisionPolicy(modules=NORMS | {"RotaryEmbedding"}, scopes=LOGITS, data_max=DATA_MAX),
        "llm_decode": PrecisionPolicy(modules=NORMS, scopes=LOGITS, data_max=DATA_MAX),
        "flow_encoder": PrecisionPolicy(modules=NORMS, data_max=DATA_MAX),
        "flow_estimator": _DIT,
        "flow_estimator_stream": _DIT,
        "hift": _CAUSAL_HIFT,
        "hift_stream": _CAUSAL_HIFT,
    }

    def load_torch_model(
        self, model_dir: Path, threads: int | None = None, *, hift_noise_seconds: float | None = None
    ) -> LoadedModel:
        return load_torch_model_v3(model_dir, threads=threads, hift_noise_seconds=hift_noise_seconds)

    def load_for_build(self, model_dir: Path) -> LoadedModel:
        """The fixed HiFT noise cut to the longest synthesis the engines allow (``hift_noise_seconds``)."""
        config = self.family.read_config(model_dir)
        return self.load_torch_model(model_dir, hift_noise_seconds=hift_noise_seconds(config))

    def export_plan(self, config: Any, name: str) -> GraphPlan:
        return v3_graph_export_plan(name, config)

    def export(self, model: LoadedModel, out_dir: Path, progress: Progress | None = None) -> dict[str, ExportResult]:
        return export_model_v3(model, out_dir, progress=progress)

    def incremental_estimator_graph(self, model: LoadedModel) -> tuple[Any, Any, GraphPlan] | None:
        """The DiT's incremental graph (``dit_incremental``), or None where the flow is not the torch DiT."""
        runner = model.runners.get(FLOW_ESTIMATOR.name)
        dit = getattr(getattr(runner, "module", None), "estimator", None)  # EstimatorGraph(flow).estimator
        if dit is None:
            return None
        graph = V3IncrementalEstimatorGraph(dit)
        return FLOW_ESTIMATOR_INCREMENTAL_V3, graph, v3_incremental_export_plan(model.config)

    def write_test_release(self, root: Path, size: str, seed: int) -> None:
        write_release_v3(root, size, seed)
