"""Engines derived from other engines without re-exporting (``quantize.derive_engines``,
``openvino.derive_openvino_engines``): the shared copy, manifest and atomic-rename steps."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from ..errors import InputError
from ..runtime.manifest import MANIFEST_NAME, GraphRecord, Manifest

__all__ = ["write_derived_engines", "file_sizes", "link_or_copy"]

Transform = Callable[[Path], Mapping[str, GraphRecord] | None]


def write_derived_engines(
    source_dir: Path,
    out_dir: Path,
    manifest: Manifest,
    precision: str,
    transform: Transform,
    finish: Callable[[Path, Manifest], Manifest] | None = None,
) -> Path:
    """Copy ``source_dir`` (hard links, ``link_or_copy``) to a staging directory next to ``out_dir``
    (which must not exist), run ``transform(staging)`` (it replaces graphs by new files, never writing
    through a link; it may return graph records to add or replace), write ``manifest`` with
    ``precision``, those graphs and the new file sizes (after ``finish(staging, manifest)`` when given),
    and rename the staging directory to ``out_dir``."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    if out_dir.exists():
        raise InputError(f"{out_dir} exists; choose a new directory for the {precision} engines.")
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    try:
        shutil.copytree(source_dir, staging, dirs_exist_ok=True, copy_function=link_or_copy)
        (staging / MANIFEST_NAME).unlink()  # a hard link to the source manifest: never write through it
        added = transform(staging) or {}
        graphs = {**manifest.graphs, **added}
        derived = dataclasses.replace(manifest, precision=precision, graphs=graphs, files=file_sizes(staging))
        if finish is not None:
            derived = finish(staging, derived)
        derived.write(staging)
        os.chmod(staging, 0o755)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def file_sizes(root: Path) -> dict[str, int]:
    """A manifest's ``files``: ``{path relative to root: bytes}`` of every file under ``root`` but the
    manifest itself."""
    return {
        path.relative_to(root).as_posix(): path.stat().st_size
        for path in sorted(Path(root).rglob("*"))
        if path.is_file() and path.name != MANIFEST_NAME
    }


def link_or_copy(source: str, target: str) -> None:
    """Hard-link ``source`` to ``target`` (a copy across file systems, and for ONNX external data,
    which onnx refuses to read through a hard link)."""
    if source.endswith(".data"):
        shutil.copy2(source, target)
        return
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
