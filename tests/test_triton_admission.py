"""Admission by expected work in the Triton model, without Triton (``serving.triton_admission``): the
pure parts with a fake engine and clock. The real ``tritonserver`` run is in tests/test_triton.py
(``test_an_overloaded_model_refuses_early_and_finishes_what_it_admitted``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from trt_cosy.server.work_model import WarmupRun
from trt_cosy.serving.triton_admission import AdmissionRefused, PriorityWorkers, TritonWork
from trt_cosy.serving.triton_repo import TritonRepoOptions, model_config


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeEvents:
    def __init__(self):
        self.refusals: list[str] = []
        self.queued_s: list[float] = []
        self.completions: list[tuple[float, float]] = []
        self.ahead: list[float] = []

    def refused(self, reason):
        self.refusals.append(reason)

    def queued(self, seconds):
        self.queued_s.append(seconds)

    def completed(self, estimated_s, actual_s):
        self.completions.append((estimated_s, actual_s))

    def admitted_work(self, seconds):
        self.ahead.append(seconds)


def planned(*segment_tokens: int) -> SimpleNamespace:
    """A stand-in for ``CosyVoice.synthesize``'s iterator: its planned segments on ``.request``."""
    segments = [SimpleNamespace(ids=np.zeros(count, np.int64)) for count in segment_tokens]
    return SimpleNamespace(request=SimpleNamespace(segments=segments, render_priority=None))


def chunk(tokens: float, render_s: float) -> SimpleNamespace:
    return SimpleNamespace(timings={"tokens": tokens, "llm_wait_s": 0.0, "flow_s": render_s, "vocoder_s": 0.0})


@pytest.fixture
def work():
    clock, events = FakeClock(), FakeEvents()
    # The family's ratios (2..20); 10 ms per speech token, 20 speech tokens per text token.
    work = TritonWork(SimpleNamespace(), timeout_s=10.0, events=events, clock=clock)
    work.calibrate([WarmupRun(False, 10, 200.0, 2.0), WarmupRun(True, 10, 200.0, 2.0)])
    return work, clock, events


def test_a_request_that_would_finish_late_is_refused_at_once_with_a_retry_hint(work):
    work, clock, events = work
    first = planned(20)  # 400 speech tokens: 4 s
    ticket = work.admit(first, streaming=False)
    assert first.request.render_priority is not None  # the engine serves it in admission order
    second = work.admit(planned(15), streaming=False)  # 3 s, served first (least work): 3 + 4 = 7 s <= 8
    with pytest.raises(AdmissionRefused) as refused:
        work.admit(planned(20), streaming=False)  # 3 + 4 + 4 = 11 s > 80 % of 10 s
    assert refused.value.code == "UNAVAILABLE" and refused.value.refusal.reason == "overloaded"
    assert "retry in" in str(refused.value) and refused.value.refusal.retry_after_s >= 1
    assert events.refusals == ["overloaded"]

    # The admitted ones run and finish: the speed model learns, the metrics see it.
    for job, tokens in ((second, 300.0), (ticket, 400.0)):
        job.start()
        clock.now += tokens / 100
        job.progress(chunk(tokens, tokens / 100))
        job.close(completed=True)
    assert len(events.completions) == 2 and events.queued_s == [0.0, 3.0]
    assert work.policy.speed.confirmed and work.policy.jobs == []
    ticket.close(completed=True)  # idempotent
    assert len(events.completions) == 2


def test_a_text_that_could_never_finish_names_the_limit_to_raise(work):
    work, clock, events = work
    done = work.admit(planned(10), streaming=False)  # confirm the speed on a real request first
    done.start()
    clock.now += 2.0
    done.progress(chunk(200.0, 2.0))
    done.close(completed=True)
    with pytest.raises(AdmissionRefused) as refused:
        work.admit(planned(80, 80), streaming=False)  # 3200 speech tokens: 32 s alone
    assert refused.value.code == "INVALID_ARG" and refused.value.refusal.reason == "too_long"
    assert "trt-cosy triton-repo --timeout" in str(refused.value) and "send the text in parts" in str(refused.value)
    assert events.refusals == ["too_long"]


def test_a_lone_request_is_admitted_and_untracked_requests_pass(work):
    work, _, _ = work
    work.admit(planned(40), streaming=False, timeout_s=60.0)  # 8 s alone, nothing else: admitted
    untracked = work.admit(SimpleNamespace(), streaming=False)  # a voice conversion: no planned text
    assert untracked.priority == (2, 0, 0)
    disabled = TritonWork(SimpleNamespace(), timeout_s=1.0, enabled=False)
    disabled.admit(planned(1000), streaming=False)  # no refusal when the admission is off


def test_the_request_timeout_is_the_shorter_of_the_model_and_the_client(work):
    work, _, _ = work
    assert work.timeout_for(None) == work.timeout_for(0) == 10.0
    assert work.timeout_for(4_000_000) == 4.0 and work.timeout_for(60_000_000) == 10.0


def test_workers_run_the_queued_tasks_in_priority_order():
    workers = PriorityWorkers(1, "test")
    gate, ran = threading.Event(), []
    workers.submit((0, 0, 0), gate.wait)  # holds the only worker while the rest queue
    for priority in ((1, 9, 3), (1, 2, 5), (0, 0, 7), (1, 2, 4)):
        workers.submit(priority, lambda priority=priority: ran.append(priority))
    workers.submit((0, 0, 1), lambda: 1 / 0)  # a failing task does not stop the worker
    gate.set()
    workers.close(timeout_s=10)
    assert ran == [(0, 0, 7), (1, 2, 4), (1, 2, 5), (1, 9, 3)]


def test_the_repository_ties_triton_queue_policy_to_the_request_timeout(tmp_path):
    options = TritonRepoOptions(request_timeout_s=42.5, max_queue=3, max_concurrent=2)
    config = model_config(tmp_path, "KIND_GPU", options)
    assert (
        "default_queue_policy { max_queue_size: 3 timeout_action: REJECT default_timeout_microseconds: 42500000 "
        "allow_timeout_override: true }" in config
    ), config
    for key, value in (("request_timeout_s", "42.5"), ("max_concurrent", "2"), ("work_admission", "true")):
        assert f'key: "{key}" value: {{ string_value: "{value}" }}' in config, config
    with pytest.raises(Exception, match="request_timeout_s must be positive"):
        TritonRepoOptions(request_timeout_s=0)


def test_a_streamed_request_is_judged_on_its_first_audio(work):
    work, clock, _ = work
    done = work.admit(planned(10), streaming=False)  # confirm the speed on a real request first
    done.start()
    clock.now += 2.0
    done.progress(chunk(200.0, 2.0))
    done.close(completed=True)
    with pytest.raises(AdmissionRefused, match="more than the 10 s request timeout"):
        work.admit(planned(80), streaming=False)  # 1600 speech tokens: 16 s, never within 10 s
    stream = planned(80)  # the same text streamed: its first audio (28 tokens) comes in 0.3 s
    work.admit(stream, streaming=True)
    assert stream.request.render_priority[0] == 0  # the engine renders its chunks before whole requests
