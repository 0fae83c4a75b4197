"""The one map from a family name, a model config or a release directory to its ``Family``.

The families live in ``trt_cosy/models/<name>/family.py`` and sit above the runtime, the stages and
the builder (they compose them); the layers below still need to turn a manifest's or a config's
``family`` field into the family object. They ask this module, which names each family's class as
``"module:Class"`` and imports it on first use, so nothing below ``models/`` imports a family.

Adding a family is one line in ``_FAMILY_CLASSES`` (see docs/architecture.md, "Adding a family"). The
order is the official ``AutoModel`` order in which a release directory's yaml is looked for.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Iterator, Mapping, Set
from pathlib import Path
from typing import Any, Final, TypeVar

from .errors import EngineMismatchError, ModelDirError

Family = Any  # a ``trt_cosy.models.family.Family``: not imported, which would run the layers upward

__all__ = [
    "FAMILIES",
    "FamilyTable",
    "family_named",
    "family_of",
    "family_of_release",
    "families_where",
    "read_release_config",
]

T = TypeVar("T")

_FAMILY_CLASSES: Final = {
    "v1": "trt_cosy.models.v1.family:V1Family",
    "v2": "trt_cosy.models.v2.family:V2Family",
    "v3": "trt_cosy.models.v3.family:V3Family",
}


class _Families(Mapping[str, Family]):
    """``{name: Family}`` in ``AutoModel`` order; each family is imported and made once, when first asked."""

    def __init__(self, classes: Mapping[str, str]) -> None:
        self._classes = dict(classes)
        self._made: dict[str, Family] = {}
        self._lock = threading.Lock()

    def __getitem__(self, name: str) -> Family:
        made = self._made.get(name)
        if made is not None:
            return made
        path = self._classes[name]  # KeyError for an unknown name, as a dict
        with self._lock:
            if name not in self._made:
                module, _, cls = path.partition(":")
                self._made[name] = getattr(importlib.import_module(module), cls)()
            return self._made[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)


FAMILIES: Final = _Families(_FAMILY_CLASSES)


class FamilyTable(Mapping[str, T]):
    """``{name: read(name)}`` for every registered family, read when asked: a name-keyed table whose
    values live on the family objects (``read`` asks one), so a new family extends it by existing."""

    def __init__(self, read: Callable[[str], T]) -> None:
        self._read = read

    def __getitem__(self, name: str) -> T:
        if name not in _FAMILY_CLASSES:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(_FAMILY_CLASSES)

    def __len__(self) -> int:
        return len(_FAMILY_CLASSES)

    def __repr__(self) -> str:
        return f"FamilyTable({dict(self)!r})"


class _FamiliesWhere(Set[str]):
    """The names of the families for which ``test(family)`` holds, asked when first needed."""

    def __init__(self, test: Callable[[Family], bool]) -> None:
        self._test = test

    def _names(self) -> frozenset[str]:
        return frozenset(name for name, known in FAMILIES.items() if self._test(known))

    def __contains__(self, name: object) -> bool:
        return name in _FAMILY_CLASSES and bool(self._test(FAMILIES[name]))  # type: ignore[index]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names()))

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return f"families_where({sorted(self._names())!r})"


def families_where(test: Callable[[Family], bool]) -> Set[str]:
    """The names of the registered families for which ``test(family)`` holds (a set, read when asked)."""
    return _FamiliesWhere(test)


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
    for known in FAMILIES.values():
        if (model_dir / known.yaml_name).is_file():
            return known
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
