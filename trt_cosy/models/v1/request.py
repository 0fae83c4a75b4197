"""The CosyVoice 1 request: ``pipeline.Request`` with the v1 stages and schedule.

Official ``CosyVoiceModel.tts``, spec §6.2: the LLM has a speaker row and a text encoder
(``V1LLMStage``); chunks are 100-token hops with a 20-token overlap and each flow call sees only its
own tokens (``V1Schedule``); the flow draws fresh noise per call and carries a flow cache, a mel
overlap and the HiFT cache between calls (``V1Synthesizer``). The worker-thread LLM, cancellation and
chunk bookkeeping are ``pipeline.Request``'s.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from ...pipeline import Request
from ...streaming import ChunkPlan, HopSchedule
from .stages import RandomDraws, V1LLMStage, V1StreamState, V1Synthesizer

__all__ = ["V1Stages", "V1Schedule", "V1Request"]


class V1Stages(NamedTuple):
    """The stateless CosyVoice 1 stages one engine shares between its requests."""

    llm: V1LLMStage
    synthesizer: V1Synthesizer


class V1Schedule(HopSchedule):
    """The official v1 token schedule of one segment, as a pure function of the token count.

    Streaming: whenever ``hop + overlap`` tokens past the current offset exist, a non-final chunk
    takes exactly those and the offset moves on by ``hop`` (the last ``overlap`` tokens come again
    in the next chunk); when the LLM has finished, one final chunk takes the rest. A chunk plan's
    tokens are ``tokens[offset:end]`` (each flow call sees only its own tokens, not the history).
    Not streaming: one final chunk over everything. That is ``HopSchedule`` with no prompt padding,
    a hop that never grows and the overlap as its look-ahead.
    """

    def __init__(self, stream: bool, hop: int = 100, overlap: int = 20):
        super().__init__(0, stream, hop, overlap, max_hop=hop, scale=1)
        self.overlap = overlap


class V1Request(Request):
    """A CosyVoice 1 request (zero-shot, cross-lingual, preset speaker or instruct: see ``prompt``).

    The flow always gets the voice's speaker embedding: the reference's, or the preset speaker's
    (which is also the LLM's in SFT mode and absent from the LLM in instruct mode).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flow_embedding = np.asarray(self.voice.speaker_embedding, np.float32).reshape(1, -1)  # [1, 192]
        hift = self.config.hift
        self.draws = RandomDraws(self.vocoder_rng, self.config.flow.output_size, hift.nb_harmonics + 1)

    def _decode(self, index: int) -> Iterator[int]:
        prompt = self.prompt
        return self.stages.llm.generate(
            self.segments[index].ids,
            prompt.text_ids,
            prompt.speech_ids,
            prompt.embedding,
            self.sampler,
            self.max_new_tokens,
        )

    def _schedule(self) -> V1Schedule:
        stream = self.config.stream
        return V1Schedule(self.stream, stream.token_hop_len, stream.token_overlap_len)

    def _new_state(self) -> V1StreamState:
        return V1StreamState()

    def _render(
        self, tokens: np.ndarray, plan: ChunkPlan, state: V1StreamState
    ) -> tuple[np.ndarray, float, float]:
        """One official ``token2wav`` (flow + HiFT together; ``flow_s`` covers both)."""
        if plan.end <= plan.offset:  # the LLM stopped at once: nothing to say
            return np.zeros(0, np.float32), 0.0, 0.0
        start = time.perf_counter()
        speech = self.stages.synthesizer.token2wav(
            tokens[None, plan.offset : plan.end],  # [1, n]
            self.voice.speech_tokens.astype(np.int64)[None],  # [1, P]
            self.voice.prompt_mel[None],  # [1, P_mel, 80]
            self.flow_embedding,  # [1, 192]
            state,
            self.draws,
            finalize=plan.final,
            speed=self.speed,
        )  # speech: [1, S]
        return speech[0], time.perf_counter() - start, 0.0

    @staticmethod
    def flow_tokens(plan: ChunkPlan) -> int:
        """Each flow call takes only its own chunk's tokens, ``tokens[offset:end]`` (``V1Schedule``)."""
        return plan.end - plan.offset

    def _new_tokens(self, plan: ChunkPlan) -> int:
        return plan.end - plan.offset if plan.final else self.config.stream.token_hop_len
