"""TensorRT optimisation profiles of the CosyVoice 1 graphs (``Family.trt_profiles``; the shared
pieces and the profile data types are ``runtime.profiles``)."""

from __future__ import annotations

from typing import Final

from ...runtime.profiles import (
    GraphProfiles,
    ProfileLimits,
    ShapeProfile,
    estimator_profiles,
    hift_profiles,
    llm_profiles,
    range_of,
)
from .config import V1ModelConfig

__all__ = ["V1_ESTIMATOR_MIN_FRAMES", "V1_FRAME_SLACK", "v1_frames", "v1_profiles"]

V1_ESTIMATOR_MIN_FRAMES: Final = 2  # the v1 U-Net halves the frames once (its export needs F >= 2)
V1_FRAME_SLACK: Final = 8  # v1 mel frames beyond int(tokens / 50 · 22050 / 256): the prompt mel's own length


def v1_frames(config: V1ModelConfig, tokens: int) -> int:
    """Most mel frames ``tokens`` 50 Hz tokens (prompt included) give: the official length regulator's
    ``int(n / 50 · 22050 / 256)`` plus ``V1_FRAME_SLACK`` (the prompt mel comes from the prompt audio,
    not from its token count)."""
    return config.flow.mel_frames(tokens) + V1_FRAME_SLACK


def _v1_flow_encoder(
    config: V1ModelConfig, tokens: tuple[int, int, int], frames: tuple[int, int, int], label: str
) -> ShapeProfile:
    regulator = tuple((f,) for f in frames)  # [F]: the length regulator's indices and weights
    shapes = {
        "tokens": tuple((1, n) for n in tokens),  # [1, N]
        "embedding": ((1, config.flow.spk_embed_dim),) * 3,
        "index0": regulator,
        "index1": regulator,
        "weight1": regulator,
    }
    return ShapeProfile(label, shapes)  # type: ignore[arg-type]


def v1_profiles(config: V1ModelConfig, limits: ProfileLimits) -> list[GraphProfiles]:
    """CosyVoice 1: 50 Hz tokens, 22.05 kHz, mel frames from the length regulator (``v1_frames``)."""
    llm, flow, stream = config.llm, config.flow, config.stream
    text_embeds = tuple((1, n, llm.text_encoder_input_size) for n in range_of(1, 64, limits.max_prefill))
    text = ShapeProfile("text", {"text_embeds": text_embeds, "embedding": ((1, llm.spk_embed_dim),) * 3})
    short_tokens = range_of(1, limits.stream_tokens // 4, limits.stream_tokens)
    long_tokens = range_of(1, limits.max_tokens // 2, limits.max_tokens)
    short, long = (
        range_of(1, v1_frames(config, n[1]), v1_frames(config, n[2])) for n in (short_tokens, long_tokens)
    )
    least = V1_ESTIMATOR_MIN_FRAMES
    # One streaming vocoder call: 20 cached + the chunk's (hop + overlap) frames - 34 held back.
    chunk = stream.mel_cache_len + flow.mel_frames(stream.token_hop_len + stream.token_overlap_len)
    chunk -= stream.mel_overlap_len
    cached = stream.source_cache_len
    lm = llm.llm
    return [
        GraphProfiles("v1_text_encoder", (text,)),
        llm_profiles(
            (llm.llm_input_size, lm.num_blocks, lm.attention_heads, lm.output_size // lm.attention_heads),
            limits,
        ),
        GraphProfiles(
            "v1_flow_encoder",
            (
                _v1_flow_encoder(config, short_tokens, short, "stream"),
                _v1_flow_encoder(config, long_tokens, long, "long"),
            ),
        ),
        estimator_profiles("flow_estimator", flow.output_size, (least, *short[1:]), (least, *long[1:])),
        hift_profiles(
            "v1_hift",
            config.hift,
            (range_of(1, chunk, limits.stream_frames), long),
            ((0, cached, cached), (0, cached, cached)),  # opt never empty (issue 29 item 7)
            rand_phase=True,
        ),
    ]
