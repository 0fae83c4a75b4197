"""The families' map (``trt_cosy.family_lookup``, which the layers below ``models/`` use) and the
TensorRT graph and profile tables of a family, for the code above ``models/``.
"""

from __future__ import annotations

from typing import Any

from ..family_lookup import FAMILIES, family_named, family_of, family_of_release, read_release_config

__all__ = [
    "FAMILIES",
    "family_named",
    "family_of",
    "family_of_release",
    "read_release_config",
    "trt_graphs",
    "trt_profiles",
]


def trt_graphs(name: str) -> dict[str, Any]:
    """Every graph a TensorRT engines directory of family ``name`` holds (``runtime.profiles.trt_graph_specs``
    with the family handed in: the runtime imports no family)."""
    from ..runtime.profiles import trt_graph_specs

    return trt_graph_specs(family_named(name))


def trt_profiles(config: Any, limits: Any = None) -> dict[str, Any]:
    """The default TensorRT optimisation profiles of ``config``'s family (``runtime.profiles.default_profiles``)."""
    from ..runtime.profiles import default_profiles

    return default_profiles(config, family_named(config.family), limits)
