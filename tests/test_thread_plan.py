"""Threads and replicas chosen by measurement (``runtime/thread_plan``, ``bench/thread_split``): the choice
per objective on made-up trials, the candidate splits of fake machines, where the plan is kept and when
it is ignored, and what ``serve`` / Ray / Triton make of it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from trt_cosy.bench import thread_split
from trt_cosy.bench.thread_split import Split, SplitOptions, candidate_splits, parse_splits, tune_threads
from trt_cosy.cli import main
from trt_cosy.errors import InputError
from trt_cosy.runtime import thread_plan
from trt_cosy.runtime.cpu_budget import Core, CpuBudget, read_budget
from trt_cosy.runtime.native_guard import machine
from trt_cosy.runtime.thread_plan import (
    ONE_ENGINE,
    PLAN_DIR,
    SplitTrial,
    ThreadPlan,
    budget_key,
    choose_all,
    choose_split,
    find_plan,
    write_plan,
)


def budget(nodes: int, cores_per_node: int, smt: int = 1, quota: float | None = None) -> CpuBudget:
    """``nodes`` NUMA nodes of ``cores_per_node`` cores, ``smt`` CPUs each (siblings numbered apart)."""
    total = nodes * cores_per_node
    cores = tuple(
        Core(tuple(index + t * total for t in range(smt)), index // cores_per_node) for index in range(total)
    )
    return CpuBudget(cores=cores, quota_cpus=quota)


def trial(replicas: int, threads: int, pinned: bool, rtf: float, first: float) -> SplitTrial:
    return SplitTrial(replicas, threads, pinned, "ok", (rtf,) * replicas, (first,) * replicas)


# --- the choice ---------------------------------------------------------------------------------------


def test_the_default_stays_unless_another_split_is_five_percent_better() -> None:
    default = trial(1, 2, False, rtf=1.00, first=2.0)  # 1.0 audio s per s
    pair = trial(2, 1, True, rtf=1.96, first=4.0)  # 1.02 audio s per s: 2 % more, not enough
    kept = choose_split([default, pair], "throughput", usable_cores=2)
    assert kept.default and (kept.replicas, kept.threads, kept.pinned) == (1, 2, False)
    assert "not 5% better" in kept.reason and "2 x 1 thread" in kept.reason
    faster_pair = trial(2, 1, True, rtf=1.80, first=4.0)  # 1.11 audio s per s
    chosen = choose_split([default, faster_pair], "throughput", usable_cores=2)
    assert not chosen.default and (chosen.replicas, chosen.threads, chosen.pinned) == (2, 1, True)
    assert "11% better" in chosen.reason
    # first audio: the pair is slower per request, so the default stays for latency
    assert choose_split([default, faster_pair], "latency", usable_cores=2).default


def test_latency_picks_fewer_threads_where_they_measured_faster() -> None:
    """A 16-core machine where memory bandwidth makes 8 pinned threads beat 16 (the CPU guides' case)."""
    trials = [
        trial(1, 16, False, 0.50, 1.60),
        trial(16, 1, True, 6.0, 9.0),
        trial(1, 16, True, 0.48, 1.55),
        trial(2, 8, True, 0.55, 1.30),
        trial(1, 8, True, 0.45, 1.20),
    ]
    latency = choose_split(trials, "latency", usable_cores=16)
    assert (latency.replicas, latency.threads, latency.pinned) == (1, 8, True)
    throughput = choose_split(trials, "throughput", usable_cores=16)
    assert (throughput.replicas, throughput.threads) == (2, 8)  # 3.64 audio s per s against 2.67 for 16 x 1
    throughput = choose_split([*trials, trial(16, 1, True, 3.0, 9.0)], "throughput", usable_cores=16)
    assert (throughput.replicas, throughput.threads) == (16, 1)  # 5.33 audio s per s
    one = choose_all(trials, 16)[ONE_ENGINE]  # one engine alone: the lowest RTF among one-replica splits
    assert (one.replicas, one.threads, one.pinned, one.objective) == (1, 8, True, ONE_ENGINE)


def test_failed_and_skipped_trials_are_not_chosen() -> None:
    failed = SplitTrial(2, 1, True, "failed", reason="replica 1 exited with code -11")
    skipped = SplitTrial(1, 1, True, "skipped", reason="time budget spent")
    nothing = choose_split([failed, skipped], "throughput", usable_cores=2)
    assert nothing.default and "nothing measured" in nothing.reason
    only = choose_split([failed, trial(1, 2, True, 0.9, 2.0)], "throughput", usable_cores=2)
    assert (only.replicas, only.pinned, only.default) == (1, True, False)
    assert "default was not measured" in only.reason
    with pytest.raises(InputError, match="objective"):
        choose_split([], "speed", usable_cores=2)


# --- the splits a machine times -----------------------------------------------------------------------


def as_tuples(splits: list[Split]) -> list[tuple]:
    return [(split.replicas, split.threads, split.pinned) for split in splits]


def test_candidate_splits_of_fake_machines() -> None:
    assert as_tuples(candidate_splits(budget(1, 2))) == [
        (1, None, False),
        (2, 1, True),
        (1, 2, True),
        (1, 1, True),
    ]
    # 2 sockets x 8 cores x 2 threads: replicas of 2, 4 and 8 cores (a node holds 8), one engine on fewer
    two_sockets = as_tuples(candidate_splits(budget(2, 8, smt=2)))
    assert two_sockets[:3] == [(1, None, False), (16, 1, True), (1, 16, True)]
    assert two_sockets[3:] == [
        (8, 2, True),
        (4, 4, True),
        (2, 8, True),
        (1, 1, True),
        (1, 2, True),
        (1, 4, True),
        (1, 8, True),
    ]
    # a 4-CPU quota on a 64-core host: the quota's 4 cores are what is split
    quota = as_tuples(candidate_splits(budget(2, 32, quota=4.0)))
    assert quota == [(1, None, False), (4, 1, True), (1, 4, True), (2, 2, True), (1, 1, True), (1, 2, True)]
    assert as_tuples(candidate_splits(budget(1, 1))) == [(1, None, False), (1, 1, True)]


def test_parse_splits() -> None:
    two = budget(1, 2)
    assert as_tuples(parse_splits("default, 2x1p,1x2", two)) == [
        (1, None, False),
        (2, 1, True),
        (1, 2, False),
    ]
    for text, message in (("2x2p", "needs 4 cores"), ("two", "REPLICASxTHREADS"), (",", "names no split")):
        with pytest.raises(InputError, match=message):
            parse_splits(text, two)


def test_tune_threads_times_in_order_and_skips_past_the_budget(tmp_path: Path, monkeypatch) -> None:
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "manifest.json").write_text("{}")
    seen = []
    clock = [0.0]
    monkeypatch.setattr(thread_split.time, "perf_counter", lambda: clock[0])

    def measure(path, cpu_budget, split, options):
        clock[0] += 40.0  # each split "takes" 40 s
        seen.append(as_tuples([split])[0])
        threads = split.threads or cpu_budget.usable_cores
        rtf = {1: 1.8, 2: 1.0}[threads]
        return trial(split.replicas, threads, split.pinned, rtf, 2.0 * rtf)

    plan = tune_threads(engines, SplitOptions(seconds=100), budget=budget(1, 2), measure=measure)
    assert seen == [(1, None, False), (2, 1, True), (1, 2, True)]  # the fourth found the budget spent
    assert [t.status for t in plan.trials] == ["ok", "ok", "ok", "skipped"]
    assert plan.choice("throughput").replicas == 2 and plan.choice("latency").default
    assert plan.engines_id == thread_plan.engines_id(engines) and plan.budget == budget_key(budget(1, 2))


# --- where the plan lives -----------------------------------------------------------------------------


def a_plan(engines: Path, cpu_budget: CpuBudget, trials: list[SplitTrial]) -> ThreadPlan:
    return ThreadPlan(
        machine().key,
        machine().cpu,
        budget_key(cpu_budget),
        cpu_budget.describe(),
        thread_plan.engines_id(engines),
        "made up",
        "2026-12-07T00:00:00+00:00",
        tuple(trials),
        choose_all(trials, cpu_budget.usable_cores),
    )


@pytest.fixture()
def engines(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.setenv("TRT_COSY_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "engines"
    folder.mkdir()
    (folder / "manifest.json").write_text(json.dumps({"created": "then"}))
    return folder


def test_the_plan_is_kept_next_to_the_engines_or_in_the_cache(engines: Path, tmp_path: Path) -> None:
    two = budget(1, 2)
    plan = a_plan(engines, two, [trial(1, 2, False, 1.0, 2.0), trial(2, 1, True, 1.5, 4.0)])
    path = write_plan(plan, engines)
    assert path.parent == engines / PLAN_DIR
    assert find_plan(engines, two, machine().key) == plan
    assert find_plan(engines, budget(1, 4), machine().key) is None  # another budget (a container's quota)
    assert find_plan(engines, two, "another-cpu") is None
    (engines / "manifest.json").write_text(json.dumps({"created": "rebuilt"}))  # engines rebuilt
    assert find_plan(engines, two, machine().key) is None

    read_only = tmp_path / "read-only"
    read_only.mkdir()
    (read_only / "manifest.json").write_text("{}")
    (read_only / PLAN_DIR).write_text("a file where the folder would go: writing there fails")
    plan = a_plan(read_only, two, [trial(1, 2, False, 1.0, 2.0)])
    path = write_plan(plan, read_only)
    assert path.is_relative_to(tmp_path / "cache") and find_plan(read_only, two, machine().key) == plan


# --- what serve, Ray and Triton make of it ------------------------------------------------------------


@pytest.fixture()
def fake_serving(monkeypatch):
    """``CosyVoice.load``, the server and the workers replaced: what the CLI asked for is recorded."""
    from trt_cosy.server import runner as server_runner
    from trt_cosy.server import workers as server_workers
    from trt_cosy.tts import CosyVoice

    seen: dict[str, list] = {"configs": [], "workers": [], "pinned": []}

    def fake_load(cls, path, backend="auto", config=None):
        seen["configs"].append(config)
        return SimpleNamespace(model_id="fake")

    def fake_run_workers(plan, host, port, target, kwargs, progress=None):
        seen["workers"].append(plan)
        target(plan.slots[0].threads, None, None, 0, **kwargs)  # what one worker would load
        return 0

    monkeypatch.setattr(CosyVoice, "load", classmethod(fake_load))
    monkeypatch.setattr(server_runner, "run_server", lambda tts, settings: None)
    monkeypatch.setattr(server_workers, "run_workers", fake_run_workers)
    monkeypatch.setattr(server_workers, "serve_app_worker", lambda *args: None)
    monkeypatch.setattr(
        "trt_cosy.runtime.cpu_budget.pin_process", lambda cpus: seen["pinned"].append(tuple(cpus))
    )
    return seen


def test_workers_auto_needs_a_measured_plan_and_uses_it(engines: Path, fake_serving) -> None:
    cli = CliRunner()
    result = cli.invoke(main, ["serve", "--engines", str(engines), "--workers", "auto"])
    assert result.exit_code == 2 and "trt-cosy tune-threads --engines" in result.output, result.output
    here = read_budget()
    if here.usable_cores < 2:
        pytest.skip("two one-thread workers need two usable cores")
    trials = [trial(1, here.usable_cores, False, 1.0, 2.0), trial(here.usable_cores, 1, True, 0.5, 4.0)]
    write_plan(a_plan(engines, here, trials), engines)
    result = cli.invoke(main, ["serve", "--engines", str(engines), "--workers", "auto", "--deterministic"])
    assert result.exit_code == 0, result.output
    assert "--workers auto: measured on this machine" in result.output
    (plan,) = fake_serving["workers"]
    assert len(plan.slots) == here.usable_cores and plan.threads == 1
    (config,) = fake_serving["configs"]  # the worker's engine: its share, and --deterministic reaches it
    assert config.threads == 1 and config.deterministic is True and config.llm_slots == 1


def test_one_engine_changes_only_where_measured_faster(engines: Path, fake_serving) -> None:
    here = read_budget()
    cli = CliRunner()
    slower = [trial(1, here.usable_cores, False, 1.00, 2.0), trial(1, here.usable_cores, True, 0.97, 1.9)]
    write_plan(a_plan(engines, here, slower), engines)
    assert cli.invoke(main, ["serve", "--engines", str(engines)]).exit_code == 0
    assert fake_serving["configs"][-1].threads is None and fake_serving["pinned"] == []  # 3 %: unchanged
    faster = [trial(1, here.usable_cores, False, 1.00, 2.0), trial(1, here.usable_cores, True, 0.90, 1.9)]
    write_plan(a_plan(engines, here, faster), engines)
    result = cli.invoke(main, ["serve", "--engines", str(engines)])
    assert result.exit_code == 0 and "measured faster here" in result.output, result.output
    assert fake_serving["configs"][-1].threads == here.usable_cores
    assert fake_serving["pinned"] == [here.plan(1).slots[0].cpus]
    result = cli.invoke(main, ["serve", "--engines", str(engines), "--threads", "1"])  # given: used as is
    assert (
        result.exit_code == 0
        and fake_serving["configs"][-1].threads == 1
        and len(fake_serving["pinned"]) == 1
    )


def test_ray_and_triton_auto_read_the_plan(engines: Path, monkeypatch, tmp_path: Path) -> None:
    from trt_cosy.serving import ray_app, triton_repo

    cli = CliRunner()
    for args in (
        ["serve", "--engines", str(engines), "--ray", "--replicas", "auto"],
        ["triton-repo", "--engines", str(engines), "--out", str(tmp_path / "repo"), "--instances", "auto"],
    ):
        result = cli.invoke(main, args)
        assert result.exit_code == 2 and "trt-cosy tune-threads" in result.output, result.output
    here = read_budget()
    trials = [trial(1, here.usable_cores, False, 1.0, 2.0), trial(here.usable_cores, 1, True, 0.5, 4.0)]
    write_plan(a_plan(engines, here, trials), engines)
    expected = (1, here.usable_cores) if here.usable_cores == 1 else (here.usable_cores, 1)
    seen = []
    monkeypatch.setattr(ray_app, "run_ray_serve", lambda options, progress: seen.append(options))
    monkeypatch.setattr(
        triton_repo, "write_triton_repo", lambda engines_dir, repo, options: seen.append(options) or repo
    )
    for module in ("ray", "fastapi", "uvicorn", "python_multipart", "prometheus_client"):
        pytest.importorskip(module)
    result = cli.invoke(
        main, ["serve", "--engines", str(engines), "--ray", "--replicas", "auto", "--no-deterministic"]
    )
    assert result.exit_code == 0, result.output
    assert (seen[-1].replicas, seen[-1].threads, seen[-1].deterministic) == (*expected, False)
    result = cli.invoke(
        main,
        ["triton-repo", "--engines", str(engines), "--out", str(tmp_path / "repo"), "--instances", "auto"],
    )
    assert result.exit_code == 0, result.output
    assert (seen[-1].instances, seen[-1].threads) == expected


@pytest.mark.slow
def test_tune_threads_times_real_replicas_in_step_on_their_cores(
    tmp_path_factory, v2_tiny_dir, tmp_path, monkeypatch
) -> None:
    """`trt-cosy tune-threads` on the tiny engines: one engine unpinned and two pinned one-thread replicas
    at once; each replica passed both barriers on its own slot's CPUs (else the trial fails), and the plan is
    written next to the engines where `find_plan` reads it back."""
    import os
    import shutil

    from _support import tiny_engines

    if read_budget().usable_cores < 2:
        pytest.skip("two pinned replicas need two usable cores")
    monkeypatch.setenv("TRT_COSY_CACHE", str(tmp_path / "cache"))
    engines = tmp_path / "engines"
    shutil.copytree(
        tiny_engines(tmp_path_factory, v2_tiny_dir), engines
    )  # the session's build stays as built
    result = CliRunner().invoke(
        main,
        [
            "tune-threads",
            "--engines",
            str(engines),
            "--splits",
            "default,2x1p",
            "--tokens",
            "30",
            "--runs",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    plan = find_plan(engines, read_budget(), machine().key)
    assert plan is not None and [t.status for t in plan.trials] == ["ok", "ok"], result.output
    default, pair = plan.trials
    assert (default.replicas, default.pinned, len(default.rtf)) == (1, False, 1)
    assert (pair.replicas, pair.threads, pair.pinned, len(pair.rtf), len(pair.first_audio_s)) == (
        2,
        1,
        True,
        2,
        2,
    )
    assert all(value > 0 for value in (*pair.rtf, *pair.first_audio_s))
    assert f"recorded in {engines / PLAN_DIR}" in result.output and os.listdir(engines / PLAN_DIR)
