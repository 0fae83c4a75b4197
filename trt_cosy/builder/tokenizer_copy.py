"""The text tokenizer files ``trt-cosy build`` copies into the engines (``BuildFamily.copy_text_tokenizer``)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Final

from ..config import QWEN_DIR

__all__ = ["copy_qwen_tokenizer"]

_LOGGER = logging.getLogger(__name__)

_TOKENIZER_FILES: Final = ("vocab.json", "merges.txt", "tokenizer_config.json", "tokenizer.json")
_REQUIRED_TOKENIZER_FILES: Final = ("vocab.json", "merges.txt")


def copy_qwen_tokenizer(source: Path, target: Path) -> None:
    """Copy the Qwen2 tokenizer files of ``source`` (the release's CosyVoice-BlankEN/) into ``target``; warn
    when the required ones are missing (the engines then need the release at synthesis)."""
    present = [name for name in _TOKENIZER_FILES if (source / name).is_file()]
    if present:
        target.mkdir()
    for name in present:
        shutil.copy2(source / name, target / name)
    missing = [name for name in _REQUIRED_TOKENIZER_FILES if name not in present]
    if missing:
        _LOGGER.warning(
            "%s has no %s: the engines carry no text tokenizer; synthesis will need the release's %s/",
            source,
            " or ".join(missing),
            QWEN_DIR,
        )
