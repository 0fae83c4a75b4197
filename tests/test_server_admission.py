"""Admission by expected work on a real server (uvicorn on 127.0.0.1, the tiny ONNX Runtime engines).

The issue's scenario, bounded in time: the timeout is set to 3.5 times one request's time alone, so
two requests fit one after the other (the admission keeps 20 % of the timeout as margin) and the
rest of a burst must be refused at once with 503 + Retry-After instead of all ending in 504. A mix
of short and long requests: every short one completes. A text that could never finish alone gets 413.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from _server_support import assert_error, metric_value, running_server, wait_ready  # noqa: E402
from _support import REF_TEXT, reference_wavs, tiny_engines  # noqa: E402

from trt_cosy import CosyVoice, EngineConfig  # noqa: E402

# One segment of about 20 text tokens: the random tiny model speaks it to its limit (400 speech tokens).
LONG = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog."
SHORT = "Hello."
REFUSED_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def tts(tmp_path_factory, v2_tiny_dir) -> CosyVoice:
    return CosyVoice.load(tiny_engines(tmp_path_factory, v2_tiny_dir), config=EngineConfig(normalizer="none"))


@pytest.fixture(scope="module")
def voices_dir(tmp_path_factory, tts) -> Path:
    folder = tmp_path_factory.mktemp("admission-voices")
    wavs = reference_wavs(tmp_path_factory.mktemp("admission-wavs"))
    tts.voice_from_wav(wavs["ref"], REF_TEXT).save(folder / "alice.npz")
    return folder


def _alone_s(tts: CosyVoice, voices_dir: Path, text: str) -> float:
    from trt_cosy.frontend.voice import Voice

    voice = Voice.load(voices_dir / "alice.npz")
    started = time.perf_counter()
    for _ in tts.synthesize(text, voice, 0):
        pass
    return time.perf_counter() - started


def _post(url: str, text: str, seed: int, timeout_s: float) -> tuple[httpx.Response, float]:
    started = time.perf_counter()
    response = httpx.post(
        url + "/tts", json={"text": text, "voice": "alice", "seed": seed}, timeout=timeout_s
    )
    return response, time.perf_counter() - started


def test_a_burst_of_long_requests_completes_two_and_refuses_the_rest_at_once(tts, voices_dir, caplog):
    alone_s = _alone_s(tts, voices_dir, LONG)
    timeout_s = max(5.0, 3.5 * alone_s)
    caplog.set_level(logging.INFO, logger="trt_cosy.server.access_log")
    with running_server(tts, voices_dir, max_concurrent=8, max_queue=8, request_timeout_s=timeout_s) as url:
        wait_ready(url)
        solo, _ = _post(url, LONG, 0, 4 * timeout_s)  # teaches the server its speed on a real request
        assert solo.status_code == 200, solo.text
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(lambda seed: _post(url, LONG, seed, 4 * timeout_s), range(1, 7)))
        statuses = [response.status_code for response, _ in results]
        assert 504 not in statuses, statuses
        done = [response for response, _ in results if response.status_code == 200]
        assert len(done) >= 2, (statuses, alone_s, timeout_s)
        assert all(len(response.content) == len(solo.content) for response in done)  # the full audio
        refused = [(response, seconds) for response, seconds in results if response.status_code != 200]
        assert refused, f"all 6 fitted in {timeout_s:.1f} s: {statuses}"
        for response, seconds in refused:
            assert_error(response, 503, "server_overloaded")
            assert int(response.headers["retry-after"]) >= 1
            assert seconds < REFUSED_WITHIN_S, seconds
        # Never finishable alone (80 times the work of one request): 413, naming the limit to raise.
        started = time.perf_counter()
        response = httpx.post(url + "/tts", json={"text": LONG * 40, "voice": "alice"}, timeout=30)
        error = assert_error(response, 413, "input_too_long_for_timeout")
        assert "--timeout" in error["message"] and time.perf_counter() - started < REFUSED_WITHIN_S
        metrics = httpx.get(url + "/metrics").text
    assert metric_value(metrics, "trt_cosy_admission_refused_total", reason="overloaded") == len(refused)
    assert metric_value(metrics, "trt_cosy_admission_refused_total", reason="too_long") == 1
    assert metric_value(metrics, "trt_cosy_queue_seconds_count") == 1 + len(done)
    assert metric_value(metrics, "trt_cosy_work_estimated_seconds_count") == 1 + len(done)
    assert metric_value(metrics, "trt_cosy_seconds_per_speech_token", mode="whole") > 0
    lines = [record.getMessage() for record in caplog.records if record.name == "trt_cosy.server.access_log"]
    assert sum(" 503 " in line and "refused: overloaded" in line for line in lines) == len(refused), lines
    assert any(" 413 " in line and "refused: too_long" in line for line in lines), lines


@pytest.mark.slow
def test_short_requests_among_long_ones_all_complete(tts, voices_dir):
    """Long requests fill the server (two fit, the third is refused); every short one still completes:
    its first (only) chunk goes before the long ones' and fits in their margin."""
    alone_s = _alone_s(tts, voices_dir, LONG)
    timeout_s = max(5.0, 3.5 * alone_s)
    with running_server(tts, voices_dir, max_concurrent=8, max_queue=16, request_timeout_s=timeout_s) as url:
        wait_ready(url)
        assert _post(url, LONG, 0, 4 * timeout_s)[0].status_code == 200

        def ask(item: tuple[int, str]) -> tuple[httpx.Response, float]:
            time.sleep(0.1 * item[0])  # arrivals in this order
            return _post(url, item[1], item[0], 4 * timeout_s)

        texts = [LONG, SHORT, LONG, SHORT, LONG, SHORT, SHORT]
        with ThreadPoolExecutor(len(texts)) as pool:
            results = list(pool.map(ask, enumerate(texts)))
    statuses = [response.status_code for response, _ in results]
    assert 504 not in statuses, statuses
    assert all(status == 200 for text, status in zip(texts, statuses, strict=True) if text == SHORT), statuses
    assert all(status in (200, 503) for status in statuses), statuses


def test_server_work_refuses_with_headers_reason_and_metrics_and_orders_the_admitted(tmp_path):
    """The server glue on a fake clock: warm-up calibration, 503 + Retry-After, the access-log reason,
    the refusal counter, and the render priority given to an admitted request."""
    from types import SimpleNamespace

    import numpy as np
    from prometheus_client import generate_latest

    from trt_cosy.server import ServerSettings
    from trt_cosy.server.access_log import REASON_KEY
    from trt_cosy.server.errors import APIError
    from trt_cosy.server.metrics import Metrics
    from trt_cosy.server.work_admission import ServerWork, WarmupRun

    now = [0.0]
    metrics = Metrics()
    settings = ServerSettings(voices_dir=tmp_path, request_timeout_s=100.0)
    work = ServerWork(SimpleNamespace(), settings, metrics, clock=lambda: now[0])
    work.calibrate([WarmupRun(False, 10, 200, 2.0)])  # 20 per text token, 10 ms per token
    work.policy.speed.confirmed = True

    def planned(text_tokens: int):
        segments = [SimpleNamespace(ids=np.zeros(text_tokens, np.int64))]
        return SimpleNamespace(request=SimpleNamespace(segments=segments, render_priority=None))

    chunks = [planned(200) for _ in range(3)]  # 4000 tokens: 40 s each, two fit in 80 s
    tickets = [work.admit({}, item, False, 100.0) for item in chunks[:2]]
    assert [item.request.render_priority for item in chunks[:2]] == [(1, 4000, 0), (1, 4000, 1)]
    scope: dict = {}
    with pytest.raises(APIError) as refused:
        work.admit(scope, chunks[2], False, 100.0)
    assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "40"
    assert scope[REASON_KEY].startswith("refused: overloaded")
    exposition = generate_latest(metrics.registry).decode()
    assert metric_value(exposition, "trt_cosy_admission_refused_total", reason="overloaded") == 1
    tickets[0].start()
    now[0] = 40.0
    tickets[0].progress(SimpleNamespace(timings={"tokens": 4000.0}, is_last=True))
    tickets[0].close(completed=True)
    assert work.admit({}, chunks[2], False, 100.0) is not None  # room again


def test_conversions_are_admitted_by_their_source_tokens_and_teach_nothing(tmp_path):
    """A voice conversion's work is its source's speech tokens (25 per second here, no LLM): admitted
    beside the syntheses, refused with 503 + Retry-After when it would not finish in time and with 413
    when it never could; a finished conversion leaves the speed model as it was."""
    from types import SimpleNamespace

    import numpy as np

    from trt_cosy.server import ServerSettings
    from trt_cosy.server.access_log import REASON_KEY
    from trt_cosy.server.errors import APIError
    from trt_cosy.server.metrics import Metrics
    from trt_cosy.server.work_admission import ServerWork, WarmupRun

    now = [0.0]
    settings = ServerSettings(voices_dir=tmp_path, request_timeout_s=100.0)
    work = ServerWork(SimpleNamespace(), settings, Metrics(), clock=lambda: now[0])
    work.calibrate([WarmupRun(False, 10, 200, 2.0)])  # 10 ms per speech token
    work.policy.speed.confirmed = True
    speed = work.policy.speed
    seconds_per_token, ratio = speed.seconds_per_token(False), speed.ratio
    planned = SimpleNamespace(
        request=SimpleNamespace(segments=[SimpleNamespace(ids=np.zeros(200, np.int64))], render_priority=None)
    )
    synthesis = work.admit({}, planned, False, 100.0)  # 4000 tokens: 40 s
    conversion = work.admit_conversion({}, 160.0, False, 100.0)  # 160 s of source: 4000 tokens, 40 s
    assert [round(job.total_tokens) for job in work.policy.jobs] == [4000, 4000]
    scope: dict = {}
    with pytest.raises(APIError) as busy:
        work.admit_conversion(scope, 80.0, False, 100.0)  # 20 s more would end after the timeout's margin
    assert busy.value.status == 503 and int(busy.value.headers["Retry-After"]) > 0
    assert scope[REASON_KEY].startswith("refused: overloaded")
    with pytest.raises(APIError) as never:
        work.admit_conversion({}, 1000.0, False, 100.0)  # 250 s alone: never within 100 s
    assert never.value.status == 413 and "--timeout" in never.value.message
    conversion.start()
    now[0] = 30.0
    conversion.progress(SimpleNamespace(timings={"tokens": 4000.0}, is_last=True))
    conversion.close(completed=True)
    assert (speed.seconds_per_token(False), speed.ratio) == (seconds_per_token, ratio)  # taught nothing
    synthesis.close(completed=False)
    assert work.policy.jobs == []
    assert work.admit_conversion({}, 80.0, False, 100.0) is not None  # room again
