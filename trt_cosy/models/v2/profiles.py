"""TensorRT optimisation profiles of the CosyVoice2 graphs (``Family.profile_builder``; the shared
pieces and the profile data types are ``runtime.profiles``)."""

from __future__ import annotations

from ...config import ModelConfig
from ...runtime.profiles import (
    GraphProfiles,
    ProfileLimits,
    estimator_profiles,
    flow_encoder_profiles,
    hift_profiles,
    llm_profiles,
    middle_frames,
    qwen_dims,
    range_of,
    token_frames,
)

__all__ = ["qwen_flow_profiles", "v2_profiles"]


def qwen_flow_profiles(
    config: ModelConfig, limits: ProfileLimits, encoder_streaming: bool
) -> list[GraphProfiles]:
    """The Qwen2 LLM, the flow encoder (with or without its ``streaming`` input) and both estimators:
    CosyVoice2's, and CosyVoice3's (its DiT keeps the estimator I/O)."""
    short, long = token_frames(config, limits)
    mels = config.flow.output_size
    return [
        llm_profiles(qwen_dims(config), limits),
        flow_encoder_profiles(config, limits, streaming=encoder_streaming),
        estimator_profiles("flow_estimator", mels, short, long),
        estimator_profiles("flow_estimator_stream", mels, short, long, middle_frames(config, limits)),
    ]


def v2_profiles(config: ModelConfig, limits: ProfileLimits) -> list[GraphProfiles]:
    """``qwen_flow_profiles`` and HiFT with its streaming source cache (8 frames' samples)."""
    long = token_frames(config, limits)[1]
    cached = config.hift.samples_per_frame * limits.hift_cache_frames
    chunk = config.chunk_size * config.token_mel_ratio + limits.hift_cache_frames  # 50 new + 8 cached
    hift_frames = (range_of(1, chunk, limits.stream_frames), long)
    hift = hift_profiles("hift", config.hift, hift_frames, ((0, cached, cached), (0, cached, cached)))
    return [*qwen_flow_profiles(config, limits, encoder_streaming=True), hift]
