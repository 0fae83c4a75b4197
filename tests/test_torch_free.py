"""The runtime must not import torch: `import trt_cosy` and the CLI's --help run with torch blocked."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from _support import BLOCK_TORCH


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", BLOCK_TORCH + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_blocker_really_blocks() -> None:
    result = _run("import torch")
    assert result.returncode != 0 and "blocked" in result.stderr


def test_import_does_not_load_torch() -> None:
    result = _run(
        """
        import trt_cosy, trt_cosy.cli, trt_cosy.verify
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_cli_help_without_torch() -> None:
    result = _run(
        """
        from trt_cosy.cli import main
        try:
            main(["--help"])
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        for command in ("verify", "make-test-model"):
            try:
                main([command, "--help"])
            except SystemExit as exc:
                assert exc.code == 0, exc.code
        assert "torch" not in sys.modules
        """
    )
    assert result.returncode == 0, result.stderr
    assert "verify" in result.stdout and "make-test-model" in result.stdout
