"""Optimisation profiles of the incremental streaming estimator (``flow_estimator_incremental``,
CosyVoice2) for TensorRT: the new frames T and the cached frames P a streaming segment's calls take,
bounded by the segment's ``FlowCache`` limit. The other graphs' profiles are in ``runtime.profiles``.
"""

from __future__ import annotations

from typing import Final

from ..config import ModelConfig
from .profiles import GraphProfiles, ProfileLimits, ShapeProfile, range_of

__all__ = ["DEFAULT_LIMIT_BYTES", "incremental_frames", "incremental_profiles"]

DEFAULT_LIMIT_BYTES: Final = 2 << 30  # 2 GiB per segment: ~1870 frames (37 s of prompt + speech) at full size


def incremental_frames(config: ModelConfig, limits: ProfileLimits | None = None) -> int:
    """The most frames (cached + new) one incremental streaming call covers: what the segment's
    ``FlowCache`` may hold under ``limits.flow_cache_bytes``, at most ``max_tokens``' frames."""
    limits = limits or ProfileLimits()
    estimator = config.flow.estimator
    blocks, width, _ = estimator.cache_layout()
    per_frame = config.flow.cfm.n_timesteps * blocks * 2 * width * 4  # FlowCache.bytes_per_frame
    budget = DEFAULT_LIMIT_BYTES if limits.flow_cache_bytes is None else limits.flow_cache_bytes
    frames = min(budget // per_frame, config.token_mel_ratio * limits.max_tokens)
    return max(estimator.static_chunk_size + 1, frames)  # at least one chunk and a frame of the next


def incremental_profiles(config: ModelConfig, limits: ProfileLimits | None = None) -> GraphProfiles:
    """``flow_estimator_incremental`` (CosyVoice2): the new frames T and the cached frames P.

    ``chunk``: the official schedule's hops after a voice prompt prefix: T 1 / 2·``MAX_HOP`` /
    2·``MAX_HOP`` frames (a 100-token hop; a first chunk after the prefix is at most 2·(50 + 25)),
    P 0 / half of ``stream_tokens``' frames / the cache limit. ``long``: everything else a segment within
    the cache limit asks (a voice prefix or a first chunk over the whole prompt at P = 0, the
    ``fast`` schedule's growing hops): T 1 / a quarter of ``stream_tokens``' frames / F, P 0 / one chunk
    (opt never empty: TensorRT tunes there) / the cache limit, F = ``incremental_frames``. P is a multiple of the 50-frame chunk below F, so every
    call over at most F frames fits ``long`` (``stages.flow.FlowStage`` stops the cache beyond it).
    """
    from ..streaming import MAX_HOP
    from .graphs import FLOW_ESTIMATOR_INCREMENTAL

    limits = limits or ProfileLimits()
    mels, ratio = config.flow.output_size, config.token_mel_ratio
    blocks, width, channels = config.flow.estimator.cache_layout()
    chunk = config.flow.estimator.static_chunk_size
    frames = incremental_frames(config, limits)
    cached = (frames - 1) // chunk * chunk  # the largest P of a call over at most ``frames`` frames

    def profile(name: str, new: tuple[int, int, int], past: tuple[int, int, int]) -> ShapeProfile:
        wide = tuple((2, mels, t) for t in new)  # [2, 80, T]: the CFG pair
        shapes = {
            "x": wide,
            "mu": wide,
            "t": ((2,),) * 3,
            "spks": ((2, mels),) * 3,
            "cond": wide,
            "past_blocks": tuple((p, blocks, 2, width) for p in past),  # [P, L, 2, D]
            "past_tails": ((2, channels, 2),) * 3,  # [2, C, 2]
        }
        return ShapeProfile(name, shapes)  # type: ignore[arg-type]

    hop = min(ratio * MAX_HOP, frames)
    result = GraphProfiles(
        FLOW_ESTIMATOR_INCREMENTAL.name,
        (
            profile("chunk", (1, hop, hop), range_of(0, ratio * limits.stream_tokens // 2, cached)),
            profile("long", range_of(1, ratio * limits.stream_tokens // 4, frames), range_of(0, chunk, cached)),
        ),
    )
    result.check_spec(FLOW_ESTIMATOR_INCREMENTAL)
    return result
