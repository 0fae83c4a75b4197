"""Per-family calls of ``CosyVoice`` (``trt_cosy.tts``), by family name: each asks the family object.

What differs between CosyVoice 1, 2 and 3 lives in ``trt_cosy/models/<name>/family.py`` (the
``Family`` interface, ``trt_cosy.models.family``); ``trt_cosy.family_lookup`` maps a name to it.
This module keeps the name-based calls that ``CosyVoice`` and older code use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np

from .frontend.voice import Voice, VoiceBuilder
from .models.registry import FAMILIES, family_named, family_of
from .models.v1.family import V1_INSTRUCT_MARKER, V1_MAX_SEGMENT_SECONDS, V1TextTokenizer, V1VoiceBuilder
from .models.v3.family import V3_SYSTEM_PROMPT
from .pipeline import Request
from .runtime.backends.base import Runner
from .runtime.model import LoadedModel
from .synthesis import LLMPrompt

__all__ = [
    "SPEECH_TOKENIZER_FILES",
    "V3_SYSTEM_PROMPT",
    "V1_INSTRUCT_MARKER",
    "V1_MAX_SEGMENT_SECONDS",
    "V1TextTokenizer",
    "V1VoiceBuilder",
    "load_text_tokenizer",
    "make_voice_builder",
    "build_stages",
    "request_class",
    "prompt_text_for_voice",
    "instruct_text",
    "llm_prompt_for",
    "check_voice",
    "speech_budget",
]

SPEECH_TOKENIZER_FILES: Final = {known.name: known.speech_tokenizer_file for known in FAMILIES.values()}


def load_text_tokenizer(family: str, tokenizer_dir: Path) -> Any:
    """The text tokenizer carried by the engines (``tokenizer/``): whisper ranks (v1) or Qwen2 (v2/v3)."""
    return family_named(family).load_text_tokenizer(tokenizer_dir)


def make_voice_builder(
    model: LoadedModel, lazy_runner: Callable[[str, str], Runner], model_id: str
) -> VoiceBuilder:
    """The voice builder of the model's family; ``lazy_runner(file name, graph name)`` opens a frontend model."""
    return family_of(model.config).make_voice_builder(model, lazy_runner, model_id)


def build_stages(model: LoadedModel, llm_slots: int | None = None, llm_slot_positions: int | None = None) -> Any:
    """The stateless stages of the model's family over its runners and tables.

    CosyVoice2/3 engines with the batched decode graph get a ``BatchedLLMStage`` (one decode loop
    shared by all requests, ``llm_slots`` KV slots; ``EngineConfig.llm_slots``) unless ``llm_slots``
    is 0; everything else decodes each request alone.
    """
    return family_of(model.config).build_stages(model, llm_slots, llm_slot_positions)


def request_class(family: str) -> type[Request]:
    return family_named(family).request_class


def prompt_text_for_voice(family: str, transcript: str) -> str:
    """The prompt text of a zero-shot voice: CosyVoice3 puts the system prompt and marker in front."""
    return family_named(family).prompt_text_for_voice(transcript)


def instruct_text(family: str, instruct: str, normalize: Callable[[str], str]) -> str:
    """The instruction as the LLM's prompt text, with the family's end-of-prompt marker."""
    return family_named(family).instruct_text(instruct, normalize)


def llm_prompt_for(
    family: str, voice: Voice, instruct_ids: np.ndarray | None, encode: Callable[[str], list[int]]
) -> LLMPrompt:
    """What the LLM gets besides the text for ``voice`` (and an instruction), spec §2.4."""
    return family_named(family).llm_prompt(voice, instruct_ids, encode)


def check_voice(model: LoadedModel, voice: Voice) -> None:
    """``InputError`` unless the voice's arrays fit the model (rate, embedding, prompt lengths)."""
    family_of(model.config).check_voice(model, voice)


def speech_budget(model: LoadedModel, voice: Voice) -> int:
    """The most speech tokens one segment may get for this voice (the engines' fixed noise, or v1's cap)."""
    return family_of(model.config).speech_budget(model, voice)
