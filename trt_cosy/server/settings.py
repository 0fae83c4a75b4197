"""Server settings: one frozen dataclass, every limit in one place (``None`` never means unlimited)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from ..errors import InputError

__all__ = ["ServerSettings", "LOOPBACK_HOSTS"]

LOOPBACK_HOSTS: Final = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class ServerSettings:
    """What ``create_app`` and ``trt-cosy serve`` need besides the loaded engine."""

    voices_dir: Path
    """Folder of the stored voices (``<name>.npz``); created when missing."""
    host: str = "127.0.0.1"
    """Address to bind; loopback by default (anything else without ``api_key`` logs a warning)."""
    port: int = 8000
    """TCP port, 0-65535 (0: any free port)."""
    model_name: str = "cosyvoice2"
    """The id listed by ``GET /v1/models``. Requests may name any model: one is served."""
    max_input_chars: int = 4096
    """Longest ``input`` text accepted, in characters (OpenAI's limit)."""
    max_instructions_chars: int = 1000
    """Longest ``instructions`` text accepted, in characters (it joins the LLM's prompt of every segment)."""
    max_segment_tokens: int = 200
    """Most text tokens in one segment (a sentence, or short sentences merged the official way); a longer
    one is refused with 400. One segment is rendered at once, and the flow encoder's memory grows with the
    square of its length (about 4 GB at 1600 speech tokens, full size: docs/benchmarks.md, "Memory at full
    size"), so a long run of words without sentence punctuation must not reach it. Prose has 60-160."""
    max_concurrent: int = 1
    """Syntheses (and voice uploads) running at once, >= 1."""
    max_queue: int = 8
    """Requests allowed to wait for a free slot; one more is answered 429, >= 0."""
    request_timeout_s: float = 300.0
    """A request still queued or synthesising after this many seconds stops (503/504, or the stream ends)."""
    work_admission: bool = True
    """Admission by expected work (``server.work_admission``): a request that would not finish within
    ``request_timeout_s`` given the work already admitted is refused at once (503 + Retry-After; 413
    when it could not even alone), and admitted requests are rendered in admission order. False:
    every request within ``max_concurrent`` + ``max_queue`` is admitted and they share the renders."""
    max_upload_bytes: int = 10 * 1024 * 1024
    """Largest reference-audio upload, bytes (413 beyond)."""
    max_upload_seconds: float = 30.0
    """Longest reference audio accepted, seconds (the speech tokenizer's limit is 30)."""
    max_source_seconds: float = 300.0
    """Longest source audio of a voice conversion (``POST /v1/audio/conversions``), seconds (400 beyond;
    its upload is also bound by ``max_upload_bytes``)."""
    max_json_bytes: int = 256 * 1024
    """Largest JSON request body, bytes (413 beyond)."""
    stream_speech: bool = True
    """``/v1/audio/speech`` streams wav and pcm as they are made when the body has no ``stream`` field (as
    OpenAI's API does); False: only when the body says ``"stream": true``. ``/tts`` streams only on request."""
    header_timeout_s: float = 10.0
    """A request's headers must be complete this many seconds after the connection opens or its
    previous response ends; else 408 and the connection is closed (slow clients)."""
    body_timeout_s: float = 30.0
    """Each read of an unfinished request body must return within this many seconds; else 408."""
    warmup: bool = True
    """Synthesise once at start; ``/health`` says ready only after it."""
    default_voice: str | None = None
    """The stored voice that OpenAI's built-in voice names (alloy, ash, ... verse: ``voice_names.OPENAI_VOICES``)
    speak in when no voice of that name is stored, for clients that only send those (Pipecat). None: a 404."""
    voice_aliases: Mapping[str, str] = field(default_factory=dict)
    """Requested voice name -> stored voice name (``{"alloy": "fox"}``), used when no voice of the requested
    name is stored; before ``default_voice``."""
    api_key: str | None = field(default=None, repr=False)
    """When set, every route but ``/health`` and the playground page needs ``Authorization: Bearer <api_key>``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "voices_dir", Path(self.voices_dir))
        positive = (
            "max_input_chars",
            "max_instructions_chars",
            "max_segment_tokens",
            "max_concurrent",
            "max_upload_bytes",
            "max_json_bytes",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}.")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise InputError(f"max_queue must be a non-negative integer, got {self.max_queue!r}.")
        timing = ("request_timeout_s", "max_upload_seconds", "max_source_seconds", "header_timeout_s")
        for name in (*timing, "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise InputError(f"{name} must be positive, got {getattr(self, name)!r}.")
        if self.api_key is not None and not (
            isinstance(self.api_key, str)
            and self.api_key
            and all("!" <= char <= "~" for char in self.api_key)
        ):
            raise InputError(
                "api_key must be a non-empty string of printable ASCII without spaces (it travels in an "
                "HTTP header); generate one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        aliases = dict(self.voice_aliases or {})
        for alias, target in aliases.items():
            if not (isinstance(alias, str) and alias and isinstance(target, str) and target):
                raise InputError(f"voice_aliases must map names to stored voice names, got {alias!r}: {target!r}.")
        object.__setattr__(self, "voice_aliases", aliases)
        if self.default_voice is not None and not (isinstance(self.default_voice, str) and self.default_voice):
            raise InputError(f"default_voice must be a stored voice name or None, got {self.default_voice!r}.")
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise InputError(f"port must be 0-65535, got {self.port!r}.")

    @property
    def is_loopback(self) -> bool:
        return self.host in LOOPBACK_HOSTS or self.host.startswith("127.")

    def replace(self, **changes) -> ServerSettings:
        return dataclasses.replace(self, **changes)
