"""The streaming token-hop schedule of CosyVoice2 (spec §6.1), as a small pure object per segment.

The official ``CosyVoice2Model.tts(stream=True)`` turns the growing list of LLM speech tokens into
flow calls: the first hop is the chunk size (25) plus the prompt padding that makes prompt + hop end
on a chunk boundary, later hops double up to 100; a streaming call needs ``hop + 3`` look-ahead tokens
beyond the current offset; once the LLM has finished and fewer remain, one final call takes all tokens
with full attention. Which chunks fire depends only on the token count, never on timing, so a
schedule is a pure function of ``(tokens available, LLM finished)``.

Official difference, on purpose: upstream keeps the growing hop in an *instance attribute*
(``self.token_hop_len``), so after the first request every later or concurrent request starts at
hop 100 (upstream PR #1849). Here the hop lives in the ``HopSchedule`` of one segment of one
request; every segment starts again at 25 + padding, which is what the official code does on a
freshly loaded model.

``FAST_SCHEDULE`` is trt-cosy's own, cheaper schedule, never the default: the hops keep doubling
without the 100-token cap (25 + padding, 50, 100, 200, 400, ...) and the last call keeps chunk
attention instead of switching to full attention. Since the flow is chunk-causal, every frame it
emits is then the frame one chunk-attention pass over the whole segment gives, and the number of
flow calls grows with the logarithm of the segment length instead of linearly. Its audio differs
from the official schedule's after the last official chunk boundary (chunk instead of full
attention there); docs/benchmarks.md states the cost and the mel difference measured.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Final

__all__ = [
    "ChunkPlan",
    "HopSchedule",
    "MAX_HOP",
    "HOP_SCALE",
    "SCHEDULES",
    "OFFICIAL_SCHEDULE",
    "FAST_SCHEDULE",
    "hop_schedule",
]

_LOGGER = logging.getLogger(__name__)

MAX_HOP: Final = 100  # official token_max_hop_len (v2)
HOP_SCALE: Final = 2  # official stream_scale_factor (v2)
OFFICIAL_SCHEDULE: Final = "official"
FAST_SCHEDULE: Final = "fast"
SCHEDULES: Final = (OFFICIAL_SCHEDULE, FAST_SCHEDULE)


@dataclass(frozen=True)
class ChunkPlan:
    """One flow + vocoder call of a segment.

    Attributes:
        end: the flow gets speech tokens ``[0, end)`` of the segment (plus the prompt tokens).
        offset: the official ``token_offset``: mel frames from ``token_mel_ratio * offset`` on are new.
        final: the last call of the segment: ``finalize=True``, nothing withheld; full attention
            unless ``chunk_attention``.
        chunk_attention: a final call that keeps chunk attention (``FAST_SCHEDULE`` only).
    """

    end: int
    offset: int
    final: bool
    chunk_attention: bool = False

    @property
    def streaming(self) -> bool:
        """Chunk attention in the flow (the official final call leaves ``stream`` at False)."""
        return not self.final or self.chunk_attention


class HopSchedule:
    """Where the chunk boundaries of one segment fall, as tokens arrive.

    Args:
        prompt_tokens: the flow prompt's speech-token count P (the voice's ``speech_tokens``).
        stream: False gives one final chunk over all tokens once the LLM has finished.
        hop: the chunk size in tokens (flow ``static_chunk_size``, 25); the first hop adds the padding.
        lookahead: the flow's ``pre_lookahead_len`` (3).
        max_hop: the largest hop (100); None: no cap. scale: hop growth factor per chunk (2).
        final_chunk_attention: the final call keeps chunk attention (official: full attention).
    """

    def __init__(
        self,
        prompt_tokens: int,
        stream: bool,
        hop: int = 25,
        lookahead: int = 3,
        max_hop: int | None = MAX_HOP,
        scale: int = HOP_SCALE,
        final_chunk_attention: bool = False,
    ):
        self.stream = stream
        self.final_chunk_attention = final_chunk_attention
        self.lookahead = lookahead
        self.max_hop = max_hop
        self.scale = scale
        self.offset = 0
        self.done = False
        # Official prompt_token_pad: prompt + first hop end on a chunk boundary.
        self.prompt_pad = math.ceil(prompt_tokens / hop) * hop - prompt_tokens
        self._hop = hop

    @property
    def hop(self) -> int:
        """The next non-final chunk's hop in tokens (the first one includes the prompt padding)."""
        return self._hop + self.prompt_pad if self.offset == 0 else self._hop

    @property
    def needed(self) -> int | None:
        """Tokens the next non-final chunk needs in all; None when only the LLM's end can decide."""
        if self.done or not self.stream:
            return None
        return self.offset + self.hop + self.lookahead

    def next_chunk(self, available: int, finished: bool) -> ChunkPlan | None:
        """The chunk to run now, or None to wait for more tokens (or after the final chunk).

        Args:
            available: speech tokens the LLM has produced for this segment so far.
            finished: the LLM has ended this segment (``available`` is then the total).
        """
        if self.done:
            return None
        needed = self.needed
        if needed is not None and available >= needed:
            plan = ChunkPlan(end=needed, offset=self.offset, final=False)
            self.offset += self.hop
            grown = self._hop * self.scale
            self._hop = grown if self.max_hop is None else min(self.max_hop, grown)
            return plan
        if finished:
            self.done = True
            # Chunk attention in a final call only where the segment streams (one call otherwise).
            chunked = self.final_chunk_attention and self.stream
            return ChunkPlan(end=available, offset=self.offset, final=True, chunk_attention=chunked)
        return None

    def plan_all(self, total: int) -> list[ChunkPlan]:
        """Every chunk for a segment of ``total`` tokens (all available at once)."""
        plans = []
        while (plan := self.next_chunk(total, finished=True)) is not None:
            plans.append(plan)
        return plans


def hop_schedule(prompt_tokens: int, stream: bool, hop: int, lookahead: int, schedule: str) -> HopSchedule:
    """The ``HopSchedule`` of one segment under the named schedule (``SCHEDULES``)."""
    if schedule == FAST_SCHEDULE:
        return HopSchedule(prompt_tokens, stream, hop, lookahead, max_hop=None, final_chunk_attention=True)
    return HopSchedule(prompt_tokens, stream, hop, lookahead)
