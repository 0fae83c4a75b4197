"""A random-weight CosyVoice2 release directory (``trt-cosy make-test-model --family v2``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ....builder.modules.flow import CosyVoice2Flow
from ....builder.modules.hift import HiFTGenerator
from ....builder.modules.llm import CosyVoice2LM
from ....builder.testmodel.parts import write_checkpoints, write_qwen_dir
from ....builder.testmodel.standin_onnx import write_standin_campplus, write_standin_speech_tokenizer
from ..config import v2_config_from_release_dir
from .yaml_template import FULL_SIZES, TINY_SIZES, render_cosyvoice2_yaml

__all__ = ["write_release_v2"]


def write_release_v2(root: Path, size: str, seed: int) -> None:
    sizes = TINY_SIZES if size == "tiny" else FULL_SIZES
    (root / "cosyvoice2.yaml").write_text(render_cosyvoice2_yaml(sizes, size), encoding="utf-8")
    write_qwen_dir(root, size)
    config = v2_config_from_release_dir(root)

    write_checkpoints(root, seed, config, CosyVoice2LM, CosyVoice2Flow, HiFTGenerator, tied_llm=True)
    rng = np.random.default_rng(seed)
    write_standin_campplus(root / "campplus.onnx", rng)
    write_standin_speech_tokenizer(root / "speech_tokenizer_v2.onnx", rng)
