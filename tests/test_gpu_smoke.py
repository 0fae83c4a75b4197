"""scripts/gpu_smoke.py on a CPU: the dry run lists every step with its budget (10 minutes in all),
and the steps that need no GPU run here (issue 29: the smoke script's CPU-only parts run in CI)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_smoke.py"
STEPS = ("versions", "prepared", "fakes", "gpu-tests", "build-plans", "profiles", "nan-kv", "verify", "timing")


def _smoke(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_the_dry_run_lists_every_step_with_its_budget():
    result = _smoke("--dry-run")
    assert result.returncode == 0, result.stderr
    rows = [re.match(r"(\S+)\s+(\d+) s\s+(CPU|GPU)\s+\S", line) for line in result.stdout.splitlines()[:-1]]
    assert all(rows), result.stdout
    assert tuple(row[1] for row in rows) == STEPS
    assert sum(int(row[2]) for row in rows) <= 600
    assert {row[1] for row in rows if row[3] == "CPU"} == {"versions", "prepared", "fakes"}
    assert re.search(r"total budget \d+ s", result.stdout.splitlines()[-1])


def test_cpu_only_runs_the_cpu_steps_and_goes_on_after_a_failure(tmp_path):
    """No prepared dirs: ``prepared`` fails with its reason on one line, the others still run."""
    result = _smoke("--cpu-only", "--engines", str(tmp_path), "--budget-scale", "10")  # a loaded CI machine
    lines = result.stdout.splitlines()
    assert result.returncode == 1, result.stdout + result.stderr
    assert [line.split()[:2] for line in lines[:-1]] == [
        ["PASS", "versions"], ["FAIL", "prepared"], ["PASS", "fakes"], *[["SKIP", s] for s in STEPS[3:]]
    ], lines  # fmt: skip
    assert "does not exist" in lines[1] and "trt-cosy build" in lines[1] and "trt-cosy" in lines[0]
    assert lines[-1] == "SUMMARY 2 passed, 1 failed, 6 skipped"


@pytest.mark.slow
def test_prepared_tiny_dirs_pass_every_cpu_step(tmp_path):
    pytest.importorskip("torch", reason="--prepare exports the tiny checkpoints (the [build] extra)")
    prepared = _smoke("--prepare", str(tmp_path), timeout=1800)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    result = _smoke("--cpu-only", "--engines", str(tmp_path), "--budget-scale", "10")
    assert result.returncode == 0 and result.stdout.splitlines()[-1] == "SUMMARY 3 passed, 0 failed, 6 skipped", (
        result.stdout
    )
