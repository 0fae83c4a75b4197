"""A native crash (a signal) in a graph compile never takes the process down (runtime/native_guard.py),
and a test whose child process crashes fails alone (tests/_isolated.py)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from _crashing_compile import die_by_sigfpe
from _isolated import ChildCrashed, run_isolated

from trt_cosy.errors import NativeCrashError, TrtCosyError
from trt_cosy.runtime import native_guard
from trt_cosy.runtime.native_guard import (
    CompileChecks,
    checked_compile,
    machine,
    run_each_in_child,
    run_in_child,
)

CRASH = "_crashing_compile:compile_or_crash"


def _graph(tmp_path: Path) -> Path:
    path = tmp_path / "llm.xml"
    path.write_text("<net/>")
    (tmp_path / "llm.bin").write_bytes(b"\0" * 8)
    return path


def test_a_child_killed_by_sigfpe_is_reported_with_its_signal():
    outcome = run_in_child("_crashing_compile:die_by_sigfpe", {})
    assert outcome.crashed and not outcome.ok
    assert (outcome.signal, outcome.returncode) == ("SIGFPE", -int(signal.SIGFPE))


def test_one_child_runs_many_and_stops_at_the_crash(monkeypatch):
    monkeypatch.setenv("TRT_COSY_TEST_CRASH", "b")
    payloads = [{"name": name} for name in ("a", "b", "c")]
    done, outcome = run_each_in_child("_crashing_compile:nothing_or_crash", payloads)
    assert (done, outcome.signal) == (1, "SIGFPE")  # "a" finished, "b" crashed, "c" never ran
    done, outcome = run_each_in_child("_crashing_compile:nothing_or_crash", payloads[2:])
    assert (done, outcome.ok) == (1, True)


def test_a_child_that_raises_is_an_ordinary_failure_not_a_crash():
    outcome = run_in_child("json:loads", {"s": "not json"})
    assert not outcome.ok and not outcome.crashed and outcome.returncode == 1
    assert "JSONDecodeError" in outcome.detail


def test_a_crashing_compile_raises_a_clear_error_and_is_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("TRT_COSY_TEST_CRASH", "llm:bf16")
    monkeypatch.setattr(native_guard, "_checked", {})
    records = CompileChecks(tmp_path / "checks.json")
    arguments = dict(
        backend="OpenVINO",
        version="9.9",
        graph="llm",
        path=_graph(tmp_path),
        compute="bf16",
        threads=2,
        target=CRASH,
        payload={"path": "unused", "name": "llm", "compute": "bf16", "threads": 2},
        remedy="Use `--precision fp32`.",
        records=records,
    )
    with pytest.raises(NativeCrashError) as caught:
        checked_compile(**arguments)
    message = str(caught.value)
    assert isinstance(caught.value, TrtCosyError)
    for part in ("OpenVINO 9.9", "SIGFPE", "'llm'", "bf16", machine().cpu, "--precision fp32"):
        assert part in message, message
    # Remembered on disk: a new process (an empty in-process memo) never runs the child again.
    monkeypatch.setattr(native_guard, "_checked", {})
    monkeypatch.setattr(native_guard, "run_in_child", lambda *args, **kwargs: pytest.fail("checked twice"))
    with pytest.raises(NativeCrashError, match="SIGFPE"):
        checked_compile(**arguments)
    # A different graph file is a different check.
    (tmp_path / "llm.bin").write_bytes(b"\0" * 9)
    with pytest.raises(pytest.fail.Exception, match="checked twice"):
        checked_compile(**arguments)


def test_a_compile_that_works_is_checked_once(tmp_path, monkeypatch):
    monkeypatch.setattr(native_guard, "_checked", {})
    calls = []

    def child(target, payload, timeout=0):
        calls.append(target)
        return native_guard.ChildOutcome(True, 0)

    monkeypatch.setattr(native_guard, "run_in_child", child)
    arguments = dict(
        backend="OpenVINO", version="9.9", graph="llm", path=_graph(tmp_path), compute="fp32", threads=1,
        target=CRASH, payload={}, remedy="", records=CompileChecks(tmp_path / "checks.json"),
    )  # fmt: skip
    checked_compile(**arguments)
    checked_compile(**arguments)
    assert calls == [CRASH]


def test_an_unwritable_record_only_costs_a_check(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    records = CompileChecks(blocker / "sub" / "checks.json")  # its folder cannot be made
    records.put("key", {"ok": True})
    assert records.get("key") is None


def test_machine_names_the_cpu_and_its_isa_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
        "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 fma\n\n"
        "processor\t: 1\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu\n"
    )
    here = machine.__wrapped__(str(cpuinfo))
    assert here.cpu == "Intel(R) Xeon(R) Processor"
    assert here.flags == ("amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512f", "fma")
    assert len(here.key) == 16 and "amx_bf16" in here.describe()


def test_a_test_whose_child_dies_by_sigfpe_fails_alone():
    with pytest.raises(ChildCrashed, match="SIGFPE"):
        run_isolated(die_by_sigfpe)
    assert run_isolated(sorted, [3, 1, 2]) == [1, 2, 3]  # and the next one runs
