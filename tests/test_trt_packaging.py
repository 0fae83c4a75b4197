"""Packaging of the GPU path (issue 29 item 10): tensorrt below its next major in every GPU extra,
Dockerfile.nvidia keeping the base image's TensorRT and chaining the image's own entrypoint."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_gpu_extra_bounds_tensorrt_below_the_next_major():
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11's tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found = {}
    for extra, requirements in extras.items():
        for requirement in requirements:
            if re.match(r"tensorrt\b", requirement):
                found[extra] = requirement
    assert set(found) >= {"gpu", "gpu-cu12", "gpu-cu13"}, found
    for extra, requirement in found.items():
        assert re.search(r">=10\.1[2-9]", requirement) and "<12" in requirement, (extra, requirement)


def test_the_dockerfile_chains_the_nvidia_entrypoint():
    dockerfile = (ROOT / "Dockerfile.nvidia").read_text()
    (entrypoint,) = [line for line in dockerfile.splitlines() if line.startswith("ENTRYPOINT")]
    assert entrypoint == 'ENTRYPOINT ["/opt/nvidia/nvidia_entrypoint.sh", "trt-cosy-entrypoint"]'


def test_the_dockerfile_pins_the_images_tensorrt_and_checks_it_kept():
    dockerfile = (ROOT / "Dockerfile.nvidia").read_text()
    installs = [line for line in dockerfile.splitlines() if "pip install" in line and "wheel}[" in line]
    assert installs and all("-c /tmp/image-tensorrt.txt" in line for line in installs), installs
    assert 'test "$(python3 -c \'import tensorrt; print(tensorrt.__version__)\')" = "${image_trt}"' in dockerfile
    line = next(line for line in dockerfile.splitlines() if "pip list --format=freeze" in line)
    command = line.strip().rstrip("\\").strip().rstrip(";").replace("python3 -m pip list --format=freeze", "cat")
    command = command.replace("> /tmp/image-tensorrt.txt || true", "")
    freeze = "numpy==2.1.0\ntensorrt==10.13.2.6\ntensorrt_cu13==10.13.2.6\ntensorrt-cu13-bindings==10.13.2.6\n"
    result = subprocess.run(["sh", "-c", command], input=freeze, capture_output=True, text=True)
    assert result.stdout.split() == ["tensorrt==10.13.2.6", "tensorrt_cu13==10.13.2.6",
                                     "tensorrt-cu13-bindings==10.13.2.6"], (result, command)  # fmt: skip


def test_the_entrypoint_says_that_a_first_start_builds_every_plan():
    script = (ROOT / "docker" / "entrypoint.sh").read_text()
    assert "first start: every plan" in script and "python3 -m trt_cosy.builder.trt.plans" in script
