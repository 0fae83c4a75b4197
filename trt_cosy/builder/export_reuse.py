"""Share one build's ONNX exports with the builds that follow it in the same process.

``trt-cosy build`` with tuning (``builder.tuning``) builds several candidate engine sets from one
checkpoint; the torch export and parity check of each graph (most of a build's time) give the same
file every time. Inside ``shared_exports(folder)`` the first export of each graph is kept in ``folder``
and every later ``export_graph`` of the same graph and file name gets a copy of it instead
(``export.export_graph`` asks ``reused`` first and calls ``remember`` after). Copies, never hard links:
the later build steps rewrite their graphs in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Any

ExportResult = Any  # builder.export.ExportResult (a frozen dataclass; not imported: export imports this)

__all__ = ["shared_exports", "reused", "remember"]

_LOGGER = logging.getLogger(__name__)

_ACTIVE: ContextVar[_Kept | None] = ContextVar("trt_cosy_shared_exports", default=None)


@dataclasses.dataclass
class _Kept:
    folder: Path
    results: dict[tuple[str, str], ExportResult] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def shared_exports(folder: Path) -> Iterator[Path]:
    """Within the block, each graph is exported once and copied for later builds (kept in ``folder``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    token = _ACTIVE.set(_Kept(folder))
    try:
        yield folder
    finally:
        _ACTIVE.reset(token)


def reused(name: str, path: Path, emit: Callable[[str], None]) -> ExportResult | None:
    """A copy of the kept export of graph ``name`` at ``path`` (same file name), or None."""
    kept = _ACTIVE.get()
    if kept is None or (name, Path(path).name) not in kept.results:
        return None
    result = kept.results[(name, Path(path).name)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files = []
    for source in result.files:
        target = path.parent / source.name
        shutil.copy2(source, target)
        files.append(target)
    emit(f"{name}: reusing this build's export of {path.name}")
    return dataclasses.replace(result, path=path, files=tuple(files))


def remember(result: ExportResult) -> None:
    """Keep a copy of ``result``'s files for later builds (inside ``shared_exports`` only)."""
    kept = _ACTIVE.get()
    if kept is None:
        return
    folder = kept.folder / result.name
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for source in result.files:
        target = folder / source.name
        shutil.copy2(source, target)
        files.append(target)
    kept.results[(result.name, result.path.name)] = dataclasses.replace(
        result, path=folder / result.path.name, files=tuple(files)
    )
    _LOGGER.debug("kept the export of %s for later builds", result.name)
