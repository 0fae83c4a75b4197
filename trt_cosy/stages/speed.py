"""Speaking rate: the official ``speed`` stretches a whole segment's mel along time before the vocoder.

Official ``token2wav`` (CosyVoice 1, 2 and 3), non-streaming only::

    tts_mel = F.interpolate(tts_mel, size=int(tts_mel.shape[2] / speed), mode='linear')

``stretch_mel`` is that call in numpy: linear interpolation with ``align_corners=False`` (each output
frame ``i`` samples the input at ``(i + 0.5) * F / F_out - 0.5``, clamped at 0), so the audio is the
official audio for the same speech tokens and vocoder noise. (torch computes the source positions in
float32, whose rounding at frame 1000 is 6e-5 of a frame; here they are float64, so the two differ by
that much of a frame-to-frame step.)
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InputError

__all__ = ["MIN_SPEED", "MAX_SPEED", "check_speed", "stretch_mel"]

MIN_SPEED = 0.25
MAX_SPEED = 4.0


def check_speed(speed: float | None) -> None:
    """``InputError`` unless ``speed`` is None or a number in [0.25, 4.0] (OpenAI's range)."""
    if speed is None:
        return
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not math.isfinite(speed):
        raise InputError(f"speed must be a number between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}.")
    if not MIN_SPEED <= speed <= MAX_SPEED:
        raise InputError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, got {speed!r}.")


def stretch_mel(mel: np.ndarray, speed: float) -> np.ndarray:
    """``mel`` [B, C, F] resampled to ``int(F / speed)`` frames (torch ``F.interpolate(..., mode='linear')``)."""
    frames = mel.shape[2]
    out_frames = max(int(frames / speed), 1)
    if speed == 1.0 or frames == 0:
        return mel
    scale = frames / out_frames
    position = np.maximum((np.arange(out_frames) + 0.5) * scale - 0.5, 0.0)  # position: [F_out], float64
    left = np.minimum(position.astype(np.int64), frames - 1)  # left: [F_out]
    right = np.minimum(left + 1, frames - 1)  # right: [F_out]
    weight = (position - left).astype(np.float32)  # weight: [F_out]
    stretched = mel[:, :, left] * (np.float32(1.0) - weight) + mel[:, :, right] * weight  # [B, C, F_out]
    return stretched.astype(mel.dtype, copy=False)
