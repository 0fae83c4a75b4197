"""Export of the incremental streaming estimator (contract ``graphs.FLOW_ESTIMATOR_INCREMENTAL``) for
TensorRT engines of CosyVoice2: the plain export, without ONNX Runtime's rewrites or int8 MatMuls.

``trt-cosy build --backend tensorrt`` writes ``flow_estimator_incremental.onnx`` beside the other
exports (checked against torch like every graph); ``builder.trt.plans.prepare_trt_graphs`` then gives it
the estimators' treatment: ``flow_estimator_incremental.fp16.onnx`` with the same fp32 islands
(``precision_policies``), its fp16-vs-fp32 error in ``tensorrt.json`` and its profiles over the new
frames T and the cached frames P (``runtime.incremental_profiles``). The runtime's
``FlowStage`` drives the plan through the same ``FlowCache`` as on ONNX Runtime.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

from ...runtime import graphs
from ...runtime.model import LoadedModel
from ..export import ExportResult, Progress
from ..flow_incremental import export_incremental_graph, unet_incremental_graph

__all__ = ["INCREMENTAL_NAME", "export_trt_incremental"]

_LOGGER = logging.getLogger(__name__)

INCREMENTAL_NAME: Final = graphs.FLOW_ESTIMATOR_INCREMENTAL.name


def export_trt_incremental(
    model: LoadedModel, out_dir: Path, progress: Progress | None = None
) -> ExportResult | None:
    """Export ``<out_dir>/flow_estimator_incremental.onnx`` (plain ONNX, fp32) from the reference
    model's CosyVoice2 estimator; None for the other families (their streaming recomputes)."""
    exported = export_incremental_graph(unet_incremental_graph(model), Path(out_dir), progress)
    return None if exported is None else exported[0]
