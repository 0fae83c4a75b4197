"""What every route shares: the engine, the settings, the voice store, admission and metrics."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .errors import RETRY_WARMING_S, APIError
from .limits import Admission
from .metrics import Metrics
from .settings import ServerSettings
from .voices_store import VoiceStore

__all__ = ["ServerState"]

_LOGGER = logging.getLogger(__name__)


@dataclass
class ServerState:
    """One server's shared objects. ``tts`` is a ``CosyVoice`` (or anything with its methods)."""

    tts: Any
    settings: ServerSettings
    store: VoiceStore
    metrics: Metrics
    admission: Admission
    formats: tuple[str, ...]
    work: Any = None
    """Admission by expected work (``work_admission.ServerWork``); None: none."""
    ready: bool = False
    warmup_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def set_ready(self) -> None:
        self.ready = True
        self.metrics.ready.set(1)

    def require_ready(self) -> None:
        if self.warmup_error is not None:
            raise APIError(503, f"the server failed to warm up: {self.warmup_error}", "warmup_failed")
        if not self.ready:
            raise APIError(
                503,
                "the server is warming up; retry in a few seconds (see GET /health).",
                "not_ready",
                headers={"Retry-After": str(RETRY_WARMING_S)},
            )
