"""trt-cosy: fast, torch-free inference for the CosyVoice text-to-speech models.

    from trt_cosy import CosyVoice
    tts = CosyVoice.load("engines/cosyvoice2/onnxruntime-fp32")
    voice = tts.voice_from_wav("ref.wav", text="what ref.wav says")
    tts.synthesize_to_file("Hello there.", "out.wav", voice, seed=0)

The public surface is listed in ``__all__``; everything else is internal. The API classes are
imported on first use, so ``import trt_cosy`` stays light (no onnxruntime, no tokenizer).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import EngineMismatchError, InputError, ModelDirError, TrtCosyError
from .version import __version__

__all__ = [
    "CosyVoice",
    "Voice",
    "AudioChunk",
    "SynthesisConfig",
    "EngineConfig",
    "TextStream",
    "TrtCosyError",
    "InputError",
    "ModelDirError",
    "EngineMismatchError",
    "__version__",
]

# Public name -> the module that defines it (imported lazily by __getattr__).
_LAZY = {
    "CosyVoice": ".tts",
    "Voice": ".frontend.voice",
    "AudioChunk": ".synthesis",
    "SynthesisConfig": ".synthesis",
    "EngineConfig": ".synthesis",
    "TextStream": ".stages.bistream",
    "ModelConfig": ".config",  # kept importable from here; not part of __all__
}

if TYPE_CHECKING:
    from .config import ModelConfig as ModelConfig
    from .frontend.voice import Voice
    from .stages.bistream import TextStream
    from .synthesis import AudioChunk, EngineConfig, SynthesisConfig
    from .tts import CosyVoice


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trt_cosy' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
