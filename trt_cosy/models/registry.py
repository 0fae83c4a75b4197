"""The one map from a release directory, a model config or a family name to its ``Family``.

Adding a family is one line in ``FAMILIES`` (see docs/architecture.md, "Adding a family"). The
order is the official ``AutoModel`` order in which a release directory's yaml is looked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from ..errors import EngineMismatchError, ModelDirError
from .family import Family
from .v1.family import V1Family
from .v2.family import V2Family
from .v3.family import V3Family

__all__ = [
    "FAMILIES",
    "family_named",
    "family_of",
    "family_of_release",
    "read_release_config",
    "trt_graphs",
    "trt_profiles",
]

FAMILIES: Final[dict[str, Family]] = {known.name: known for known in (V1Family(), V2Family(), V3Family())}


def family_named(name: str) -> Family:
    """The family whose ``name`` is the ``family`` field of a model_config.json, manifest or golden set."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise EngineMismatchError(
            f"model family {name!r} is unknown to this trt-cosy; rebuild the engines with `trt-cosy build`."
        ) from None


def family_of(config: Any) -> Family:
    """The family of a model config (``ModelConfig``, ``V1ModelConfig``, ``V3ModelConfig``)."""
    return family_named(config.family)


def family_of_release(model_dir: Path) -> Family:
    """The family whose official yaml the release directory holds (``AutoModel`` order).

    Raises ``ModelDirError`` for a missing directory or one with no known yaml.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelDirError(
            f"model directory {model_dir} does not exist. Pass the folder of an official release "
            "(e.g. CosyVoice2-0.5B downloaded with `trt-cosy download`)."
        )
    for family in FAMILIES.values():
        if (model_dir / family.yaml_name).is_file():
            return family
    v2, v1, v3 = FAMILIES["v2"], FAMILIES["v1"], FAMILIES["v3"]
    raise ModelDirError(
        f"{model_dir} has no {v2.yaml_name}; expected an official CosyVoice2 release directory "
        f"(cosyvoice2.yaml, llm.pt, flow.pt, hift.pt, CosyVoice-BlankEN/), or a CosyVoice 1 "
        f"({v1.yaml_name}) or CosyVoice3 ({v3.yaml_name}) one."
    )


def read_release_config(model_dir: Path) -> Any:
    """The model config of a release directory of any family (the reader its yaml picks).

    CosyVoice2 gives a ``ModelConfig``, CosyVoice3 a ``V3ModelConfig`` (a subclass), CosyVoice 1 a
    ``V1ModelConfig``; ask ``family_of(config)`` for what differs rather than reading ``.family``.
    """
    return family_of_release(model_dir).read_config(Path(model_dir))


def trt_graphs(name: str) -> dict[str, Any]:
    """Every graph a TensorRT engines directory of family ``name`` holds (``runtime.profiles.trt_graph_specs``
    with the family handed in: the runtime imports no family)."""
    from ..runtime.profiles import trt_graph_specs

    return trt_graph_specs(family_named(name))


def trt_profiles(config: Any, limits: Any = None) -> dict[str, Any]:
    """The default TensorRT optimisation profiles of ``config``'s family (``runtime.profiles.default_profiles``)."""
    from ..runtime.profiles import default_profiles

    return default_profiles(config, family_named(config.family), limits)
