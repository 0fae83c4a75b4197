"""Smoke test of ``trt-cosy bench`` on the golden tiny engines: the report's shape, never its timings.

The tiny engines are built once per session (shared with tests/test_export.py and test_engines.py
through the pytest base temp).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _support import tiny_engines

from trt_cosy.bench.listening import BREAKDOWN_PARTS
from trt_cosy.bench.speed import BenchOptions, format_bench, main, run_bench
from trt_cosy.errors import InputError

pytestmark = pytest.mark.slow  # one shared tiny build per session, then a few seconds


@pytest.fixture(scope="module")
def engines(tmp_path_factory, v2_tiny_dir) -> Path:
    return tiny_engines(tmp_path_factory, v2_tiny_dir)


def test_bench_report(engines):
    options = BenchOptions(tokens=32, runs=2, warmup=1, stream=True, cold_start=True, threads=1, listen_tokens=100)
    lines = []
    report = run_bench(engines, options, progress=lines.append)
    assert len(lines) == 7  # 1 warm-up and 2 runs without streaming, then streaming, then the cold start
    assert [line.split(":")[0] for line in lines[:6]] == [
        "warm-up", "run 1/2", "run 2/2", "streaming warm-up", "streaming run 1/2", "streaming run 2/2"
    ]
    metrics = report["metrics"]
    # through a Request on the API's stages: a voice's first request and a repeat request
    first_audio = tuple(f"first_audio{kind}_ref{seconds}s" for kind in ("", "_new_voice") for seconds in (3, 5, 10))
    for key in ("llm_prefill_s", "llm_decode_tokens_per_s", "flow_s", "hift_s", "rtf", *first_audio):
        stats = metrics[key]
        assert 0 < stats["min"] <= stats["median"] <= stats["max"], f"{key}: {stats}"
    assert metrics["tokens"]["median"] == 32  # stop tokens are masked: exactly --tokens decoded
    for seconds in (3, 5, 10):  # the known voice's first chunk, part by part: the parts make the whole
        parts = [metrics[f"first_chunk_ref{seconds}s_{part}"]["median"] for part in BREAKDOWN_PARTS]
        assert min(parts[:2] + parts[3:]) > 0 and parts[2] > -1e-3  # waiting: what is left, never much below 0
        runs = report["runs"]
        for run in runs:
            total = sum(run[f"first_chunk_ref{seconds}s_{part}"] for part in BREAKDOWN_PARTS)
            assert total == pytest.approx(run[f"first_audio_ref{seconds}s"], abs=0.02)
    listen = "listen_4s_ref5s"  # a 4 s answer (100 tokens) heard by a real-time player
    assert 0 < metrics[f"{listen}_first_audio_s"]["median"]
    for run in report["runs"]:
        assert 0 <= run[f"{listen}_stall_longest_s"] <= run[f"{listen}_stall_total_s"]
        assert (run[f"{listen}_stalls"] == 0) == (run[f"{listen}_stall_total_s"] == 0)
    assert metrics["audio_s"]["median"] == pytest.approx(32 * 2 * 480 / 24000)
    assert report["prefill_positions"] == 1 + 16 + 24 + 1 + 50
    assert report["cold_start_s"]["median"] > 0 and report["peak_rss_gb"] > 0
    assert report["precision"] == "fp32" and report["threads"] == 1
    json.dumps(report)  # JSON-ready
    assert "llm_decode_tokens_per_s" in format_bench(report)
    assert format_bench(report).splitlines()[0].startswith(f"cpu {report['machine']['cpu']}, ")  # model, flags
    assert "LLM worker" in report["streaming"]


def _incremental_bytes_per_frame(engines: Path) -> int:
    from trt_cosy.runtime.engines import load_engines
    from trt_cosy.stages.flow_incremental import FlowCache

    config = load_engines(engines, threads=1).config.flow
    return FlowCache(config.estimator, config.cfm.n_timesteps).bytes_per_frame


def test_bench_reports_streaming_memory_apart(engines):
    """Peak RSS of the non-streaming runs and of the streaming rounds, and what the streaming state holds."""
    from trt_cosy.runtime.manifest import Manifest

    assert "flow_estimator_incremental" in Manifest.read(engines).graphs  # the tiny build has it
    options = BenchOptions(tokens=32, runs=1, warmup=0, stream=True, cold_start=False, threads=1, listen_tokens=0)
    report = run_bench(engines, options)
    assert 0 < report["peak_rss_gb"] and 0 < report["rss_before_stream_gb"] <= report["peak_rss_stream_gb"]
    assert report["peak_rss_stream_scope"] == "streaming rounds"  # Linux: the peak restarts there
    memory = report["stream_memory"]
    assert list(memory) == ["ref3s", "ref5s", "ref10s"]
    per_frame = _incremental_bytes_per_frame(engines) / 2**20
    for seconds in (3, 5, 10):
        entry = memory[f"ref{seconds}s"]
        # the first chunk's cache holds at least the voice's prompt frames; one voice's prefix is kept
        assert entry["flow_cache_mib"] >= 0.9 * 50 * seconds * per_frame, entry
        assert 0 < entry["voice_prefixes_mib"] < entry["flow_cache_mib"], entry
        assert entry["peak_rss_gb"] <= report["peak_rss_stream_gb"]
    assert memory["ref10s"]["voice_prefixes_mib"] > memory["ref3s"]["voice_prefixes_mib"]
    text = format_bench(report)
    assert "peak_rss_stream_gb" in text and "ref10s: peak" in text


def test_bench_holds_one_set_of_sessions(engines):
    """The timed stages are the API's: with the batched decode graph the per-request LLM graph is never
    created, and the streaming rounds reuse the stages the non-streaming runs timed."""
    import numpy as np

    from trt_cosy.bench import speed
    from trt_cosy.runtime.engines import load_engines
    from trt_cosy.stages.llm_batch import BatchedLLMStage

    model = load_engines(engines, threads=1)
    stages = speed._Stages(model)
    assert isinstance(stages.llm, BatchedLLMStage)
    assert stages.llm is stages.api.llm and stages.flow is stages.api.flow
    options = BenchOptions(tokens=32, runs=1, warmup=0, stream=True, cold_start=False, threads=1, listen_tokens=0)
    inputs = speed._inputs(model, engines, options)
    speed._one_run(stages, inputs, options, np.random.default_rng(0))
    speed._stream_round(stages, inputs, options, {})
    assert not model.runners["llm"].loaded  # only llm_batch holds LLM weights


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
    assert report["peak_rss_gb"] > 0 and "peak_rss_stream_gb" not in report and "stream_memory" not in report
    assert "rtf" in capsys.readouterr().out


def test_bench_rejects_too_few_tokens(engines):
    with pytest.raises(InputError, match="--tokens"):
        run_bench(engines, BenchOptions(tokens=5, cold_start=False))


def test_derived_int4_engines_bench_and_leave_fp32_untouched(engines, tmp_path):
    from trt_cosy.builder.quantize.engines import derive_engines
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


def test_bench_streams_cosyvoice3_engines(tmp_path_factory):
    """CosyVoice3 engines stream through their own request and vocoder (causal HiFT) in the bench."""
    from _support import family_engines

    engines = family_engines(tmp_path_factory, "v3")
    options = BenchOptions(tokens=32, runs=1, warmup=0, stream=True, cold_start=False, threads=1, listen_tokens=0)
    report = run_bench(engines, options)
    for seconds in (3, 5, 10):
        assert report["metrics"][f"first_audio_ref{seconds}s"]["median"] > 0
    assert report["metrics"]["audio_s"]["median"] > 0 and report["peak_rss_stream_gb"] > 0
