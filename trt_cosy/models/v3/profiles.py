"""TensorRT optimisation profiles of the CosyVoice3 graphs (``Family.profile_builder``; the shared
pieces and the profile data types are ``runtime.profiles``)."""

from __future__ import annotations

from ...config import ModelConfig
from ...runtime.profiles import GraphProfiles, ProfileLimits, hift_profiles, range_of, token_frames
from ..v2.profiles import qwen_flow_profiles
from .graphs import HIFT_STREAM_MIN_FRAMES

__all__ = ["v3_profiles"]


def v3_profiles(config: ModelConfig, limits: ProfileLimits) -> list[GraphProfiles]:
    """CosyVoice3: the v2 LLM and estimator profiles (the DiT keeps the estimator I/O); the flow
    encoder has no ``streaming`` input; both causal HiFT graphs re-vocode the whole mel so far (no
    source cache), the streaming one needs ``HIFT_STREAM_MIN_FRAMES`` (its outputs are 8 frames shorter)."""
    long = token_frames(config, limits)[1]
    least = HIFT_STREAM_MIN_FRAMES
    stream = range_of(1, limits.stream_frames // 4, limits.stream_frames)
    stream_only = (least, max(stream[1], least), max(stream[2], least))
    return [
        *qwen_flow_profiles(config, limits, encoder_streaming=False),
        hift_profiles("hift", config.hift, (stream, long), None),
        hift_profiles("hift_stream", config.hift, (stream_only, (least, *long[1:])), None),
    ]
