"""The default backend (runtime.backend_choice): TensorRT fp16 with a CUDA GPU and TensorRT, else the
CPU pick; an explicit --backend wins; the CLI says which in one line and the manifest records why.

GPU detection is faked (this machine has none): at the top (``gpu_unavailable_reason``) or at the
bottom (a fake ``cuda.bindings.runtime`` device count and a fake ``tensorrt`` package).
"""

from __future__ import annotations

import importlib.machinery
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from trt_cosy.cli import main
from trt_cosy.download import engines_cache_dir, prepare_engines
from trt_cosy.runtime import backend_choice
from trt_cosy.runtime.backend_choice import (
    CPU_PICKS,
    BackendChoice,
    choose_backend,
    cpu_pick,
    resolve_backend,
)
from trt_cosy.runtime.backends.tensorrt import cuda
from trt_cosy.runtime.manifest import MANIFEST_NAME, Manifest


@pytest.fixture(autouse=True)
def no_bf16(monkeypatch):
    """A CPU without OpenVINO bf16 kernels unless a test says otherwise (``bf16``): the portable pick."""
    monkeypatch.setattr(backend_choice, "cpu_has_bf16_kernels", lambda: False)


@pytest.fixture
def bf16(monkeypatch):
    monkeypatch.setattr(backend_choice, "cpu_has_bf16_kernels", lambda: True)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(backend_choice, "gpu_unavailable_reason", lambda: "no CUDA device (test)")


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(backend_choice, "gpu_unavailable_reason", lambda: None)


class _FakeCudaRuntime:
    """``cuda.bindings.runtime`` with ``devices`` visible devices."""

    def __init__(self, devices: int):
        self.devices = devices

    def cudaGetDeviceCount(self):  # noqa: N802 - the CUDA name
        return 0, self.devices


def _fake_tensorrt(monkeypatch) -> list[str]:
    """An importable ``tensorrt`` whose Runtime/Builder record their creation (which must not happen)."""
    created: list[str] = []
    module = types.ModuleType("tensorrt")
    module.__spec__ = importlib.machinery.ModuleSpec("tensorrt", None)
    module.Runtime = lambda *args: created.append("Runtime")
    module.Builder = lambda *args: created.append("Builder")
    monkeypatch.setitem(sys.modules, "tensorrt", module)
    return created


def test_no_gpu_picks_onnxruntime_int4(no_gpu):
    choice = choose_backend()
    assert (choice.backend, choice.precision) == ("onnxruntime", "int4")
    assert (CPU_PICKS[-1].backend, CPU_PICKS[-1].needs_bf16) == ("onnxruntime", False)  # runs anywhere
    assert "no CUDA GPU with TensorRT here" in choice.reason and "fastest measured CPU" in choice.reason
    assert choice.line() == f"backend: onnxruntime int4 ({choice.reason})"


def test_a_bf16_cpu_gets_the_first_pick_that_needs_it(no_gpu, bf16, monkeypatch):
    # Today's only pick runs anywhere (a bf16 CPU too); the mechanism for a bf16-only pick, shown with one.
    assert cpu_pick() == CPU_PICKS[0] and choose_backend().backend == "onnxruntime"
    mixed = backend_choice.CpuPick("mixed", "int4", True, "a bf16 pick")
    monkeypatch.setattr(backend_choice, "CPU_PICKS", (mixed, *CPU_PICKS))
    assert cpu_pick() == mixed
    choice = choose_backend()
    assert (choice.backend, choice.precision) == ("mixed", "int4") and mixed.reason in choice.reason
    # another precision goes to the portable pick's backend (fp32 parity engines stay ONNX Runtime)
    assert (choose_backend("fp32").backend, choose_backend("bf16").backend) == ("onnxruntime", "openvino")


def test_bf16_detection_needs_openvino(monkeypatch):
    monkeypatch.undo()  # the real detection
    monkeypatch.setitem(sys.modules, "openvino", None)  # find_spec: not importable
    assert backend_choice.cpu_has_bf16_kernels() is False


def test_gpu_with_tensorrt_picks_tensorrt_fp16(gpu):
    choice = choose_backend()
    assert (choice.backend, choice.precision) == ("tensorrt", "fp16")
    assert "CUDA GPU with TensorRT" in choice.reason


def test_detection_with_a_fake_device_and_tensorrt(monkeypatch):
    created = _fake_tensorrt(monkeypatch)
    monkeypatch.setattr(cuda, "_BINDINGS", _FakeCudaRuntime(devices=1))
    assert (choose_backend().backend, choose_backend().precision) == ("tensorrt", "fp16")
    assert created == []  # detection creates no TensorRT object


def test_detection_without_a_device_never_touches_tensorrt(monkeypatch):
    created = _fake_tensorrt(monkeypatch)
    monkeypatch.setattr(cuda, "_BINDINGS", _FakeCudaRuntime(devices=0))
    assert choose_backend().backend == "onnxruntime"
    assert created == []


def test_detection_without_tensorrt_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # find_spec: not importable
    monkeypatch.setattr(cuda, "_BINDINGS", _FakeCudaRuntime(devices=1))
    assert backend_choice.gpu_unavailable_reason() is not None
    assert choose_backend().backend == "onnxruntime"


def test_detection_survives_a_broken_cuda_install(monkeypatch):
    _fake_tensorrt(monkeypatch)

    class Broken:
        def cudaGetDeviceCount(self):  # noqa: N802
            raise RuntimeError("driver exploded")

    monkeypatch.setattr(cuda, "_BINDINGS", Broken())
    assert "CUDA detection failed" in backend_choice.gpu_unavailable_reason()
    assert choose_backend().backend == "onnxruntime"


def test_explicit_backend_wins(gpu):
    assert resolve_backend("onnxruntime") == BackendChoice("onnxruntime", "int4", "--backend onnxruntime given")
    assert resolve_backend("openvino", "fp32").precision == "fp32"
    assert resolve_backend("auto").backend == "tensorrt"


def test_a_precision_the_pick_lacks_moves_to_a_backend_that_has_it(gpu):
    choice = choose_backend("int4")  # TensorRT has no int4 engines
    assert (choice.backend, choice.precision) == ("onnxruntime", "int4")
    assert "tensorrt has no int4 engines" in choice.reason
    assert choose_backend("fp32").backend == "tensorrt"


def test_a_precision_on_a_cpu(no_gpu):
    assert (choose_backend("fp32").backend, choose_backend("bf16").backend) == ("onnxruntime", "openvino")


# ----------------------------------------------------------------------------- manifest


def _manifest(**extra) -> Manifest:
    return Manifest(
        trt_cosy_version="0", backend="onnxruntime", precision="int4", opset=18, checkpoint={}, graphs={},
        files={}, **extra,
    )


def test_manifest_round_trips_the_reason_and_reads_manifests_without_it(tmp_path):
    _manifest(backend_reason="because").write(tmp_path)
    assert Manifest.read(tmp_path).backend_reason == "because"
    raw = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert raw["format"] == 1
    del raw["backend_reason"]  # a manifest written before the field existed
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(raw))
    assert Manifest.read(tmp_path).backend_reason is None


def test_manifest_round_trips_nbits_blocks_and_reads_manifests_without_them(tmp_path):
    _manifest(nbits_blocks={"llm": 128, "llm_batch": 128}).write(tmp_path)
    assert Manifest.read(tmp_path).nbits_blocks == {"llm": 128, "llm_batch": 128}
    _manifest().write(tmp_path)  # fp32 engines, or a manifest written before the field existed
    assert "nbits_blocks" not in json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert Manifest.read(tmp_path).nbits_blocks is None


# ----------------------------------------------------------------------------- CLI


@pytest.fixture
def builds(monkeypatch) -> list[dict]:
    """``build_engines`` records its arguments instead of building."""
    import trt_cosy.builder.engines as build_module

    calls: list[dict] = []

    def fake_build(model_dir, out_dir, **kwargs):
        calls.append(kwargs)
        return Path(out_dir)

    monkeypatch.setattr(build_module, "build_engines", fake_build)
    return calls


def test_build_without_backend_picks_by_machine_and_says_so(no_gpu, builds, tmp_path, v2_tiny_dir):
    """With tuning off (tests/test_tuning.py: tuning, the default on CPU machines)."""
    pytest.importorskip("torch", reason="`trt-cosy build` needs the [build] extra (torch)")
    pytest.importorskip("onnx", reason="`trt-cosy build` needs the [build] extra (onnx)")
    result = CliRunner().invoke(
        main, ["build", "--model-dir", str(v2_tiny_dir), "--out", str(tmp_path / "e"), "--tune", "off"]
    )
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("backend: ")]
    assert lines == [
        "backend: onnxruntime int4 (no CUDA GPU with TensorRT here; ONNX Runtime int4 is the fastest measured "
        "CPU engine)"
    ]
    assert builds[0]["backend"] == "onnxruntime" and builds[0]["precision"] == "int4"
    assert "no CUDA GPU" in builds[0]["backend_reason"]


def test_build_on_a_gpu_machine_defaults_to_tensorrt(gpu, builds, tmp_path, v2_tiny_dir):
    pytest.importorskip("torch", reason="`trt-cosy build` needs the [build] extra (torch)")
    pytest.importorskip("onnx", reason="`trt-cosy build` needs the [build] extra (onnx)")
    result = CliRunner().invoke(main, ["build", "--model-dir", str(v2_tiny_dir), "--out", str(tmp_path / "e")])
    assert result.exit_code == 0, result.output
    assert "backend: tensorrt fp16 (CUDA GPU with TensorRT found)" in result.output
    assert (builds[0]["backend"], builds[0]["precision"]) == ("tensorrt", "fp16")


def test_build_explicit_backend_wins_without_a_line(gpu, builds, tmp_path, v2_tiny_dir):
    pytest.importorskip("torch", reason="`trt-cosy build` needs the [build] extra (torch)")
    pytest.importorskip("onnx", reason="`trt-cosy build` needs the [build] extra (onnx)")
    result = CliRunner().invoke(
        main, ["build", "--model-dir", str(v2_tiny_dir), "--out", str(tmp_path / "e"), "--backend", "onnxruntime"]
    )
    assert result.exit_code == 0, result.output
    assert (builds[0]["backend"], builds[0]["precision"]) == ("onnxruntime", "int4")
    assert builds[0]["backend_reason"] == "--backend onnxruntime given"
    assert "backend: " not in result.output


def test_cache_dir_follows_the_chosen_backend(gpu, builds, tmp_path, monkeypatch, v2_tiny_dir):
    pytest.importorskip("torch", reason="building into the cache needs the [build] extra (torch)")
    pytest.importorskip("onnx", reason="building into the cache needs the [build] extra (onnx)")
    monkeypatch.setenv("TRT_COSY_CACHE", str(tmp_path / "cache"))
    release = tmp_path / "release"
    shutil.copytree(v2_tiny_dir, release)
    lines: list[str] = []
    path = prepare_engines(release, progress=lines.append)
    assert path == engines_cache_dir(release, "fp16", "tensorrt") and path.name == "tensorrt-fp16"
    assert lines[0] == "backend: tensorrt fp16 (CUDA GPU with TensorRT found)"
    assert builds[0]["backend_reason"] == "CUDA GPU with TensorRT found"
    assert prepare_engines(release, backend="onnxruntime").name == "onnxruntime-int4"


@pytest.mark.slow
def test_built_manifest_records_the_reason(no_gpu, tmp_path, v2_tiny_dir):
    pytest.importorskip("torch", reason="`trt-cosy build` needs the [build] extra (torch)")
    pytest.importorskip("onnx", reason="`trt-cosy build` needs the [build] extra (onnx)")
    out = tmp_path / "engines"
    result = CliRunner().invoke(
        main, ["build", "--model-dir", str(v2_tiny_dir), "--out", str(out), "--precision", "fp32"]
    )
    assert result.exit_code == 0, result.output
    manifest = Manifest.read(out)
    assert (manifest.backend, manifest.precision) == ("onnxruntime", "fp32")
    assert manifest.backend_reason.startswith("no CUDA GPU with TensorRT here")


@pytest.mark.parametrize(("gpu_reason", "expected"), [(None, "tensorrt"), ("no CUDA device (test)", "onnxruntime")])
def test_load_auto_runs_tensorrt_engines_on_tensorrt_only_with_a_gpu(tmp_path, monkeypatch, gpu_reason, expected):
    from trt_cosy.tts import _engine_backend

    monkeypatch.setattr(backend_choice, "gpu_unavailable_reason", lambda: gpu_reason)
    Manifest(
        trt_cosy_version="0", backend="tensorrt", precision="fp16", opset=18, checkpoint={}, graphs={}, files={}
    ).write(tmp_path)
    assert _engine_backend("auto", tmp_path) == expected
    assert _engine_backend("onnxruntime", tmp_path) == "onnxruntime"  # an explicit backend wins


def test_build_onnx_only_means_tensorrt_inputs_on_any_machine(no_gpu, builds, tmp_path, v2_tiny_dir):
    pytest.importorskip("torch", reason="`trt-cosy build` needs the [build] extra (torch)")
    pytest.importorskip("onnx", reason="`trt-cosy build` needs the [build] extra (onnx)")
    result = CliRunner().invoke(
        main, ["build", "--model-dir", str(v2_tiny_dir), "--out", str(tmp_path / "e"), "--onnx-only"]
    )
    assert result.exit_code == 0, result.output
    assert (builds[0]["backend"], builds[0]["precision"], builds[0]["onnx_only"]) == ("tensorrt", "fp16", True)
    assert "backend: tensorrt fp16 (--onnx-only writes TensorRT inputs)" in result.output
