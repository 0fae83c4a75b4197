"""Preset speakers of CosyVoice-300M-SFT / -Instruct: ``spk2info.pt`` -> a numpy ``.npz``.

The official frontend reads ``torch.load(spk2info.pt, weights_only=True)[name]['embedding']``
(float32 [1, 192]) and uses it as both the LLM and the flow speaker embedding (spec §2.9). Build
time converts it once; the runtime reads the npz (``trt_cosy.models.v1.stages.load_speakers``) without torch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

import numpy as np
import torch

from ..errors import ModelDirError

__all__ = ["SPK2INFO_FILE", "read_spk2info", "write_speakers"]

_LOGGER = logging.getLogger(__name__)

SPK2INFO_FILE: Final = "spk2info.pt"


def read_spk2info(path: Path, embed_dim: int = 192) -> dict[str, np.ndarray]:
    """Speaker name -> embedding float32 [embed_dim], in file order. Other keys are ignored."""
    path = Path(path)
    if not path.is_file():
        raise ModelDirError(f"{path} is missing; only the -SFT and -Instruct releases ship preset speakers.")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for a corrupt zip/pickle
        raise ModelDirError(f"{path} is not a readable spk2info file ({type(exc).__name__}: {exc}).") from exc
    if not isinstance(raw, dict):
        raise ModelDirError(f"{path} should hold a dict of speakers, found {type(raw).__name__}.")
    speakers: dict[str, np.ndarray] = {}
    for name, info in raw.items():
        embedding = info.get("embedding") if isinstance(info, dict) else None
        if not isinstance(embedding, torch.Tensor) or embedding.numel() != embed_dim:
            raise ModelDirError(
                f"{path}: speaker {name!r} has no {embed_dim}-value 'embedding'; re-download the release."
            )
        speakers[str(name)] = embedding.detach().float().reshape(embed_dim).numpy().copy()
    return speakers


def write_speakers(speakers: dict[str, np.ndarray], path: Path) -> Path:
    """Save ``{name: [192]}`` as ``names`` (unicode [S]) + ``embeddings`` (float32 [S, 192])."""
    path = Path(path)
    names = np.array(list(speakers), dtype=np.str_)  # [S]
    embeddings = (
        np.stack(list(speakers.values())).astype(np.float32) if speakers else np.zeros((0, 192), np.float32)
    )
    np.savez(path, names=names, embeddings=embeddings)
    _LOGGER.debug("wrote %d preset speakers to %s", len(speakers), path)
    return path
