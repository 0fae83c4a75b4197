"""The one map from a release directory or a model config to its ``BuildFamily`` (torch side).

Each entry pairs with the inference-side ``trt_cosy.models.registry.FAMILIES``; adding a family is
one line here and one there (docs/architecture.md, "Adding a family").
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from ...models.registry import family_named, family_of_release
from .family import BuildFamily
from .v1.family import V1BuildFamily
from .v2.family import V2BuildFamily
from .v3.family import V3BuildFamily

__all__ = ["BUILD_FAMILIES", "build_family_of", "build_family_of_release"]

BUILD_FAMILIES: Final[dict[str, BuildFamily]] = {
    build.family.name: build for build in (V1BuildFamily(), V2BuildFamily(), V3BuildFamily())
}


def build_family_of(config: Any) -> BuildFamily:
    """The build steps of a model config's family."""
    return BUILD_FAMILIES[family_named(config.family).name]


def build_family_of_release(model_dir: Path) -> BuildFamily:
    """The build steps of a release directory's family (its yaml decides; ``ModelDirError`` if none)."""
    return BUILD_FAMILIES[family_of_release(model_dir).name]
