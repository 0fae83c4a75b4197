"""What ``trt-cosy build`` does differently per model family (CosyVoice 1, 2, 3).

``build.engines`` runs the same steps for every release; the family-specific parts are here:

* ``load_model_for_build``: the torch reference model; for CosyVoice3 with the fixed HiFT noise cut
  to the longest synthesis the engines allow (``hift_noise_seconds``).
* ``export_family``: the graph set of the family (``graphs.GRAPHS``, ``graphs_v1.V1_GRAPHS``,
  ``graphs_v3.GRAPHS_V3``), each exported and checked against torch on ONNX Runtime.
* ``write_model_data``: the LLM lookup tables, the fixed CFM noise (v2/v3), the fixed HiFT noise
  (v3) and the preset speakers of ``spk2info.pt`` (v1 -SFT/-Instruct).
* ``copy_v1_tokenizer`` / ``frontend_files``: the text tokenizer and frontend models to carry.

CosyVoice 1 has no fixed CFM noise (fresh noise per call), so it writes no ``flow_noise.npy``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Final

import numpy as np

from ..config import ModelConfig, release_family
from ..config_v1 import V1ModelConfig
from ..config_v3 import V3ModelConfig
from ..errors import InputError
from ..frontend.tokenizer_v1 import V1_TOKENIZER_FILE
from ..runtime import graphs_v1
from ..runtime.engines import FLOW_NOISE_NAME, HIFT_NOISE_NAME, SPEAKERS_NAME, TABLE_NAMES
from ..runtime.model import LoadedModel
from ..runtime.profiles import ProfileLimits
from .export import ExportResult, GraphPlan, Progress, export_graph, export_model, graph_export_plan
from .export_v3 import export_model_v3, v3_graph_export_plan
from .reference import load_torch_model
from .reference_v1 import export_plans_v1
from .spk2info import SPK2INFO_FILE, read_spk2info, write_speakers

__all__ = [
    "FRONTEND_FILES",
    "check_family_options",
    "hift_noise_seconds",
    "load_model_for_build",
    "export_family",
    "export_plan",
    "write_model_data",
    "copy_v1_tokenizer",
    "frontend_files",
]

_LOGGER = logging.getLogger(__name__)

# campplus is shared; the speech tokenizer is per family (50 Hz v1, 25 Hz v2 and v3).
FRONTEND_FILES: Final = {
    "v1": ("campplus.onnx", "speech_tokenizer_v1.onnx"),
    "v2": ("campplus.onnx", "speech_tokenizer_v2.onnx"),
    "v3": ("campplus.onnx", "speech_tokenizer_v3.onnx"),
}
# ORT-vs-torch export tolerance of the v1 graphs (scaled max error, as export.TOLERANCES).
_V1_TOLERANCES: Final = {graphs_v1.V1_HIFT.name: 1e-3}
_V1_DEFAULT_TOLERANCE: Final = 1e-4


def check_family_options(model_dir: Path, backend: str, precision: str) -> str:
    """The release's family; ``InputError`` when this backend/precision cannot be built for it.

    Which families each path knows is data kept next to the code that does the work:
    ``quantize.QUANTIZABLE_FAMILIES`` (int8/int4 graphs) and ``tensorrt.TRT_FAMILIES`` (fp16 graphs
    and plans).
    """
    from .quantize import QUANTIZABLE_FAMILIES
    from .tensorrt import TRT_FAMILIES

    family = release_family(model_dir)
    if backend == "openvino":  # every family: the plain exports converted (build.openvino)
        return family
    if backend == "tensorrt":
        supported = TRT_FAMILIES
    elif precision != "fp32":
        supported = QUANTIZABLE_FAMILIES
    else:
        return family
    if family not in supported:
        raise InputError(
            f"{backend}/{precision} engines are not available for this model family ({family}) in this "
            f"version; build {model_dir} with --backend onnxruntime --precision fp32."
        )
    return family


def hift_noise_seconds(config: V3ModelConfig, limits: ProfileLimits | None = None) -> float:
    """Seconds of the v3 HiFT noise buffer the engines keep: the longest synthesis the limits allow.

    One segment's flow runs on at most ``limits.max_tokens`` speech tokens (prompt included; 1500
    tokens = 3000 mel frames = 60 s, the official TensorRT maximum), and the vocoder renders at most
    that much mel, so 60 s of the official 300 s buffer (52 MB instead of 259 MB) cover every call.
    """
    limits = limits or ProfileLimits()
    frames = limits.max_tokens * config.token_mel_ratio
    return frames * config.hift.samples_per_frame / config.hift.sampling_rate


def load_model_for_build(model_dir: Path) -> LoadedModel:
    """The torch reference model of any family (v3: HiFT noise cut to ``hift_noise_seconds``)."""
    family = release_family(model_dir)
    if family != "v3":
        return load_torch_model(model_dir)
    from ..config import ModelConfig

    config = ModelConfig.from_release_dir(model_dir)
    return load_torch_model(model_dir, hift_noise_seconds=hift_noise_seconds(config))


def export_plan(config: ModelConfig | V1ModelConfig, name: str) -> GraphPlan:
    """The export plan (sample and parity feeds) of graph ``name`` of ``config``'s family."""
    if config.family == "v3":
        return v3_graph_export_plan(name, config)
    if config.family == "v1":
        return export_plans_v1(config)[name]
    return graph_export_plan(name, config)


def export_family(
    model: LoadedModel, out_dir: Path, progress: Progress | None = None
) -> dict[str, ExportResult]:
    """Export every graph of the model's family to ``out_dir/<graph>.onnx`` with the parity checks."""
    family = model.config.family
    if family == "v3":
        return export_model_v3(model, out_dir, progress=progress)
    if family == "v1":
        return _export_v1(model, Path(out_dir), progress)
    return export_model(model, out_dir, progress=progress)


def _export_v1(model: LoadedModel, out_dir: Path, progress: Progress | None) -> dict[str, ExportResult]:
    plans = export_plans_v1(model.config)
    results = {}
    for name, spec in graphs_v1.V1_GRAPHS.items():
        plan = plans[name]
        results[name] = export_graph(
            spec,
            model.runners[name].module,  # a TorchRunner's module
            plan.sample,
            out_dir / f"{name}.onnx",
            plan.dynamic_shapes,
            parity_inputs=plan.parity,
            tolerance=_V1_TOLERANCES.get(name, _V1_DEFAULT_TOLERANCE),
            progress=progress,
        )
    return results


def write_model_data(model: LoadedModel, model_dir: Path, staging: Path) -> None:
    """The host-side data of the engines: LLM tables, fixed noise (v2/v3), preset speakers (v1)."""
    for name in TABLE_NAMES:
        table = np.ascontiguousarray(model.llm_tables[name], dtype=np.float32)  # [rows, D]
        np.save(staging / f"{name}.npy", table)
    config = model.config
    if config.family != "v1":
        np.save(staging / FLOW_NOISE_NAME, np.ascontiguousarray(model.flow_noise, dtype=np.float32))
    if config.family == "v3":
        np.save(staging / HIFT_NOISE_NAME, np.ascontiguousarray(model.hift_noise, dtype=np.float32))
    if isinstance(config, V1ModelConfig) and (Path(model_dir) / SPK2INFO_FILE).is_file():
        speakers = read_spk2info(Path(model_dir) / SPK2INFO_FILE, config.llm.spk_embed_dim)
        write_speakers(speakers, staging / SPEAKERS_NAME)
        _LOGGER.info("preset speakers: %s", ", ".join(speakers))


def copy_v1_tokenizer(model_dir: Path, tokenizer_dir: Path) -> None:
    """Copy whisper's ``multilingual.tiktoken`` (put next to ``cosyvoice.yaml``) into ``tokenizer_dir``."""
    source = Path(model_dir) / V1_TOKENIZER_FILE
    if not source.is_file():
        _LOGGER.warning(
            "%s has no %s (openai-whisper's whisper/assets/%s): the engines carry no text tokenizer; "
            "copy it next to cosyvoice.yaml and rebuild before synthesising",
            model_dir,
            V1_TOKENIZER_FILE,
            V1_TOKENIZER_FILE,
        )
        return
    tokenizer_dir.mkdir(exist_ok=True)
    shutil.copy2(source, tokenizer_dir / V1_TOKENIZER_FILE)


def frontend_files(family: str) -> tuple[str, ...]:
    """The release's frontend models the engines carry (speaker model, speech tokenizer)."""
    return FRONTEND_FILES[family]
