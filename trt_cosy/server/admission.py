"""Admission by expected work: refuse at once what cannot finish within its timeout.

A server that admits every request shares its cores among all of them, and when their total work
exceeds what the timeout allows, every one of them times out after doing part of its work. This
policy instead estimates each request's work before it starts and admits it only when it can finish
in time given the work already admitted, in the order the engine serves it. It is pure: no server,
no engine, the clock passed in, so the HTTP server, the Triton model and the Ray Serve deployment
share it (and tests drive it with fake clocks and speeds).

The work model (``server.speed_model.SpeedModel``):

- **Speech tokens** of a request: its text tokens times the family's speech-per-text ratio. The
  LLM's length limits are ``min_token_text_ratio`` (2) and ``max_token_text_ratio`` (20) times the
  text tokens (``stages.llm.LLMStage.length_limits``); where in that range a model stops is learnt,
  from the warm-up and then as an exponential average over finished requests.
- **Seconds per speech token** on this machine, per mode (a streamed request reruns the flow per
  chunk and costs more per token), measured at warm-up and kept up to date from the machine's
  throughput: between two completed requests, the time the machine was busy (at least one request
  running) over the estimated seconds of the tokens produced meanwhile; the first such observation
  replaces the warm-up's estimate, later ones move it by an exponential average.

The order it predicts (``WorkOrder``), which the engine follows (``runtime.render_turns`` with the
request's ``render_priority``): first chunks of streamed requests (time to first audio), shortest
first; then their later chunks, first admitted first (keeping up); then non-streamed requests one at
a time, least expected work first, then first admitted first. Requests thus finish one after the
other instead of all slowing down together, a short request is not stuck behind a long one, and the
rule below keeps it from making an admitted long request late. The heavy stages (flow + vocoder) run one request at a
time in that order, so requests finish one after the other instead of all slowing down together.

The rule (``WorkAdmission.admit``):

- a non-streamed request whose expected work alone exceeds its timeout is refused as never
  finishable (413, ``too_long``), naming the limit to raise, once the speed has been confirmed on
  real requests (until then only the warm-up's estimate, high for long texts, is known: such a
  request is admitted when nothing else runs, else refused with 503);
- otherwise, with other work admitted, it is admitted when its predicted finish is within
  the margin of its timeout (``WorkAdmission.margin_now``: the configured ``margin`` until requests
  have completed, then moving towards what their predicted finishes proved: ``FinishAccuracy``) and
  no admitted request that was on time (within ``others_margin`` of its timeout) becomes late
  because of it;
  else 503 (``overloaded``) with a ``Retry-After`` of the seconds the queue needs to drain enough;
- a streamed request is judged on its time to first audio (the same rule, on the first chunk) and
  on keeping up: the streams running together must need at most the machine's real-time capacity
  (``cannot_keep_up``), unless it is the only stream (checked once the speed is confirmed).

A lone request on an idle server is never refused unless its expected work alone exceeds the timeout.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from .speed_model import DEFAULT_ALPHA, MARGIN_RANGE, FinishAccuracy, SpeedModel

__all__ = [
    "SpeedModel",
    "AdmittedJob",
    "Refusal",
    "WorkAdmission",
    "WorkOrder",
    "render_priority",
    "DEFAULT_MARGIN",
    "DEFAULT_OTHERS_MARGIN",
    "DEFAULT_ALPHA",
    "FinishAccuracy",
    "MARGIN_RANGE",
]

_LOGGER = logging.getLogger(__name__)

DEFAULT_MARGIN: Final = 0.8
"""Share of a request's timeout that its predicted finish may use when other work is admitted:
the rest absorbs estimation errors (a machine slower than measured, a model that speaks longer)."""
DEFAULT_OTHERS_MARGIN: Final = 0.95
"""Share of an admitted request's timeout that later, shorter requests served before it may push
its predicted finish to: they use the estimation margin of the long requests admitted before them
(so that short requests keep completing while long ones fill the server), not all of it."""


@dataclass(eq=False)
class AdmittedJob:
    """One admitted request, as the policy tracks it (``WorkAdmission.admit`` makes them)."""

    number: int
    """Admission order, from 0: the engine serves lower numbers first (``render_priority``)."""
    streaming: bool
    text_tokens: int
    first_tokens: float
    """Expected work until first audio (the first segment, or a streamed request's first chunk), in
    speech tokens' worth."""
    total_tokens: float
    """Expected work of the whole request, in speech tokens' worth (``SpeedModel.work_tokens``)."""
    admitted_at: float
    deadline: float
    estimated_s: float
    """Expected machine seconds of the whole request when it was admitted (NaN: speed not measured)."""
    predicted_s: float = math.nan
    """Seconds from admission to its end that were predicted when it was admitted, in the order the
    engine serves (non-streamed requests; NaN: streamed, or the speed not confirmed yet)."""
    produced: float = 0.0
    """Work done so far, in speech tokens' worth (its chunks' tokens and segment costs)."""
    speech_tokens: float = 0.0
    """Speech tokens produced so far."""
    first_done: bool = False
    started_at: float | None = None
    """When it started running (it may first wait for a slot: ``queue_s``)."""
    work_s: float = 0.0
    """Machine seconds attributed to it so far: the busy time shared among the running requests."""
    finished: bool = False
    teaches: bool = True
    """Whether its completion teaches the speed model (a text-to-speech request; not a conversion, whose
    work per speech token has no LLM decode in it)."""

    @property
    def queue_s(self) -> float | None:
        """Seconds from admission to start; None while it waits."""
        return None if self.started_at is None else self.started_at - self.admitted_at


@dataclass(frozen=True)
class Refusal:
    """Why a request is not admitted, and what the client should do."""

    status: int
    """413: it could never finish within the timeout here; 503: not now (retry after ``retry_after_s``)."""
    reason: str
    """``too_long``, ``overloaded`` or ``cannot_keep_up``."""
    message: str
    retry_after_s: int | None = None
    estimated_s: float = math.nan


@dataclass
class _Remaining:
    first_s: float
    rest_s: float


@dataclass
class WorkOrder:
    """Predicted times of admitted jobs in the engine's order (a fluid model: the machine works on one
    thing at a time at the measured speed; ``render_priority`` gives the engine the same order).

    First chunks of streamed requests, shortest first; then the rest of streamed requests in admission
    order; then non-streamed requests whole (their audio is sent when complete, so a first chunk gains
    them nothing), least expected work first, then in admission order.
    """

    first_audio: dict[int, float] = field(default_factory=dict)
    """Job number -> seconds from now to its first audio (streamed jobs still waiting for it)."""
    finish: dict[int, float] = field(default_factory=dict)
    """Job number -> seconds from now until it is complete."""

    @classmethod
    def predict(
        cls, jobs: Sequence[AdmittedJob], remaining: Callable[[AdmittedJob], _Remaining]
    ) -> WorkOrder:
        order = cls()
        parts = {job.number: remaining(job) for job in jobs}
        streams = sorted((job for job in jobs if job.streaming), key=lambda job: job.number)
        elapsed = 0.0
        for job in sorted(streams, key=lambda job: (job.first_tokens, job.number)):
            if not job.first_done:
                elapsed += parts[job.number].first_s
                order.first_audio[job.number] = elapsed
        for job in streams:
            elapsed += parts[job.number].rest_s
            order.finish[job.number] = max(elapsed, order.first_audio.get(job.number, 0.0))
        for job in sorted((job for job in jobs if not job.streaming), key=render_rank):
            elapsed += parts[job.number].first_s + parts[job.number].rest_s
            order.finish[job.number] = elapsed
        return order


def render_rank(job: AdmittedJob) -> tuple[int, int]:
    """A non-streamed job's place among the others: least expected work first, then admission order."""
    return round(job.total_tokens), job.number


def render_priority(job: AdmittedJob) -> tuple[int, int, int]:
    """``Request.render_priority`` for the job (``runtime.render_turns``): (0 streamed / 1 not, rank)."""
    if job.streaming:
        return 0, 0, job.number
    return (1, *render_rank(job))


class WorkAdmission:
    """Admission by expected work (see the module doc). Not thread-safe: call it from one thread
    (a server's event loop) or under a lock.

    Args:
        speed: the work model, shared with whoever calibrates it.
        margin: share of the timeout a new request's predicted finish may use when other work is
            admitted, in (0, 1].
        others_margin: share of their timeouts that admitted requests may be pushed to by a new one
            served before them (a shorter first chunk), >= ``margin``.
        tokens_per_audio_s: speech tokens per second of audio (the family's ``token_frame_rate``):
            a stream keeps up while it gets that many tokens rendered per second.
        stream_first_tokens: speech tokens of a streamed request's first chunk (the first hop plus
            look-ahead: 25 + 3 for CosyVoice2).
        clock: monotonic seconds (``time.monotonic``); tests pass a fake.
        timeout_setting: where the request timeout is raised, named in a ``too_long`` refusal.
    """

    def __init__(
        self,
        speed: SpeedModel,
        margin: float = DEFAULT_MARGIN,
        others_margin: float = DEFAULT_OTHERS_MARGIN,
        tokens_per_audio_s: float = 25.0,
        stream_first_tokens: float = 28.0,
        clock: Callable[[], float] = time.monotonic,
        timeout_setting: str = "trt-cosy serve --timeout",
    ):
        if not 0 < margin <= 1:
            raise ValueError(f"margin must be in (0, 1], got {margin}")
        self.speed = speed
        self.margin = margin
        self.accuracy = FinishAccuracy(margin)
        self.others_margin = max(margin, others_margin)
        self.tokens_per_audio_s = tokens_per_audio_s
        self.stream_first_tokens = stream_first_tokens
        self._clock = clock
        self.timeout_setting = timeout_setting
        self._numbers = itertools.count()
        self._jobs: dict[int, AdmittedJob] = {}
        self._last = clock()
        self._window_busy_s = 0.0
        self._window_estimated_s = 0.0

    # ------------------------------------------------------------------ queries

    @property
    def jobs(self) -> list[AdmittedJob]:
        """The admitted jobs not finished yet, in admission order."""
        return sorted(self._jobs.values(), key=lambda job: job.number)

    def margin_now(self) -> float:
        """The share of its timeout a new request's predicted finish may use now (``FinishAccuracy``)."""
        return self.accuracy.margin()

    def work_ahead_s(self) -> float:
        """Expected machine seconds of the admitted work still to do."""
        self._advance()
        total = 0.0
        for job in self._jobs.values():
            parts = self._remaining(job)
            total += parts.first_s + parts.rest_s
        return total

    def estimate(self, segment_tokens: Sequence[int], streaming: bool) -> tuple[float, float, float]:
        """(work until first audio, work in all, machine seconds) expected for a request; work in
        speech tokens' worth (``SpeedModel.work_tokens``)."""
        speed = self.speed
        total = speed.work_tokens(speed.speech_tokens(sum(segment_tokens)), streaming, len(segment_tokens))
        first = (
            speed.work_tokens(speed.speech_tokens(segment_tokens[0]), streaming, 1) if segment_tokens else 0.0
        )
        if streaming:
            first = min(first, self.stream_first_tokens)
        return first, total, total * speed.seconds_per_token(streaming)

    # ------------------------------------------------------------------ decisions

    def admit(
        self, segment_tokens: Sequence[int], streaming: bool, timeout_s: float
    ) -> AdmittedJob | Refusal:
        """Admit a request of those text tokens per segment, or say why not.

        Args:
            segment_tokens: text tokens of each segment the request will speak, in order.
            streaming: audio is sent as it is made (judged on first audio and keeping up).
            timeout_s: the time the request has left from now.
        """
        self._advance()
        now = self._clock()
        first, total, estimated = self.estimate(segment_tokens, streaming)
        job = AdmittedJob(
            number=-1,
            streaming=streaming,
            text_tokens=int(sum(segment_tokens)),
            first_tokens=first,
            total_tokens=total,
            admitted_at=now,
            deadline=now + timeout_s,
            estimated_s=estimated,
        )
        return self._decide(job, timeout_s)

    def admit_speech(self, speech_tokens: float, streaming: bool, timeout_s: float) -> AdmittedJob | Refusal:
        """Admit a request whose speech tokens are known (a voice conversion: the source's tokens, no LLM),
        or say why not. Judged as a synthesis of those tokens (an upper bound: it skips the LLM decode);
        its completion teaches the speed model nothing."""
        self._advance()
        now = self._clock()
        speed = self.speed
        total = speed.work_tokens(max(0.0, speech_tokens), streaming, 1)
        first = min(total, self.stream_first_tokens) if streaming else total
        estimated = total * speed.seconds_per_token(streaming)
        job = AdmittedJob(-1, streaming, 0, first, total, now, now + timeout_s, estimated, teaches=False)
        return self._decide(job, timeout_s)

    def _decide(self, job: AdmittedJob, timeout_s: float) -> AdmittedJob | Refusal:
        if not self.speed.known(job.streaming):  # nothing measured yet (no warm-up): admit, learn
            return self._enter(job)
        refusal = self._judge(job, timeout_s)
        if refusal is not None:
            return refusal
        return self._enter(job)

    def _judge(self, job: AdmittedJob, timeout_s: float) -> Refusal | None:
        parts = self._remaining(job)
        seconds_per_token = self.speed.seconds_per_token(job.streaming)
        alone = parts.first_s if job.streaming else parts.first_s + parts.rest_s
        others = [other for other in self._jobs.values() if not other.finished]
        if alone > timeout_s and (self.speed.confirmed or others):
            if not self.speed.confirmed:  # only the warm-up's (high) estimate: not a "never"
                return Refusal(
                    503,
                    "overloaded",
                    f"the server is busy and this text is expected to take about {alone:.0f} s; "
                    "retry when it is idle or on another replica.",
                    retry_after_s=max(1, math.ceil(self.work_ahead_s())),
                    estimated_s=job.estimated_s,
                )
            what = "first audio" if job.streaming else "synthesis"
            return Refusal(
                413,
                "too_long",
                f"this text is expected to take about {alone:.0f} s of {what} on this server "
                f"({job.text_tokens} text tokens, about {self.speed.speech_tokens(job.text_tokens):.0f} "
                f"speech tokens at {seconds_per_token * 1000:.1f} ms each), more than the {timeout_s:.0f} s request "
                "timeout even with nothing else running; send the text in parts, or raise the server's "
                f"request timeout ({self.timeout_setting}).",
                estimated_s=job.estimated_s,
            )
        if not others:
            self._predicted(job, alone)
            return None
        if job.streaming and self.speed.confirmed:  # the warm-up's streamed pass also opens a session
            refusal = self._keep_up(job, others)
            if refusal is not None:
                return refusal
        now = self._clock()
        before = WorkOrder.predict(others, self._remaining)
        job.number = next(self._numbers)
        after = WorkOrder.predict([*others, job], self._remaining)
        own_s = after.first_audio.get(job.number, 0.0) if job.streaming else after.finish[job.number]
        margin = self.margin_now()
        budget = margin * timeout_s
        waits = []
        if own_s > budget:
            waits.append(own_s - budget)
        for other in others:  # no request on time becomes late because of this one
            left = max(margin, self.others_margin) * (other.deadline - other.admitted_at) - (
                now - other.admitted_at
            )
            if other.streaming:
                was, now_s = before.first_audio.get(other.number), after.first_audio.get(other.number)
            else:
                was, now_s = before.finish.get(other.number), after.finish.get(other.number)
            if was is not None and now_s is not None and was <= left < now_s:
                waits.append(was)  # after it is done, it is no longer delayed
        if not waits:
            self._predicted(job, own_s)
            return None
        retry = max(1, math.ceil(max(waits)))
        what = "its first audio" if job.streaming else "it"
        return Refusal(
            503,
            "overloaded",
            f"the server has about {self.work_ahead_s():.0f} s of admitted work; {what} would not be done "
            f"within the {timeout_s:.0f} s request timeout; retry in {retry} s or on another replica.",
            retry_after_s=retry,
            estimated_s=job.estimated_s,
        )

    def _predicted(self, job: AdmittedJob, finish_s: float) -> None:
        """Keep the finish predicted for an admitted non-streamed job, to learn the margin from
        (``FinishAccuracy``): only a prediction from a confirmed speed (the warm-up's is replaced by
        the first real observation, so its error says nothing of the predictions that follow)."""
        if not job.streaming and self.speed.confirmed:
            job.predicted_s = finish_s

    def _keep_up(self, job: AdmittedJob, others: list[AdmittedJob]) -> Refusal | None:
        streams = [other for other in others if other.streaming]
        if not streams:
            return None
        real_time = self.speed.seconds_per_token(True) * self.tokens_per_audio_s  # machine s per audio s
        if real_time * (len(streams) + 1) <= 1.0:
            return None
        # The first stream to end frees its share: its audio left, played in real time at best.
        left_s = (
            min(max(0.0, other.total_tokens - other.speech_tokens) for other in streams)
            / self.tokens_per_audio_s
        )
        retry = max(1, math.ceil(left_s))
        return Refusal(
            503,
            "cannot_keep_up",
            f"{len(streams)} stream(s) already use this server's real-time capacity (each needs "
            f"{real_time:.2f} s of work per second of audio); retry in {retry} s or on another replica.",
            retry_after_s=retry,
            estimated_s=job.estimated_s,
        )

    def _enter(self, job: AdmittedJob) -> AdmittedJob:
        if job.number < 0:
            job.number = next(self._numbers)
        self._jobs[job.number] = job
        return job

    # ------------------------------------------------------------------ progress

    def start(self, job: AdmittedJob) -> None:
        """The job got its slot and runs now."""
        self._advance()
        if job.started_at is None:
            job.started_at = self._clock()

    def progress(
        self,
        job: AdmittedJob,
        speech_tokens: float,
        segment_done: bool = False,
        render_s: float | None = None,
    ) -> None:
        """The job produced a chunk of ``speech_tokens`` (its first audio, at the first call).

        ``segment_done``: the chunk ends a segment; ``render_s``: the seconds it took (a non-streamed
        segment's time teaches the fixed cost per segment).
        """
        self._advance()
        speech_tokens = max(0.0, speech_tokens)
        segments = 1 if segment_done else 0
        work = self.speed.work_tokens(speech_tokens, job.streaming, segments)
        job.produced += work
        job.speech_tokens += speech_tokens
        job.first_done = True
        if self.speed.known(job.streaming) and job.teaches:
            self._window_estimated_s += work * self.speed.seconds_per_token(job.streaming)
        if not job.streaming and segment_done and render_s is not None:
            self.speed.observe_segment(speech_tokens, render_s)

    def finish(self, job: AdmittedJob, completed: bool) -> None:
        """The job ended: ``completed`` (all its audio) or stopped early (timeout, client gone, error).

        A completed job teaches the model its speech-per-text ratio and, with the work since the last
        completion, the machine's speed. Idempotent.
        """
        if job.finished:
            return
        self._advance()
        job.finished = True
        self._jobs.pop(job.number, None)
        if not completed or job.speech_tokens <= 0 or not job.teaches:
            return
        self.accuracy.observe(job.predicted_s, self._clock() - job.admitted_at)
        self.speed.observe_ratio(job.text_tokens, job.speech_tokens)
        if not self.speed.known(job.streaming):
            if job.work_s > 0:
                self.speed.calibrate(job.streaming, job.text_tokens, job.speech_tokens, job.work_s, 0)
                self.speed.confirmed = True
            self._window_busy_s = self._window_estimated_s = 0.0
            return
        if self._window_estimated_s > 0 and self._window_busy_s > 0:
            self.speed.observe_throughput(self._window_busy_s / self._window_estimated_s)
        self._window_busy_s = self._window_estimated_s = 0.0

    # ------------------------------------------------------------------ internals

    def _advance(self) -> None:
        """Account the time since the last event: busy time, and each running job's share of it."""
        now = self._clock()
        elapsed, self._last = max(0.0, now - self._last), now
        running = [job for job in self._jobs.values() if job.started_at is not None]
        if running and elapsed > 0:
            self._window_busy_s += elapsed
            for job in running:
                job.work_s += elapsed / len(running)

    def _remaining(self, job: AdmittedJob) -> _Remaining:
        if not self.speed.known(job.streaming):
            return _Remaining(0.0, 0.0)
        seconds = self.speed.seconds_per_token(job.streaming)
        # Done: the tokens it produced, or the machine time it had (a long chunk reports at its end).
        done = max(job.produced, job.work_s / seconds if seconds > 0 else 0.0)
        left = max(0.0, job.total_tokens - done)
        first = 0.0 if job.first_done else min(left, max(0.0, job.first_tokens - done))
        return _Remaining(first * seconds, (left - first) * seconds)
