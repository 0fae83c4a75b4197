"""Which stored voice a request's ``voice`` names: the voice of that name, an alias, or the default voice.

OpenAI's clients send OpenAI's own voice names; some (Pipecat) accept no others. A server started with
``--voice-alias alloy=fox,echo=bob`` (``ServerSettings.voice_aliases``) speaks those names in the stored
voices they map to, and one with ``--default-voice fox`` speaks every one of OpenAI's names that is neither
stored nor aliased in ``fox``. A stored voice always wins over an alias of the same name.
"""

from __future__ import annotations

import logging
from typing import Final

from .errors import APIError
from .settings import ServerSettings
from .voices_store import StoredVoice, VoiceStore

__all__ = ["OPENAI_VOICES", "resolve_voice", "parse_voice_aliases"]

_LOGGER = logging.getLogger(__name__)

OPENAI_VOICES: Final = frozenset(
    ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage", "shimmer",
     "verse")
)
"""OpenAI's built-in voice names (those Pipecat's OpenAI adapter allows)."""


def resolve_voice(store: VoiceStore, settings: ServerSettings, name: str) -> StoredVoice:
    """The stored voice a request's ``voice`` stands for.

    Raises:
        APIError: 404 naming the stored voices' route and the ``--voice-alias`` / ``--default-voice`` flags.
    """
    if store.exists(name):
        return store.get(name)
    target = settings.voice_aliases.get(name)
    how = "the alias"
    if target is None and name in OPENAI_VOICES and settings.default_voice is not None:
        target, how = settings.default_voice, "the default voice"
    if target is not None:
        if store.exists(target):
            return store.get(target)
        raise APIError(
            404,
            f"voice {name!r} maps to {target!r} ({how}), which is not stored; upload it with POST /v1/voices "
            "or start the server with another --voice-alias / --default-voice.",
            "voice_not_found",
            "voice",
        )
    openai_hint = ""
    if name in OPENAI_VOICES:
        openai_hint = (
            f" {name!r} is one of OpenAI's voice names: start the server with --default-voice NAME or "
            f"--voice-alias {name}=NAME to speak it in a stored voice."
        )
    raise APIError(
        404,
        f"voice {name!r} does not exist; list voices with GET /v1/voices, upload one with POST /v1/voices, "
        f"or map the name to a stored voice with --voice-alias {name}=NAME.{openai_hint}",
        "voice_not_found",
        "voice",
    )


def parse_voice_aliases(specs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``("alloy=fox,echo=bob", "nova=fox")`` -> ``{"alloy": "fox", "echo": "bob", "nova": "fox"}``.

    Raises:
        ValueError: an item without ``=`` or with an empty side.
    """
    aliases: dict[str, str] = {}
    for spec in specs:
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            alias, separator, target = (part.strip() for part in item.partition("="))
            if not separator or not alias or not target:
                raise ValueError(f"voice alias {item!r} must be NAME=STORED_VOICE (e.g. alloy=fox)")
            aliases[alias] = target
    return aliases
