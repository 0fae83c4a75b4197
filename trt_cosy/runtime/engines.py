"""Load an engines directory written by ``trt-cosy build`` onto ONNX Runtime (torch-free)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Final

import numpy as np

from ..errors import EngineMismatchError
from . import graphs
from .manifest import Manifest, model_config_from_dict
from .model import LoadedModel
from .ort import OrtRunner

__all__ = [
    "load_engines",
    "ORT_BACKEND",
    "TABLE_NAMES",
    "MODEL_CONFIG_NAME",
    "FLOW_NOISE_NAME",
    "TOKENIZER_DIR",
]

_LOGGER = logging.getLogger(__name__)

ORT_BACKEND: Final = "onnxruntime"
# File names inside an engines directory, shared with the builder (trt_cosy/build/engines.py).
TABLE_NAMES: Final = ("text_embedding", "speech_embedding", "llm_embedding")  # <name>.npy
MODEL_CONFIG_NAME: Final = "model_config.json"
FLOW_NOISE_NAME: Final = "flow_noise.npy"
TOKENIZER_DIR: Final = "tokenizer"


def load_engines(engines_dir: Path, threads: int | None = None, model_dir: Path | None = None) -> LoadedModel:
    """Load the ONNX graphs, LLM tables, flow noise and config of an engines directory.

    The manifest is checked first (trt-cosy version, backend, every file present with its size;
    with ``model_dir``, also the checkpoint hashes): stale or incomplete engines raise
    ``EngineMismatchError`` naming the ``trt-cosy build`` command to run. ``threads`` is the
    intra-op thread count of every session (default: physical cores). The embedding tables are
    memory-mapped read-only.
    """
    engines_dir = Path(engines_dir)
    manifest = Manifest.read(engines_dir)
    manifest.check(engines_dir, model_dir, backend=ORT_BACKEND)
    config = model_config_from_dict(_read_json(engines_dir / MODEL_CONFIG_NAME))
    runners = {}
    for name in graphs.GRAPHS:
        record = manifest.graphs.get(name)
        if record is None:
            raise EngineMismatchError(
                f"{engines_dir} has no '{name}' graph. Rebuild it: run `trt-cosy build --model-dir DIR "
                f"--out {engines_dir}`."
            )
        runners[name] = OrtRunner.from_path(engines_dir / record.file, name, threads, exported=True)
    tables = {name: np.load(engines_dir / f"{name}.npy", mmap_mode="r") for name in TABLE_NAMES}
    flow_noise = np.load(engines_dir / FLOW_NOISE_NAME)  # [1, 80, 15000]
    _LOGGER.debug("loaded %s engines from %s (built %s)", manifest.backend, engines_dir, manifest.created)
    return LoadedModel(
        config=config, backend=ORT_BACKEND, runners=runners, llm_tables=tables, flow_noise=flow_noise
    )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EngineMismatchError(
            f"{path} is unreadable ({exc}). Rebuild the engines: run `trt-cosy build --model-dir DIR "
            f"--out {path.parent}`."
        ) from exc
