"""trt-cosy: fast, torch-free inference for the CosyVoice text-to-speech models.

The public surface is listed in ``__all__``; everything else is internal.
"""

from __future__ import annotations

from .config import ModelConfig
from .errors import EngineMismatchError, InputError, ModelDirError, TrtCosyError

__version__ = "0.1.0"

__all__ = [
    "ModelConfig",
    "TrtCosyError",
    "ModelDirError",
    "EngineMismatchError",
    "InputError",
    "__version__",
]
