"""The CosyVoice3 request: ``pipeline.Request`` with the v3 stages.

``CosyVoice3Model``, spec §6.3: the CosyVoice2 LLM and flow stages on the v3 graphs, silent-token
filtering of the LLM output (``filter_silent_tokens``), the CosyVoice2 hop schedule, and a vocoder
that re-renders the whole mel so far (``V3VocoderStage``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from ...pipeline import Request
from ...stages.flow import FlowStage
from ...stages.llm import LLMStage
from ...stages.speed import stretch_mel
from ...streaming import ChunkPlan
from .stages import V3VocoderCache, V3VocoderStage, filter_silent_tokens

__all__ = ["V3Stages", "V3Request"]


class V3Stages(NamedTuple):
    """The stateless CosyVoice3 stages one engine shares between its requests."""

    llm: LLMStage
    flow: FlowStage
    vocoder: V3VocoderStage


class V3Request(Request):
    """A CosyVoice3 request: the CosyVoice2 flow on the v3 graphs, silent-token filter, v3 vocoder."""

    def _decode(self, index: int) -> Iterator[int]:
        return filter_silent_tokens(super()._decode(index))

    def _chunk_tokens(self) -> int:
        """Speech tokens per streamed chunk: the release's ``chunk_size`` (the DiT flow has no chunked encoder)."""
        return self.config.chunk_size

    def _new_state(self) -> V3VocoderCache:
        return V3VocoderCache()

    def _render(
        self, tokens: np.ndarray, plan: ChunkPlan, state: V3VocoderCache
    ) -> tuple[np.ndarray, float, float]:
        """Official ``CosyVoice3Model.token2wav``: the new mel frames, then HiFT on the whole mel so far."""
        if plan.end == 0:  # the LLM stopped at once: nothing to say
            return np.zeros(0, np.float32), 0.0, 0.0
        start = time.perf_counter()
        mel = self.stages.flow.token2mel(
            tokens[None, : plan.end],  # [1, end]
            self.voice.speech_tokens.astype(np.int64)[None],  # [1, P]
            self.voice.prompt_mel[None],  # [1, 2P, 80]
            self.voice.speaker_embedding[None],  # [1, 192]
            streaming=plan.streaming,
            finalize=plan.final,
            cache=self._flow_cache,  # incremental chunks where the engines have the graph
        ).mel  # mel: [1, 80, 2 * (end - 3 unless final)]
        mel = mel[:, :, self.config.token_mel_ratio * plan.offset :]  # mel: [1, 80, F]
        if self.speed != 1.0:
            mel = stretch_mel(mel, self.speed)  # mel: [1, 80, int(F / speed)]
        flow_done = time.perf_counter()
        samples = self.stages.vocoder.render(mel, state, final=plan.final)[0]  # samples: [N]
        return samples, flow_done - start, time.perf_counter() - flow_done
