"""The README's two commands: CI runs the second one verbatim, and the extras they name exist."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _readme_command(number: int) -> str:
    lines = README.read_text(encoding="utf-8").splitlines()
    for index, line in enumerate(lines):
        if line.startswith(f"# {number}. "):
            return lines[index + 1]
    raise AssertionError(f"README.md has no '# {number}. ...' line")


def _fake_tool(bin_dir: Path, name: str, log: Path) -> None:
    """An executable that only records its arguments (one line per call)."""
    tool = bin_dir / name
    tool.write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n', encoding="utf-8")
    tool.chmod(0o755)


def test_ci_runs_the_readme_test_command_verbatim(tmp_path):
    """.ci/run executes exactly the README's command 2 (pip, python3 and apt-get faked to record calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    for name in ("pip", "python3", "apt-get"):
        _fake_tool(bin_dir, name, log)
    path = f"{bin_dir}:{os.path.dirname(shutil.which('awk'))}:/usr/bin:/bin"
    result = subprocess.run(
        ["bash", str(ROOT / ".ci" / "run")], capture_output=True, text=True, timeout=60,
        env={"PATH": path, "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    command = _readme_command(2)
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert command in ci_lines, ".ci/run does not carry the README's test command verbatim"
    calls = [line for line in log.read_text(encoding="utf-8").splitlines() if not line.startswith("apt-get")]
    # Each `&&`-joined part of the README line ran, in order, with its arguments (shell quotes removed).
    expected = [part.strip().replace("'", "") for part in command.split("&&")]
    assert calls == expected, (calls, expected)
    assert calls[-1] == "python3 -m pytest -q"


def test_readme_install_extras_exist_and_test_extra_covers_the_suite():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    extras = project["optional-dependencies"]
    for number in (1, 2):
        for group in re.findall(r"-e '\.\[([a-z,]+)\]'", _readme_command(number)):
            for name in group.split(","):
                assert name in extras, f"README command {number} names extra [{name}], not in pyproject.toml"
    test_extra = " ".join(extras["test"])
    for needed in ("cpu", "build", "serve", "download", "pytest", "httpx", "openai"):
        assert needed in test_extra, f"[test] lacks {needed}"
    assert "python3 -m pytest -q" in _readme_command(2)
    assert "trt-cosy say" in _readme_command(1)


@pytest.mark.slow
def test_every_test_file_collects(tmp_path):
    """Collection never fails on an import: a file that needs an absent extra skips with the reason."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "error" not in result.stdout.splitlines()[-1].lower(), result.stdout[-2000:]
