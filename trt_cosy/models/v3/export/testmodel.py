"""The ``make-test-model`` writer of a Fun-CosyVoice3 release directory.

Checkpoint key sets and shapes are those of the official ``state_dict()`` (checked against the
golden tiny checkpoints in tests/test_make_test_model.py); the modules are built from the config
the written yaml gives, so yaml and weights always agree.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ....builder.testmodel.parts import write_checkpoints, write_qwen_dir
from ....builder.testmodel.standin_onnx import write_standin_campplus, write_standin_speech_tokenizer
from ..config import v3_config_from_release_dir
from .causal_hift import CausalHiFTGenerator
from .flow import CosyVoice3Flow
from .llm import CosyVoice3LM
from .yaml_template import V3_FULL_SIZES, V3_TINY_SIZES, render_cosyvoice3_yaml

__all__ = ["write_release_v3"]


def write_release_v3(root: Path, size: str, seed: int) -> None:
    """A Fun-CosyVoice3-0.5B-style directory in ``root``."""
    sizes = V3_TINY_SIZES if size == "tiny" else V3_FULL_SIZES
    (root / "cosyvoice3.yaml").write_text(render_cosyvoice3_yaml(sizes, size), encoding="utf-8")
    write_qwen_dir(root, size, family="v3")
    config = v3_config_from_release_dir(root)
    write_checkpoints(root, seed, config, CosyVoice3LM, CosyVoice3Flow, CausalHiFTGenerator, tied_llm=True)
    rng = np.random.default_rng(seed)
    write_standin_campplus(root / "campplus.onnx", rng)
    write_standin_speech_tokenizer(
        root / "speech_tokenizer_v3.onnx", rng, graph_name="speech_tokenizer_v3_standin"
    )
