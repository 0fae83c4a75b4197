"""What ``trt-cosy build`` does differently per model family (CosyVoice 1, 2, 3).

``builder.engines`` runs the same steps for every release; these calls hand the family-specific parts
to the release's ``BuildFamily`` (``builder/models/<name>/family.py``) and ``Family``:

* ``load_model_for_build``: the torch reference model; for CosyVoice3 with the fixed HiFT noise cut
  to the longest synthesis the engines allow (``models/v3/export/family.hift_noise_seconds``).
* ``export_family``: the graph set of the family (``Family.graphs``), each exported and checked
  against torch on ONNX Runtime.
* ``write_model_data``: the LLM lookup tables, the fixed CFM noise (v2/v3), the fixed HiFT noise
  (v3) and the preset speakers of ``spk2info.pt`` (v1 -SFT/-Instruct).
* ``frontend_files``: the frontend models to carry (the text tokenizer: ``BuildFamily.copy_text_tokenizer``).

CosyVoice 1 has no fixed CFM noise (fresh noise per call), so it writes no ``flow_noise.npy``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Final

import numpy as np

from ..errors import InputError
from ..family_lookup import FAMILIES, family_named, family_of_release
from ..runtime.engines import FLOW_NOISE_NAME, HIFT_NOISE_NAME, TABLE_NAMES
from ..runtime.model import LoadedModel
from .export import ExportResult, GraphPlan, Progress
from .registry import build_family_of, build_family_of_release

__all__ = [
    "FRONTEND_FILES",
    "check_family_options",
    "load_model_for_build",
    "export_family",
    "export_plan",
    "write_model_data",
    "frontend_files",
]

_LOGGER = logging.getLogger(__name__)

# campplus is shared; the speech tokenizer is per family (50 Hz v1, 25 Hz v2 and v3): ``Family.frontend_files``.
FRONTEND_FILES: Final = {known.name: known.frontend_files for known in FAMILIES.values()}


def check_family_options(model_dir: Path, backend: str, precision: str) -> str:
    """The release's family; ``InputError`` when this backend/precision cannot be built for it.

    The family says which paths it has: ``Family.trt_engines`` (fp16 graphs and plans) and
    ``Family.quantized_graphs`` (int8/int4 graphs).
    """
    known = family_of_release(model_dir)
    family = known.name
    if backend == "openvino":  # every family: the plain exports converted (builder.openvino)
        return family
    if backend == "tensorrt":
        supported = known.trt_engines
    elif precision != "fp32":
        supported = bool(known.quantized_graphs)
    else:
        return family
    if not supported:
        raise InputError(
            f"{backend}/{precision} engines are not available for this model family ({family}) in this "
            f"version; build {model_dir} with --backend onnxruntime --precision fp32."
        )
    return family


def load_model_for_build(model_dir: Path) -> LoadedModel:
    """The torch reference model of any family (v3: HiFT noise cut to ``hift_noise_seconds``)."""
    return build_family_of_release(model_dir).load_for_build(model_dir)


def export_plan(config: Any, name: str) -> GraphPlan:
    """The export plan (sample and parity feeds) of graph ``name`` of ``config``'s family."""
    return build_family_of(config).export_plan(config, name)


def export_family(
    model: LoadedModel, out_dir: Path, progress: Progress | None = None
) -> dict[str, ExportResult]:
    """Export every graph of the model's family to ``out_dir/<graph>.onnx`` with the parity checks."""
    return build_family_of(model.config).export(model, Path(out_dir), progress)


def write_model_data(model: LoadedModel, model_dir: Path, staging: Path) -> None:
    """The host-side data of the engines: LLM tables, fixed noise (v2/v3), preset speakers (v1)."""
    for name in TABLE_NAMES:
        table = np.ascontiguousarray(model.llm_tables[name], dtype=np.float32)  # [rows, D]
        np.save(staging / f"{name}.npy", table)
    family = family_named(model.config.family)
    if family.fixed_flow_noise:
        np.save(staging / FLOW_NOISE_NAME, np.ascontiguousarray(model.flow_noise, dtype=np.float32))
    if family.fixed_hift_noise:
        np.save(staging / HIFT_NOISE_NAME, np.ascontiguousarray(model.hift_noise, dtype=np.float32))
    build_family_of(model.config).write_extra_data(model, Path(model_dir), staging)


def frontend_files(family: str) -> tuple[str, ...]:
    """The release's frontend models the engines carry (speaker model, speech tokenizer)."""
    return family_named(family).frontend_files
