"""Stored voices: one ``<name>.npz`` per voice in a folder, kept in memory, safe across restarts.

Writes are atomic (``Voice.save`` writes a temp file and renames it), a new name is claimed with a
hard link so two writers can never overwrite each other by accident, and a file that cannot be
read at start is skipped with a warning instead of stopping the server.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..errors import InputError
from ..frontend.voice import Voice
from .errors import APIError

__all__ = ["VoiceStore", "StoredVoice", "check_name"]

_LOGGER = logging.getLogger(__name__)

_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
_SUFFIX: Final = ".npz"


def check_name(name: object) -> str:
    """A voice name: 1-64 of letters, digits, ``_`` and ``-``, starting with a letter or digit."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise APIError(
            400,
            f"invalid voice name {name!r}: use 1-64 letters, digits, '_' or '-', starting with a letter "
            "or digit.",
            "invalid_voice_name",
            "name",
        )
    return name


@dataclass(frozen=True)
class StoredVoice:
    name: str
    voice: Voice
    created_at: int

    def describe(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "object": "voice",
            "name": self.name,
            "mode": "zero-shot" if self.voice.prompt_text else "cross-lingual",
            "prompt_text": self.voice.prompt_text,
            "prompt_tokens": int(self.voice.speech_tokens.shape[0]),
            "created_at": self.created_at,
        }


class VoiceStore:
    """The voices in ``folder`` made for ``model_id``; thread-safe.

    Args:
        folder: where the ``.npz`` files live (created when missing).
        model_id: the served model's id; voices made for another model are skipped at load.
    """

    def __init__(self, folder: str | Path, model_id: str = ""):
        self.folder = Path(folder)
        self.model_id = model_id
        self._voices: dict[str, StoredVoice] = {}
        self._lock = threading.Lock()

    def load(self) -> int:
        """Read every voice file in the folder; returns how many were loaded."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for leftover in self.folder.glob(".staging-*"):  # from a crash in the middle of ``add``
            shutil.rmtree(leftover, ignore_errors=True)
        loaded: dict[str, StoredVoice] = {}
        for path in sorted(self.folder.glob(f"*{_SUFFIX}")):
            name = path.name[: -len(_SUFFIX)]
            if _NAME.fullmatch(name) is None:
                continue  # temp files (".x.npz.tmp") and foreign names
            try:
                voice = Voice.load(path)
            except InputError as exc:
                _LOGGER.warning("skipping voice file %s: %s", path, exc)
                continue
            if self.model_id and voice.model_id and voice.model_id != self.model_id:
                _LOGGER.warning(
                    "skipping voice %s: made for model %s, this server runs %s",
                    path,
                    voice.model_id,
                    self.model_id,
                )
                continue
            loaded[name] = StoredVoice(name, voice, int(path.stat().st_mtime))
        with self._lock:
            self._voices = loaded
        _LOGGER.info("loaded %d voice(s) from %s", len(loaded), self.folder)
        return len(loaded)

    def staging_dir(self, purpose: str) -> Path:
        """A new private folder in the voices folder (``.staging-<purpose>-*``) for work files; the
        caller removes it, and ``load`` removes any left by a crash."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".staging-{purpose}-", dir=self.folder))

    def get(self, name: str) -> StoredVoice:
        with self._lock:
            stored = self._voices.get(name)
        if stored is None:
            raise APIError(
                404,
                f"voice {name!r} does not exist; list voices with GET /v1/voices or upload one with "
                "POST /v1/voices.",
                "voice_not_found",
                "voice",
            )
        return stored

    def list(self) -> list[StoredVoice]:
        with self._lock:
            return sorted(self._voices.values(), key=lambda stored: stored.name)

    def exists(self, name: str) -> bool:
        with self._lock:
            return name in self._voices or self._path(name).exists()

    def add(self, name: str, voice: Voice, overwrite: bool = False) -> StoredVoice:
        """Store ``voice`` as ``name``, atomically; 409 when the name is taken and not ``overwrite``."""
        check_name(name)
        path = self._path(name)
        with self._lock:
            staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=self.folder))
            try:
                staged = voice.save(staging / path.name)
                if overwrite:
                    os.replace(staged, path)
                else:
                    try:
                        os.link(staged, path)  # fails when the name exists, even written by another process
                    except FileExistsError:
                        raise self._conflict(name) from None
            finally:
                for leftover in staging.iterdir():
                    leftover.unlink()
                staging.rmdir()
            _fsync_dir(self.folder)
            stored = StoredVoice(name, voice, int(path.stat().st_mtime))
            self._voices[name] = stored
        _LOGGER.info("stored voice %s (%d prompt tokens)", name, voice.speech_tokens.shape[0])
        return stored

    def delete(self, name: str) -> None:
        check_name(name)
        with self._lock:
            path = self._path(name)
            if name not in self._voices and not path.exists():
                raise APIError(404, f"voice {name!r} does not exist.", "voice_not_found", "name")
            path.unlink(missing_ok=True)
            _fsync_dir(self.folder)
            self._voices.pop(name, None)
        _LOGGER.info("deleted voice %s", name)

    def _conflict(self, name: str) -> APIError:
        return APIError(
            409,
            f"voice {name!r} already exists; delete it first or send ?overwrite=true to replace it.",
            "voice_exists",
            "name",
        )

    def check_free(self, name: str, overwrite: bool) -> None:
        """Fail early (before any audio work) when ``name`` is taken and not ``overwrite``."""
        if not overwrite and self.exists(check_name(name)):
            raise self._conflict(name)

    def _path(self, name: str) -> Path:
        return self.folder / f"{name}{_SUFFIX}"


def _fsync_dir(folder: Path) -> None:
    """Make a rename or unlink durable (POSIX); a no-op where directories cannot be opened."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)
