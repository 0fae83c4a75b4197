"""The ``make-test-model`` writer of a CosyVoice 1 release directory (300M-SFT layout).

Checkpoint key sets and shapes are those of the official ``state_dict()`` (checked against the
golden tiny checkpoints in tests/test_make_test_model.py); the modules come from
``builder/models/v1`` built from the config the written yaml gives, so yaml and weights always agree.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

import numpy as np
import torch

from ....builder.testmodel.parts import write_checkpoints
from ....builder.testmodel.standin_onnx import (
    write_standin_campplus,
    write_standin_speech_tokenizer_v1,
)
from ..config import v1_config_from_release_dir
from ..tokenizer import V1_TOKENIZER_FILE, whisper_specials
from .flow import MaskedDiffWithXvecV1
from .hift import build_hift_v1
from .llm import TransformerLMV1
from .tiktoken_writer import write_test_ranks
from .yaml_template import V1_FULL_SIZES, V1_TINY_SIZES, render_cosyvoice_yaml

__all__ = ["write_release_v1", "PRESET_SPEAKERS"]

_LOGGER = logging.getLogger(__name__)

# Built-in speaker names of the CosyVoice-300M-SFT release (docs/cosyvoice-spec §1.1).
PRESET_SPEAKERS: Final = ("中文女", "中文男", "日语男", "粤语女", "英文女", "英文男", "韩语女")
_SPK2INFO_FILE: Final = "spk2info.pt"
_SPEAKER_DIM: Final = 192


def write_release_v1(root: Path, size: str, seed: int) -> None:
    """A CosyVoice-300M-SFT-style directory (preset speakers included) in ``root``."""
    sizes = V1_TINY_SIZES if size == "tiny" else V1_FULL_SIZES
    (root / "cosyvoice.yaml").write_text(render_cosyvoice_yaml(sizes, size), encoding="utf-8")
    config = v1_config_from_release_dir(root)
    write_checkpoints(
        root, seed, config, TransformerLMV1, MaskedDiffWithXvecV1, build_hift_v1, tied_llm=False
    )
    _write_spk2info(root / _SPK2INFO_FILE, seed)
    # The tokenizer's ids must fit the text embedding: the ranks, then whisper's specials.
    write_test_ranks(root / V1_TOKENIZER_FILE, config.llm.text_token_size - len(whisper_specials()))
    rng = np.random.default_rng(seed)
    write_standin_campplus(root / "campplus.onnx", rng)
    write_standin_speech_tokenizer_v1(root / "speech_tokenizer_v1.onnx", rng)


def _write_spk2info(path: Path, seed: int) -> None:
    """The official format: ``torch.save({name: {'embedding': float32 [1, 192]}})``."""
    generator = torch.Generator().manual_seed(seed + 4)
    speakers = {
        name: {"embedding": torch.randn(1, _SPEAKER_DIM, generator=generator)} for name in PRESET_SPEAKERS
    }
    torch.save(speakers, path)
