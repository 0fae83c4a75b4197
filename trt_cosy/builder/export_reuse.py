"""Share ONNX exports between builds of the same weights: each graph is exported (and checked) once.

The torch export and ORT-vs-torch parity check of each graph are most of a build's time, and they give
the same file whenever the module, its weights, the feeds and the export settings are the same: the
candidates of a tuned ``trt-cosy build`` (``builder.tuning``), or every build a test session makes of
the tiny checkpoints. Inside ``shared_exports(folder)`` (or with ``TRT_COSY_EXPORT_CACHE=folder`` in the
environment: several processes share the folder) ``export.export_graph`` asks ``reused`` first and calls
``remember`` after. An export is kept under the digest of everything that shapes it (``export_key``):
the graph's name, the module's class, every parameter and buffer (bytes), every submodule's other
attributes, the sample and parity feeds (bytes), the dynamic shapes, the opset and the tolerance. A
reused export is a copy, never a link: the later build steps rewrite their graphs in place. While one
process makes an export, ``claimed`` holds a lock on its key: another process (a pytest-xdist worker, a
parallel tuned build) wanting the same export waits for it and then reuses it, instead of making it too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Final, NamedTuple

import numpy as np

from ..runtime.run_scope import context_set

ExportResult = Any  # builder.export.ExportResult (a frozen dataclass; not imported: export imports this)


class KeptExport(NamedTuple):
    """A reused export: its copied files (the graph first), the max errors and seconds it was made with."""

    files: tuple[Path, ...]
    max_errors: dict[str, float]
    seconds: float

__all__ = ["EXPORT_CACHE_ENV", "KeptExport", "claimed", "shared_exports", "export_key", "reused", "remember"]

_LOGGER = logging.getLogger(__name__)

EXPORT_CACHE_ENV: Final = "TRT_COSY_EXPORT_CACHE"
_META: Final = "export.json"
_ACTIVE: ContextVar[Path | None] = ContextVar("trt_cosy_shared_exports", default=None)


@contextlib.contextmanager
def shared_exports(folder: Path) -> Iterator[Path]:
    """Within the block, each distinct export is made once and copied for later builds (kept in ``folder``)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with context_set(_ACTIVE, folder):
        yield folder


def _store() -> Path | None:
    """The folder exports are shared through now: ``shared_exports``', else the environment's, else None."""
    active = _ACTIVE.get()
    if active is not None:
        return active
    configured = os.environ.get(EXPORT_CACHE_ENV)
    return Path(configured) if configured else None


def export_key(
    name: str,
    file_name: str,
    module: Any,
    feeds: Sequence[Mapping[str, np.ndarray]],
    dynamic_shapes: Mapping[str, Any],
    opset: int,
    tolerance: float | None,
) -> str | None:
    """The digest of everything an export depends on, or None where exports are not shared now.
    ``file_name`` counts: a large graph's ``.onnx`` names its external data file."""
    if _store() is None:
        return None
    digest = hashlib.sha256()
    digest.update(f"{name}|{file_name}|{type(module).__module__}.{type(module).__qualname__}".encode())
    digest.update(f"{opset}|{tolerance}".encode())
    for prefix, sub in module.named_modules():
        attributes = {
            key: _fingerprint(value)
            for key, value in sorted(vars(sub).items())
            if not key.startswith("_") and key != "training"
        }
        digest.update(f"{prefix}:{type(sub).__qualname__}:{attributes}".encode())
    for key, tensor in module.state_dict(keep_vars=False).items():  # parameters and buffers
        digest.update(key.encode())
        digest.update(str(tuple(tensor.shape)).encode() + str(tensor.dtype).encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    for feed in feeds:
        for key in sorted(feed):
            value = np.ascontiguousarray(feed[key])
            digest.update(f"{key}:{value.dtype}:{value.shape}".encode())
            digest.update(value.tobytes())
    digest.update(repr(sorted((key, repr(value)) for key, value in dynamic_shapes.items())).encode())
    return digest.hexdigest()


def _fingerprint(value: Any) -> str:
    """A stable text of a module attribute: tensors and arrays by their bytes, the rest by ``repr``."""
    if hasattr(value, "detach"):  # a torch tensor that is not a parameter or buffer
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{value.shape}:" + hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()
    return repr(value)


@contextlib.contextmanager
def claimed(key: str | None) -> Iterator[None]:
    """Hold the key's lock (``<store>/locks/<key>``, an exclusive ``flock``) for the block: the one export
    of ``key`` is made by one process at a time; others wait, then find it with ``reused``. Nothing is
    locked where exports are not shared now. The lock goes with the process, so a crash never leaves it held."""
    store = _store()
    if key is None or store is None:
        yield
        return
    locks = store / "locks"  # kept: removing a lock file others wait on would let two makers in
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / key, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def reused(key: str | None, name: str, path: Path, emit: Callable[[str], None]) -> KeptExport | None:
    """Copies at ``path`` (and its data file) of the export kept under ``key``, or None."""
    store = _store()
    if key is None or store is None:
        return None
    kept = store / key
    try:
        meta = json.loads((kept / _META).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files = []
    for file_name in meta["files"]:
        target = path.parent / file_name  # graph.onnx and, for large graphs, graph.onnx.data
        shutil.copy2(kept / file_name, target)
        files.append(target)
    emit(f"{name}: reusing an earlier export of the same weights and feeds ({key[:12]})")
    return KeptExport(tuple(files), dict(meta["max_errors"]), float(meta["seconds"]))


def remember(key: str | None, result: ExportResult) -> None:
    """Keep a copy of ``result``'s files under ``key`` (where exports are shared), written atomically."""
    store = _store()
    if key is None or store is None:
        return
    if (store / key / _META).is_file():
        return
    staging = store / f".{key}.{os.getpid()}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for source in result.files:
        shutil.copy2(source, staging / source.name)
    meta = {
        "path": result.path.name,
        "files": [source.name for source in result.files],
        "max_errors": result.max_errors,
        "seconds": result.seconds,
    }
    (staging / _META).write_text(json.dumps(meta), encoding="utf-8")
    try:
        staging.rename(store / key)  # another process may have kept the same export first
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    _LOGGER.debug("kept the export of %s for later builds (%s)", result.name, key[:12])
