"""Engines chosen per stage by measurement (builder/tuning.py, builder/tuning_policy.py,
runtime/tuning_record.py): the policy keeps the fastest candidate that passes the quality guard, refuses
one that fails it, records a candidate that cannot build or crashes as failed with the reason and keeps
today's rule where nothing passed; the tuned folder takes each stage's graphs from its candidate and its
manifest keeps the record; engines tuned on another CPU say so in one line; ``--tune off`` is today's rule.

Timings are made up (the ``build`` and ``measure`` seams of ``tune_build``); the real timing child is run
on a real tiny build by hand (docs/benchmarks.md, "Tuning").
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from _tuning_support import fake_candidate
from click.testing import CliRunner

from trt_cosy.builder.tuning import REFERENCE, Candidate, MeasurePlan, measure_in_child, tune_build
from trt_cosy.builder.tuning_policy import choose_stage
from trt_cosy.cli import main
from trt_cosy.errors import BuildError
from trt_cosy.runtime.manifest import Manifest, hash_checkpoint
from trt_cosy.runtime.native_guard import machine
from trt_cosy.runtime.tuning_record import StageTuning, Trial, TuningRecord, warn_if_tuned_elsewhere
from trt_cosy.verify.quality import THRESHOLDS

INT4, FP32, OV_BF16 = Candidate("onnxruntime", "int4"), REFERENCE, Candidate("openvino", "bf16")
TODAY = ("onnxruntime", "int4")


def ok(backend: str, precision: str, *times: float, **quality: float) -> Trial:
    return Trial(backend, precision, "ok", times, quality)


# --- the policy (pure) ---


def test_the_fastest_passing_candidate_is_chosen():
    trials = [
        ok("onnxruntime", "int4", 0.30, 0.32, 0.31, flow_mel_snr_db=40.0),
        ok("onnxruntime", "fp32", 0.50, 0.52),
        ok("openvino", "bf16", 0.20, 0.40, 0.21, flow_mel_snr_db=35.0),  # median 0.21: the fastest
    ]
    choice = choose_stage("flow", trials, TODAY, THRESHOLDS, FP32.key)
    assert (choice.backend, choice.precision) == ("openvino", "bf16")
    assert "median 0.21 s vs 0.31 s for onnxruntime/int4" in choice.reason
    assert [trial.status for trial in choice.trials] == ["ok", "ok", "ok"]


def test_a_candidate_that_fails_the_quality_guard_is_refused_even_when_fastest():
    trials = [
        ok("onnxruntime", "int4", 0.10, 0.10, hift_wav_snr_db=12.5),  # fastest, below the 20 dB bar
        ok("onnxruntime", "fp32", 0.40, 0.41),  # the reference: passes by definition
        ok("openvino", "bf16", 0.30, 0.30),  # no quality numbers: never kept unchecked
    ]
    choice = choose_stage("hift", trials, TODAY, THRESHOLDS, FP32.key)
    assert (choice.backend, choice.precision) == ("onnxruntime", "fp32")
    refused = {trial.label: trial.reason for trial in choice.trials if trial.status == "refused"}
    assert refused == {
        "onnxruntime/int4": "quality guard: hift_wav_snr_db 12.5 < 20",
        "openvino/bf16": "quality guard: hift_wav_snr_db not measured",
    }
    assert "the only candidate" in choice.reason


def test_llm_kl_bar_is_an_upper_bound():
    trials = [
        ok("onnxruntime", "int4", 0.1, 0.1, llm_kl_mean=0.2),
        ok("onnxruntime", "int8", 0.2, 0.2, llm_kl_mean=0.01),
    ]
    choice = choose_stage("llm", trials, TODAY, THRESHOLDS, FP32.key)
    assert choice.precision == "int8"
    assert choice.trials[0].reason == "quality guard: llm_kl_mean 0.2 > 0.05"


def test_todays_rule_stays_unless_another_candidate_is_clearly_faster():
    """A 2 % lead is within a loaded machine's noise: the stage keeps today's engines (margin 5 %)."""
    trials = [
        ok("onnxruntime", "int4", 0.100, 0.101, llm_kl_mean=0.001),
        ok("onnxruntime", "int8", 0.098, 0.098, llm_kl_mean=0.001),
    ]
    kept = choose_stage("llm", trials, TODAY, THRESHOLDS, FP32.key)
    assert (kept.backend, kept.precision) == TODAY
    assert kept.reason.startswith(
        "today's rule kept: the fastest, onnxruntime/int8 (median 0.098 s), is less than 5% faster"
    )
    moved = choose_stage("llm", trials, TODAY, THRESHOLDS, FP32.key, margin=0.01)
    assert moved.precision == "int8"


def test_failed_and_skipped_candidates_are_passed_over_and_nothing_left_keeps_todays_rule():
    trials = [
        Trial("onnxruntime", "int4", "failed", reason="build failed: BuildError: no"),
        Trial("openvino", "bf16", "skipped", reason="time budget of 5 s spent"),
        ok("onnxruntime", "int8", 0.1, 0.1, flow_mel_snr_db=3.0),
    ]
    choice = choose_stage("flow", trials, TODAY, THRESHOLDS, FP32.key)
    assert (choice.backend, choice.precision) == TODAY
    assert choice.reason.startswith("no candidate was timed and passed the guard")
    assert "build failed: BuildError: no" in choice.reason and choice.reason.endswith("today's rule")


def test_the_candidates_follow_the_cpu():
    from trt_cosy.builder.tuning import candidates_here
    from trt_cosy.runtime.native_guard import Machine

    amx = Machine("Xeon", ("amx_bf16", "amx_int8", "avx512_bf16", "avx512f"))
    labels = lambda found: [candidate.label for candidate in found]  # noqa: E731
    assert labels(candidates_here(amx, openvino=True, bf16=True)) == [
        "onnxruntime/int4",
        "onnxruntime/int8",
        "onnxruntime/fp32",
        "openvino/bf16",
        "openvino/int8",
        "openvino/fp32",
    ]
    no_vnni = Machine("Old", ("avx2", "fma"))
    assert labels(candidates_here(no_vnni, openvino=True, bf16=False)) == [
        "onnxruntime/int4",
        "onnxruntime/int8",
        "onnxruntime/fp32",
        "openvino/fp32",
    ]
    assert labels(candidates_here(amx, openvino=False, bf16=False, quantizable=False)) == ["onnxruntime/fp32"]


# --- the record ---


def _record(machine_key: str = "elsewhere") -> TuningRecord:
    stage = StageTuning(
        "flow",
        "openvino",
        "bf16",
        "fastest",
        (
            ok("openvino", "bf16", 0.2, 0.25, flow_mel_snr_db=35.0),
            Trial("onnxruntime", "int4", "failed", reason="x"),
        ),
        threads={"1": 0.4, "2": 0.25},
    )
    return TuningRecord("Some CPU", ("avx2", "fma"), machine_key, 2, 30.0, 12.5, {"flow": stage})


def test_the_record_round_trips_through_the_manifest(tmp_path):
    record = _record()
    manifest = Manifest("v", "mixed", "int4", 18, {}, {}, {}, tuning=record)
    manifest.write(tmp_path)
    again = Manifest.read(tmp_path)
    assert again.tuning == record
    raw = again.to_dict()["tuning"]["stages"]["flow"]["candidates"][0]
    assert raw["median_s"] == pytest.approx(0.225) and raw["spread_s"] == pytest.approx(0.05)
    assert "tuning" not in Manifest("v", "onnxruntime", "int4", 18, {}, {}, {}).to_dict()


def test_engines_tuned_on_another_cpu_log_one_line(caplog):
    with caplog.at_level(logging.WARNING, logger="trt_cosy.runtime.tuning_record"):
        assert warn_if_tuned_elsewhere(_record("elsewhere"), "ENG", "here", "This CPU")
        assert not warn_if_tuned_elsewhere(_record("here"), "ENG", "here", "This CPU")
        assert not warn_if_tuned_elsewhere(None, "ENG", "here", "This CPU")
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1
    assert "tuned on Some CPU; this is This CPU" in lines[0]
    assert "trt-cosy build --model-dir DIR --out ENG --force" in lines[0]


# --- the harness, with made-up builds and timings ---

TIMES = {  # (candidate label, stage) -> seconds of each timed call
    ("onnxruntime/int4", "llm"): (0.10, 0.11, 0.10),
    ("onnxruntime/int4", "flow"): (0.50, 0.52, 0.51),
    ("onnxruntime/int4", "hift"): (0.05, 0.05, 0.05),
    ("onnxruntime/fp32", "llm"): (0.30, 0.30, 0.31),
    ("onnxruntime/fp32", "flow"): (0.60, 0.61, 0.60),
    ("onnxruntime/fp32", "hift"): (0.40, 0.40, 0.40),
    ("openvino/bf16", "llm"): (0.90, 0.90, 0.90),
    ("openvino/bf16", "flow"): (0.20, 0.21, 0.20),
    ("openvino/bf16", "hift"): (0.45, 0.45, 0.46),
}
QUALITY = {
    "llm": {"llm_kl_mean": 0.002},
    "flow": {"flow_mel_snr_db": 40.0},
    "hift": {"hift_wav_snr_db": 30.0},
}


class FakeMeasure:
    """Made-up times per candidate and stage; ``bad``: (label, stage) pairs whose quality misses the bar."""

    def __init__(self, bad=()):
        self.bad = set(bad)
        self.plans: list[tuple[str, MeasurePlan]] = []

    def __call__(self, candidate, engines_dir, plan):
        assert (Path(engines_dir) / "manifest.json").is_file()
        self.plans.append((candidate.label, plan))
        trials = {}
        for stage in plan.stages:
            quality = {} if plan.is_reference else dict(QUALITY[stage])
            if (candidate.label, stage) in self.bad:
                quality = {key: (1.0 if stage == "llm" else 5.0) for key in quality}
            slower = 1.8 if plan.threads == 1 else 1.0  # one thread per graph instead of two
            trials[stage] = Trial(
                *candidate.key, "ok", tuple(t * slower for t in TIMES[(candidate.label, stage)]), quality
            )
        return trials


def fake_builder(checkpoint, fail=None):
    def build(candidate, out_dir, progress):
        if candidate == fail:
            raise BuildError("OpenVINO could not convert flow_estimator (made up)")
        return fake_candidate(Path(out_dir), candidate.backend, candidate.precision, checkpoint)

    return build


@pytest.fixture(scope="module")
def checkpoint(v2_tiny_dir):
    return hash_checkpoint(v2_tiny_dir)


def test_tuned_build_takes_each_stage_from_its_fastest_passing_candidate(tmp_path, v2_tiny_dir, checkpoint):
    measure = FakeMeasure(bad={("onnxruntime/int4", "hift")})  # the fastest HiFT fails the guard
    lines: list[str] = []
    out = tune_build(
        v2_tiny_dir,
        tmp_path / "tuned",
        fallback=TODAY,
        budget_s=30.0,
        threads=2,
        progress=lines.append,
        candidates=[INT4, FP32, OV_BF16],
        build=fake_builder(checkpoint),
        measure=measure,
    )
    timed = [(label, plan.stages, plan.threads) for label, plan in measure.plans]
    assert timed == [
        ("onnxruntime/fp32", ("llm", "flow", "hift"), 2),
        ("onnxruntime/int4", ("llm", "flow", "hift"), 2),
        ("openvino/bf16", ("llm", "flow", "hift"), 2),
        ("onnxruntime/int4", ("llm",), 1),  # then each chosen stage with one thread (recorded only)
        ("openvino/bf16", ("flow",), 1),
        ("onnxruntime/fp32", ("hift",), 1),
    ]
    assert measure.plans[0][1].is_reference and not measure.plans[1][1].is_reference
    assert any("within about 30 s" in line and machine().cpu in line for line in lines)
    manifest = Manifest.read(out)
    manifest.check(out, checkpoint_hashes=checkpoint)
    assert (manifest.backend, manifest.precision) == ("mixed", "int4")
    chosen = {name: (graph.backend, Path(graph.file).suffix) for name, graph in manifest.graphs.items()}
    assert chosen == {
        "llm": ("onnxruntime", ".onnx"),
        "llm_batch": ("onnxruntime", ".onnx"),
        "flow_encoder": ("openvino", ".xml"),
        "flow_estimator": ("openvino", ".xml"),
        "hift": ("onnxruntime", ".onnx"),
    }
    assert manifest.graphs["flow_estimator"].compute == "bf16"
    assert (out / "llm.onnx").read_text() == "onnxruntime/int4 llm.onnx"
    assert (out / "flow_estimator.bin").read_text() == "openvino/bf16 flow_estimator.bin"
    assert (out / "hift.onnx").read_text() == "onnxruntime/fp32 hift.onnx"
    assert (out / "tokenizer" / "vocab.json").read_text() == "onnxruntime/int4 tokenizer/vocab.json"
    assert not (out / "flow_estimator.onnx").exists() and not (out / "hift.xml").exists()
    assert manifest.nbits_blocks == {"llm": 32, "llm_batch": 32}
    assert set(manifest.compile_check["graphs"]) == {"flow_encoder", "flow_estimator"}
    tuning = manifest.tuning
    assert (tuning.machine, tuning.cpu, tuning.threads, tuning.budget_s) == (
        machine().key,
        machine().cpu,
        2,
        30.0,
    )
    assert {name: stage.label for name, stage in tuning.stages.items()} == {
        "llm": "onnxruntime/int4",
        "flow": "openvino/bf16",
        "hift": "onnxruntime/fp32",
    }
    assert tuning.stages["flow"].threads == {"1": pytest.approx(0.36), "2": pytest.approx(0.20)}
    hift = {trial.label: trial for trial in tuning.stages["hift"].trials}
    assert (
        hift["onnxruntime/int4"].status == "refused"
        and "hift_wav_snr_db 5 < 20" in hift["onnxruntime/int4"].reason
    )
    assert hift["openvino/bf16"].median_s == pytest.approx(0.45)
    assert not list(tmp_path.glob(".tuned.tuning-*")), "the candidates are removed after the build"
    again = tune_build(
        v2_tiny_dir,
        out,
        fallback=TODAY,
        progress=lines.append,
        threads=2,
        build=fake_builder(checkpoint),
        measure=measure,
    )
    assert again == out and "tuned on this CPU; nothing to build" in lines[-1]


def test_loading_engines_tuned_on_another_cpu_says_so_once(tmp_path, v2_tiny_dir, checkpoint, caplog):
    import dataclasses

    from trt_cosy.errors import EngineMismatchError
    from trt_cosy.runtime.engines import load_engines

    out = tune_build(
        v2_tiny_dir,
        tmp_path / "tuned",
        fallback=TODAY,
        budget_s=30.0,
        threads=2,
        candidates=[INT4, FP32],
        build=fake_builder(checkpoint),
        measure=FakeMeasure(),
    )
    manifest = Manifest.read(out)
    elsewhere = dataclasses.replace(manifest.tuning, machine="0123456789abcdef", cpu="Another CPU")
    dataclasses.replace(manifest, tuning=elsewhere).write(out)
    with caplog.at_level(logging.WARNING), pytest.raises(EngineMismatchError, match="model_config.json"):
        load_engines(out)  # the made-up folder's config is not JSON: the line comes before it is read
    lines = [record.getMessage() for record in caplog.records if "tuned on" in record.getMessage()]
    assert lines == [
        f"these engines were tuned on Another CPU; this is {machine().cpu}: their per-stage choice "
        f"({elsewhere.summary()}) may not be the fastest here. Re-tune on this machine: `trt-cosy build "
        f"--model-dir DIR --out {out} --force`."
    ]


def test_a_candidate_that_cannot_build_is_recorded_and_the_others_go_on(tmp_path, v2_tiny_dir, checkpoint):
    out = tune_build(
        v2_tiny_dir,
        tmp_path / "tuned",
        fallback=TODAY,
        budget_s=30.0,
        threads=2,
        candidates=[INT4, FP32, OV_BF16],
        build=fake_builder(checkpoint, fail=OV_BF16),
        measure=FakeMeasure(),
    )
    manifest = Manifest.read(out)
    assert manifest.backend == "onnxruntime" and all(
        graph.backend is None for graph in manifest.graphs.values()
    )
    flow = manifest.tuning.stages["flow"]
    assert flow.label == "onnxruntime/int4"
    failed = [trial for trial in flow.trials if trial.status == "failed"]
    assert [trial.label for trial in failed] == ["openvino/bf16"]
    assert failed[0].reason == "build failed: BuildError: OpenVINO could not convert flow_estimator (made up)"


def test_a_timing_child_that_crashes_fails_the_stage_it_crashed_in(tmp_path):
    plan = MeasurePlan(("llm", "flow", "hift"), 1, 1.0, tmp_path / "reference.npz", False)
    trials = measure_in_child(INT4, tmp_path, plan, target="_tuning_support:time_llm_then_crash")
    assert trials["llm"].status == "ok" and trials["llm"].times_s == (0.25, 0.27)
    assert (
        trials["flow"].status == "failed" and trials["flow"].reason == "crashed (SIGSEGV) while timing flow"
    )
    assert trials["hift"].reason == "crashed (SIGSEGV) while timing flow"
    errors = measure_in_child(INT4, tmp_path, plan, target="_tuning_support:fail_with_error")
    assert {trial.reason for trial in errors.values()} == {
        "failed: RuntimeError: the engines would not load here"
    }


def test_every_stage_keeps_todays_rule_when_the_reference_cannot_be_measured(
    tmp_path, v2_tiny_dir, checkpoint
):
    """Without the fp32 reference nothing can be guarded: every stage keeps today's rule (int4 here)."""
    out = tune_build(
        v2_tiny_dir,
        tmp_path / "tuned",
        fallback=TODAY,
        budget_s=30.0,
        threads=2,
        candidates=[INT4, FP32],
        build=fake_builder(checkpoint, fail=FP32),
        measure=FakeMeasure(),
    )
    tuning = Manifest.read(out).tuning
    assert {stage.label for stage in tuning.stages.values()} == {"onnxruntime/int4"}
    llm = {trial.label: trial for trial in tuning.stages["llm"].trials}
    assert llm["onnxruntime/int4"].status == "skipped" and "reference" in llm["onnxruntime/int4"].reason


# --- the CLI ---


@pytest.fixture
def no_gpu(monkeypatch):
    from trt_cosy.runtime import backend_choice

    monkeypatch.setattr(backend_choice, "gpu_unavailable_reason", lambda: "tensorrt is not installed")


def test_build_tunes_by_default_and_tune_off_keeps_todays_rule(no_gpu, monkeypatch, tmp_path, v2_tiny_dir):
    pytest.importorskip("torch", reason="`trt-cosy build` needs the [build] extra (torch)")
    pytest.importorskip("onnx", reason="`trt-cosy build` needs the [build] extra (onnx)")
    import trt_cosy.builder.engines as engines_module
    import trt_cosy.builder.tuning as tuning_module

    tuned, plain = [], []
    monkeypatch.setattr(
        tuning_module, "tune_build", lambda model_dir, out_dir, **kw: tuned.append(kw) or out_dir
    )
    monkeypatch.setattr(
        engines_module, "build_engines", lambda model_dir, out_dir, **kw: plain.append(kw) or out_dir
    )
    args = ["build", "--model-dir", str(v2_tiny_dir), "--out", str(tmp_path / "e")]
    result = CliRunner().invoke(main, [*args, "--tune-seconds", "12"])
    assert result.exit_code == 0, result.output
    assert tuned == [{"fallback": TODAY, "force": False, "budget_s": 12.0, "progress": tuned[0]["progress"]}]
    assert "chosen per stage by timing on this CPU" in result.output and not plain
    result = CliRunner().invoke(main, [*args, "--tune", "off"])
    assert result.exit_code == 0, result.output
    assert len(tuned) == 1 and (plain[0]["backend"], plain[0]["precision"]) == TODAY
    assert "backend: onnxruntime int4 (no CUDA GPU with TensorRT here" in result.output


# --- the bench report ---


def test_bench_report_names_the_cpu_its_flags_and_threads():
    from trt_cosy.bench.speed import _machine, format_bench

    report = {
        "engines": "E",
        "backend": "mixed",
        "precision": "int4",
        "threads": 2,
        "machine": _machine(),
        "metrics": {"rtf": {"median": 1.0, "min": 0.9, "max": 1.1}},
        "peak_rss_gb": 1.0,
        "streaming": "not measured",
        "tuned": "llm onnxruntime/int4, flow openvino/bf16, hift onnxruntime/int4 (tuned on X)",
    }
    here = machine()
    lines = format_bench(report).splitlines()
    assert lines[
        0
    ] == f"cpu {here.cpu}, {report['machine']['logical_cpus']} logical CPUs, 2 threads; flags " + (
        " ".join(here.flags) or "not read"
    )
    assert lines[1] == f"engines chosen per stage: {report['tuned']}"


# --- the real timing child, on the session's tiny ONNX Runtime engines ---


@pytest.fixture(scope="module")
def tiny_fp32_engines(tmp_path_factory, v2_tiny_dir):
    from _support import tiny_engines

    return tiny_engines(tmp_path_factory, v2_tiny_dir)  # the session's build (ONNX Runtime fp32)


@pytest.mark.slow  # the session's tiny build, then about 10 s
def test_the_timing_child_times_and_guards_real_engines(tiny_fp32_engines, tmp_path):
    engines = tiny_fp32_engines  # fp32: the reference itself
    stages = ("llm", "flow", "hift")
    reference = measure_in_child(FP32, engines, MeasurePlan(stages, 1, 0.5, tmp_path / "reference.npz", True))
    assert (tmp_path / "reference.npz").is_file()  # the outputs the other candidates are compared with
    again = measure_in_child(FP32, engines, MeasurePlan(stages, 1, 0.5, tmp_path / "reference.npz", False))
    for trials in (reference, again):
        assert set(trials) == set(stages)
        for trial in trials.values():
            assert trial.status == "ok" and 2 <= len(trial.times_s) <= 7 and min(trial.times_s) > 0, trial
    assert all(not trial.quality for trial in reference.values())
    # the same engines against their own outputs: nothing lost (the guard's numbers, exactly)
    assert again["llm"].quality == {"llm_kl_mean": pytest.approx(0.0, abs=1e-12)}
    assert again["flow"].quality == {"flow_mel_snr_db": float("inf")}
    assert again["hift"].quality == {"hift_wav_snr_db": float("inf")}
