"""``trt-cosy make-test-model``: a random-weight release directory in the official layout.

For every family the directory has what an official release has for inference, so every later
stage can be tested end to end without downloading weights:

* ``v2`` (CosyVoice2-0.5B): ``cosyvoice2.yaml``, ``llm.pt``, ``flow.pt``, ``hift.pt``,
  ``CosyVoice-BlankEN/`` (Qwen2 config and a small real BPE tokenizer with the CosyVoice special
  tokens), stand-in ``campplus.onnx`` / ``speech_tokenizer_v2.onnx``.
* ``v1`` (CosyVoice-300M-SFT layout): ``cosyvoice.yaml``, the three checkpoints, ``spk2info.pt`` with
  preset speakers, a small ``multilingual.tiktoken`` (whisper's ranks format), stand-in
  ``campplus.onnx`` / ``speech_tokenizer_v1.onnx`` (50 Hz, 4096 codes).
* ``v3`` (Fun-CosyVoice3-0.5B): ``cosyvoice3.yaml``, the three checkpoints, ``CosyVoice-BlankEN/``,
  stand-in ``campplus.onnx`` / ``speech_tokenizer_v3.onnx``.

Weight norm is stored in the ``parametrizations`` key form the releases use. ``size="full"`` has the
released dimensions (for benchmarks; v2 ≈ 640 M parameters, 2.6 GB on disk). The weights are
random: the audio is noise-like, never speech.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path
from typing import Final

from ...errors import InputError
from ..registry import BUILD_FAMILY_NAMES, build_family_named

__all__ = ["make_test_model", "SIZES", "FAMILIES"]

_LOGGER = logging.getLogger(__name__)

SIZES: Final = ("tiny", "full")
FAMILIES: Final = BUILD_FAMILY_NAMES  # "v1", "v2", "v3"


def make_test_model(
    out: Path, size: str = "tiny", seed: int = 0, overwrite: bool = False, family: str = "v2"
) -> Path:
    """Write a random-weight release directory of ``family`` to ``out`` (atomically) and return it."""
    if size not in SIZES:
        raise InputError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}.")
    if family not in FAMILIES:
        raise InputError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}.")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InputError(f"{out} exists and is not empty; choose another --out or pass --overwrite.")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".make-test-model-", dir=out.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a model directory is not
        build_family_named(family).write_test_release(staging, size, seed)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _LOGGER.info("wrote %s %s test model to %s", size, family, out)
    return out
