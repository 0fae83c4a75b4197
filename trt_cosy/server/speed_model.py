"""The work model of admission by expected work: speech tokens per text token and machine seconds per
speech token, learnt on this machine (``server.admission`` module docstring, "The work model"), and how
far the finishes predicted from it proved right (``FinishAccuracy``: the margin they call for).

Pure: no server, no engine, no clock (``WorkAdmission`` feeds it the warm-up and finished requests).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Final

__all__ = ["SpeedModel", "DEFAULT_ALPHA", "FinishAccuracy", "MARGIN_RANGE"]

DEFAULT_ALPHA: Final = 0.3
"""Weight of a new observation in the exponential averages."""
_FACTOR_RANGE: Final = (0.25, 4.0)  # one throughput window moves the speed by at most this factor
_MAX_OVERHEAD_TOKENS: Final = 1000.0


class _LineFit:
    """``y = intercept + slope * x`` by exponentially weighted least squares (weight ``alpha`` for
    the newest point); ``line()`` is None until two different ``x`` were seen or when the slope is
    not positive."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.points = 0
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - self.alpha if self.points else 1.0
        self.points += 1
        self.n = keep * self.n + 1.0
        self.sx = keep * self.sx + x
        self.sy = keep * self.sy + y
        self.sxx = keep * self.sxx + x * x
        self.sxy = keep * self.sxy + x * y

    def line(self) -> tuple[float, float] | None:
        spread = self.n * self.sxx - self.sx * self.sx
        if self.points < 2 or spread <= 1e-9 * self.n * self.sxx:
            return None
        slope = (self.n * self.sxy - self.sx * self.sy) / spread
        if slope <= 0:
            return None
        return (self.sy - slope * self.sx) / self.n, slope


class SpeedModel:
    """Speech tokens per text token and seconds per speech token (per mode), learnt as they are seen.

    Args:
        min_ratio, max_ratio: the family's speech-per-text token limits (``LLMConfig``); the learnt
            ratio stays inside them.
        ratio: the starting ratio; None: the middle of the limits until one is observed.
        alpha: weight of a new observation in the exponential averages, in (0, 1].
    """

    def __init__(
        self,
        min_ratio: float,
        max_ratio: float,
        ratio: float | None = None,
        alpha: float = DEFAULT_ALPHA,
    ):
        if not 0 < min_ratio <= max_ratio:
            raise ValueError(f"need 0 < min_ratio <= max_ratio, got {min_ratio}, {max_ratio}")
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.min_ratio, self.max_ratio, self.alpha = min_ratio, max_ratio, alpha
        self.ratio = self._clamp(ratio if ratio is not None else (min_ratio + max_ratio) / 2)
        self._ratio_seen = ratio is not None
        self._seconds_per_token: dict[bool, float] = {}  # streaming -> seconds per speech token
        self.overhead_tokens = 0.0
        """Fixed cost of a non-streamed segment, in speech tokens' worth (a short text costs more per
        token): from a least-squares line through segment render times (``observe_segment``)."""
        self._fit = _LineFit(alpha / 3)
        self.confirmed = False
        """True once a throughput was observed on real requests (the warm-up's short text overstates
        the time per token: its fixed costs are spread over few tokens)."""

    def _clamp(self, ratio: float) -> float:
        return min(self.max_ratio, max(self.min_ratio, ratio))

    def known(self, streaming: bool) -> bool:
        """True once the speed of that mode has been measured."""
        return streaming in self._seconds_per_token

    def seconds_per_token(self, streaming: bool) -> float:
        """Seconds of machine time per speech token in that mode; NaN until measured."""
        return self._seconds_per_token.get(streaming, math.nan)

    def speech_tokens(self, text_tokens: float) -> float:
        """Expected speech tokens for that many text tokens."""
        return text_tokens * self.ratio

    def work_tokens(self, speech_tokens: float, streaming: bool, segments: int) -> float:
        """Speech tokens plus the fixed cost of ``segments`` non-streamed segments, in tokens' worth."""
        return speech_tokens + (0.0 if streaming else self.overhead_tokens * segments)

    def seconds(self, speech_tokens: float, streaming: bool, segments: int = 0) -> float:
        """Machine seconds to render that many speech tokens in ``segments`` segments (NaN when the
        mode is not measured)."""
        return self.work_tokens(speech_tokens, streaming, segments) * self.seconds_per_token(streaming)

    def calibrate(
        self, streaming: bool, text_tokens: int, speech_tokens: float, seconds: float, segments: int = 1
    ) -> None:
        """A request measured alone (the warm-up): sets the mode's speed, and the ratio if unseen.

        A later calibration of the same mode is averaged in.
        """
        if speech_tokens <= 0 or seconds <= 0:
            return
        if not streaming and segments == 1:
            self.observe_segment(speech_tokens, seconds)
        self._set_speed(streaming, seconds / self.work_tokens(speech_tokens, streaming, segments))
        self.observe_ratio(text_tokens, speech_tokens)

    def calibrate_alone(self, runs: Sequence[tuple[bool, int, float, float, int]]) -> None:
        """Requests measured alone (the warm-up), each ``(streaming, text_tokens, speech_tokens, seconds,
        segments)``; replaces what a mode's earlier calibration set.

        The one-segment non-streamed runs teach the fixed cost per segment (two lengths give the line).
        Each mode's seconds per token is its longest run's time over its speech tokens, fixed cost
        included: a segment's cost per token grows with its length (attention over the utterance, a
        longer KV cache), so the warm-up's short texts understate long segments by the line's slope
        and overstate them by the shortest text's rate (measured on the tiny CosyVoice2: 2.0 and
        5.4 ms per token where segments of 900-2000 tokens took 3.4-5.0; docs/benchmarks.md).
        """
        for streaming, _, speech_tokens, seconds, segments in runs:
            if not streaming and segments == 1:
                self.observe_segment(speech_tokens, seconds)
        longest: dict[bool, tuple[float, float]] = {}
        for streaming, text_tokens, speech_tokens, seconds, _ in runs:
            if speech_tokens <= 0 or seconds <= 0:
                continue
            self.observe_ratio(text_tokens, speech_tokens)
            if speech_tokens > longest.get(streaming, (0.0, 0.0))[0]:
                longest[streaming] = (speech_tokens, seconds)
        for streaming, (speech_tokens, seconds) in longest.items():
            self._seconds_per_token[streaming] = seconds / speech_tokens

    def observe_segment(self, speech_tokens: float, seconds: float) -> None:
        """A non-streamed segment of ``speech_tokens`` took ``seconds`` to render: refits the fixed
        cost per segment (once segments of different lengths were seen)."""
        if speech_tokens <= 0 or seconds <= 0:
            return
        self._fit.add(speech_tokens, seconds)
        line = self._fit.line()
        if line is not None:
            intercept, slope = line
            self.overhead_tokens = min(_MAX_OVERHEAD_TOKENS, max(0.0, intercept / slope))

    def observe_ratio(self, text_tokens: int, speech_tokens: float) -> None:
        """A finished request spoke ``speech_tokens`` for ``text_tokens``."""
        if text_tokens <= 0 or speech_tokens <= 0:
            return
        seen = self._clamp(speech_tokens / text_tokens)
        self.ratio = seen if not self._ratio_seen else self.ratio + self.alpha * (seen - self.ratio)
        self._ratio_seen = True

    def observe_throughput(self, factor: float) -> None:
        """The machine did the estimated work in ``factor`` times the estimated seconds: every
        measured speed moves towards it (a machine that got busier is slower in every mode)."""
        if not math.isfinite(factor) or factor <= 0:
            return
        factor = min(_FACTOR_RANGE[1], max(_FACTOR_RANGE[0], factor))
        weight = self.alpha if self.confirmed else 1.0  # the first real observation replaces the warm-up's
        for mode, seconds in self._seconds_per_token.items():
            self._seconds_per_token[mode] = seconds * (1 + weight * (factor - 1))
        self.confirmed = True

    def _set_speed(self, streaming: bool, seconds_per_token: float) -> None:
        old = self._seconds_per_token.get(streaming)
        self._seconds_per_token[streaming] = (
            seconds_per_token if old is None else old + self.alpha * (seconds_per_token - old)
        )


MARGIN_RANGE: Final = (0.5, 0.9)
"""Bounds of the learnt margin (``FinishAccuracy``): at most 0.9 however exact the predictions were
(a request may speak longer than any before it), at least 0.5 however late they ran."""
FINISH_SLACK: Final = 0.1
"""Added to the worst over-run seen: a prediction that proved exact still leaves 10 % for what it
has not seen (a machine that gets busier, a text spoken longer)."""
FINISH_HISTORY: Final = 16
"""Completed requests whose prediction accuracy the learnt margin remembers."""


class FinishAccuracy:
    """How late completed requests finished against the finish predicted when they were admitted,
    and the margin of the timeout that this accuracy calls for.

    Each completed request gives ``actual / predicted`` seconds from admission to its end. The margin
    the predictions proved is ``1 / (worst of the last FINISH_HISTORY + FINISH_SLACK)``; with ``n``
    requests seen, the margin used moves from the configured one that far by ``n / (n + 1)`` (one
    request is half the evidence of many), within ``MARGIN_RANGE``. A machine that ran 3 % over its
    predictions thus admits up to 0.84 of a timeout after one request and 0.88 after eight.
    """

    def __init__(self, margin: float, history: int = FINISH_HISTORY):
        self.configured = margin
        self._ratios: deque[float] = deque(maxlen=history)
        self.seen = 0

    def observe(self, predicted_s: float, actual_s: float) -> None:
        """A request predicted to end ``predicted_s`` after its admission ended after ``actual_s``."""
        if not (math.isfinite(predicted_s) and predicted_s > 0 and math.isfinite(actual_s) and actual_s > 0):
            return
        self._ratios.append(actual_s / predicted_s)
        self.seen += 1

    @property
    def worst(self) -> float | None:
        """The largest ``actual / predicted`` remembered; None before any."""
        return max(self._ratios) if self._ratios else None

    def margin(self) -> float:
        """The share of a timeout a predicted finish may use now."""
        worst = self.worst
        if worst is None:
            return self.configured
        proved = 1.0 / (worst + FINISH_SLACK)
        weight = self.seen / (self.seen + 1)
        low, high = MARGIN_RANGE
        return min(high, max(low, self.configured + weight * (proved - self.configured)))
