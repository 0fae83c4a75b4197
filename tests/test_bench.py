"""Smoke test of ``trt-cosy bench`` on the golden tiny engines: the report's shape, never its timings.

The tiny engines are built once per session (shared with tests/test_export.py and test_engines.py
through the pytest base temp).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _support import tiny_engines

from trt_cosy.bench.speed import BenchOptions, format_bench, main, run_bench
from trt_cosy.errors import InputError

pytestmark = pytest.mark.slow  # one shared tiny build per session, then a few seconds


@pytest.fixture(scope="module")
def engines(tmp_path_factory, v2_tiny_dir) -> Path:
    return tiny_engines(tmp_path_factory, v2_tiny_dir)


def test_bench_report(engines):
    options = BenchOptions(tokens=32, runs=2, warmup=1, stream=True, cold_start=True, threads=1)
    lines = []
    report = run_bench(engines, options, progress=lines.append)
    assert len(lines) == 4  # 1 warm-up, 2 runs, the cold start
    metrics = report["metrics"]
    # through a Request on the API's stages: a voice's first request and a repeat request
    first_audio = tuple(f"first_audio{kind}_ref{seconds}s" for kind in ("", "_new_voice") for seconds in (3, 5, 10))
    for key in ("llm_prefill_s", "llm_decode_tokens_per_s", "flow_s", "hift_s", "rtf", *first_audio):
        stats = metrics[key]
        assert 0 < stats["min"] <= stats["median"] <= stats["max"], f"{key}: {stats}"
    assert metrics["tokens"]["median"] == 32  # stop tokens are masked: exactly --tokens decoded
    assert metrics["audio_s"]["median"] == pytest.approx(32 * 2 * 480 / 24000)
    assert report["prefill_positions"] == 1 + 16 + 24 + 1 + 50
    assert report["cold_start_s"]["median"] > 0 and report["peak_rss_gb"] > 0
    assert report["precision"] == "fp32" and report["threads"] == 1
    json.dumps(report)  # JSON-ready
    assert "llm_decode_tokens_per_s" in format_bench(report)
    assert "LLM worker" in report["streaming"]


def test_bench_main_writes_json(engines, tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = [
        str(engines),
        "--tokens",
        "30",
        "--runs",
        "1",
        "--warmup",
        "0",
        "--no-cold-start",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["streaming"] == "not measured" and "cold_start_s" not in report
    assert "rtf" in capsys.readouterr().out


def test_bench_rejects_too_few_tokens(engines):
    with pytest.raises(InputError, match="--tokens"):
        run_bench(engines, BenchOptions(tokens=5, cold_start=False))


def test_derived_int4_engines_bench_and_leave_fp32_untouched(engines, tmp_path):
    from trt_cosy.build.quantize import derive_engines
    from trt_cosy.runtime.manifest import Manifest

    before = (engines / "manifest.json").read_bytes()
    batch_before = (engines / "llm_batch.onnx").read_bytes()
    derived = derive_engines(engines, tmp_path / "int4", "int4")
    assert (engines / "manifest.json").read_bytes() == before  # hard links are never written through
    assert (engines / "llm_batch.onnx").read_bytes() == batch_before
    Manifest.read(derived).check(derived, precision="int4")
    # The batched decode graph is derived again from the quantised llm.onnx.
    assert "llm_batch" in Manifest.read(derived).graphs
    assert Manifest.read(derived).nbits_blocks == {"llm": 128, "llm_batch": 128}  # the int4 LLM's blocks
    assert (derived / "llm_batch.onnx").stat().st_size < len(batch_before) / 3
    report = run_bench(derived, BenchOptions(tokens=30, runs=1, warmup=0, cold_start=False, threads=1))
    assert report["precision"] == "int4" and report["metrics"]["tokens"]["median"] == 30


def test_ab_engines_alternates_directories(engines, tmp_path, capsys):
    import importlib.util

    script = Path(__file__).resolve().parents[1] / "bench" / "ab_engines.py"
    spec = importlib.util.spec_from_file_location("ab_engines", script)
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    out = tmp_path / "ab.json"
    assert (
        ab.main(
            [
                str(engines),
                str(engines),
                "--runs",
                "2",
                "--tokens",
                "30",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    runs = json.loads(out.read_text())[str(engines)]
    assert len(runs) == 4  # the same directory twice: 2 timed rounds each
    assert all(run["tokens"] == 30 and run["rtf"] > 0 for run in runs)
    printed = capsys.readouterr().out.splitlines()
    assert [line.split(" ", 1)[0] for line in printed[:2]] == ["warm-up", "warm-up"]


def test_concurrency_bench_report(engines):
    from trt_cosy.bench.concurrency import ConcurrencyOptions, format_concurrency, run_concurrency_bench

    options = ConcurrencyOptions(levels=(1, 2), text="Hi.", runs=1, warmup=0, threads=1, compare_unbatched=True)
    lines = []
    report = run_concurrency_bench(engines, options, progress=lines.append)
    assert len(lines) == 4  # 2 levels x (batched, unbatched)
    assert report["llm_stage"] == {"batched": "BatchedLLMStage", "unbatched": "LLMStage"}
    for level in ("1", "2"):
        for variant in ("batched", "unbatched"):
            summary = report["levels"][level][variant]
            assert len(summary["rounds"][0]["requests"]) == int(level)
            assert summary["aggregate_decode_tokens_per_s"] > 0 and summary["audio_s_per_wall_s"] > 0
            # Over wall seconds nothing is left out: never above the LLM-seconds figure (5 ms polls aside).
            wall = summary["aggregate_decode_tokens_per_wall_s"]
            assert 0 < wall <= 1.05 * summary["aggregate_decode_tokens_per_s"]
            assert 0 < summary["first_audio_p50_s"] <= summary["first_audio_p95_s"]
    assert report["scheduler"]["batched"]["steps"] > 0
    json.dumps(report)
    assert "decode tok/s" in format_concurrency(report)
