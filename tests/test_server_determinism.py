"""The server soak of batch-invariant decoding (``trt_cosy.bench.determinism``), bounded: on the tiny
int4 engines (where steps over the active rows only measurably change a row's last bits), 8 texts
with a seed each requested alone (twice whole as WAV; streamed as PCM and as WAV), then 96 requests
at concurrency 8 on a real server on 127.0.0.1, streamed and not: every answer 200 and sample for
sample its alone reference. bench/determinism_soak.py runs the 1,000-request version."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("prometheus_client", reason="the server's metrics need prometheus-client (the [serve] extra)")

from _support import FEATURES_AUDIO, REF_TEXT, reference_wavs, tiny_engines  # noqa: E402

from trt_cosy.bench.determinism import soak_server  # noqa: E402


@pytest.fixture(scope="module")
def int4_engines(tmp_path_factory, v2_tiny_dir):
    from trt_cosy.builder.quantize.engines import derive_engines

    fp32 = tiny_engines(tmp_path_factory, v2_tiny_dir)
    return derive_engines(fp32, tmp_path_factory.mktemp("soak") / "int4", "int4")


@pytest.mark.slow
def test_96_requests_at_concurrency_8_equal_their_alone_answers(int4_engines, tmp_path):
    assert FEATURES_AUDIO.is_dir()
    wav = reference_wavs(tmp_path)["ref"]
    report = soak_server(
        int4_engines, wav, REF_TEXT, requests=96, concurrency=8, deterministic=True, threads=2, seeds=(3,)
    )
    print(report.summary())
    assert report.cases == 8 and not report.alone_mismatch, report.summary()
    assert report.statuses == {200: 96}, report.summary()
    assert report.equal == report.requests == 96 and report.cross_talk == 0, report.summary()
