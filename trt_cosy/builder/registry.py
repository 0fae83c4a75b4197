"""A family's torch side (``BuildFamily``), found through the one family registry.

Each ``Family`` (``trt_cosy.family_lookup.FAMILIES``) names its build family as ``"module:Class"``
(``Family.build_family``, in ``trt_cosy/models/<name>/export/``); it is imported here on first use, so the
runtime never imports torch. Adding a family is one folder and one line in ``family_lookup.py``
(docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path
from typing import Any, Final

from ..family_lookup import FAMILIES, family_named, family_of_release
from .build_family import BuildFamily

__all__ = ["build_family_named", "build_family_of", "build_family_of_release", "BUILD_FAMILY_NAMES"]

BUILD_FAMILY_NAMES: Final = tuple(FAMILIES)  # "v1", "v2", "v3"
_LOADED: dict[str, BuildFamily] = {}
_LOCK: Final = threading.Lock()


def build_family_named(name: str) -> BuildFamily:
    """The build steps of family ``name`` (its ``export`` package imported on first use)."""
    family = family_named(name)
    with _LOCK:
        if family.name not in _LOADED:
            module, _, attribute = family.build_family.partition(":")
            _LOADED[family.name] = getattr(importlib.import_module(module), attribute)()
        return _LOADED[family.name]


def build_family_of(config: Any) -> BuildFamily:
    """The build steps of a model config's family."""
    return build_family_named(config.family)


def build_family_of_release(model_dir: Path) -> BuildFamily:
    """The build steps of a release directory's family (its yaml decides; ``ModelDirError`` if none)."""
    return build_family_named(family_of_release(model_dir).name)
