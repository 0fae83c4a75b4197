"""What the OpenVINO runner gives back after a call (runtime/backends/openvino/runner.py, docs/benchmarks.md "Mixed
engines"): the resident pages of its weights file once the first calls repacked the weights, and, after
the vocoder and flow-encoder graphs, the compiled model's intermediate memory.

A one-MatMul model with an 8 MiB weight stands in for a graph: the mechanism, not the full-size figures.
"""

from __future__ import annotations

import mmap
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

ov = pytest.importorskip("openvino", reason="the OpenVINO backend needs `pip install 'trt-cosy[openvino]'`")

from trt_cosy.runtime.backends.openvino import runner as ov_runtime  # noqa: E402
from trt_cosy.runtime.backends.openvino.runner import (  # noqa: E402
    RELEASE_AFTER_GRAPHS,
    OvRunner,
    drop_weight_pages,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux only"
)
_IN, _OUT = 1024, 2048  # the weight: [1024, 2048] float32, 8 MiB
_FP32 = {"INFERENCE_NUM_THREADS": 1, "INFERENCE_PRECISION_HINT": "f32"}  # bf16 is the default on bf16 CPUs


def _resident_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (``/proc/self/smaps``); -1 when not mapped."""
    target, total, inside = str(path.resolve()), -1, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            inside = len(fields) >= 6 and fields[5] == target
            if inside:
                total = max(total, 0)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1])
    return total


def _matmul_ir(folder: Path, weight: np.ndarray) -> Path:
    """IR of ``y = x @ weight`` (x: [N, 1024] with N dynamic), weights stored float32 in its .bin."""
    from openvino import opset13 as ops

    x = ops.parameter([-1, _IN], np.float32, name="x")
    y = ops.matmul(x, ops.constant(weight), False, False)
    y.output(0).get_tensor().set_names({"y"})
    model = ov.Model([y], [x], "matmul")
    path = folder / "matmul.xml"
    ov.save_model(model, str(path), compress_to_fp16=False)
    return path


@pytest.fixture()
def weight() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((_IN, _OUT)).astype(np.float32)  # [1024, 2048]


def test_drop_weight_pages_unmaps_the_pages_and_keeps_the_data(tmp_path, monkeypatch):
    path = tmp_path / "weights.bin"
    data = np.random.default_rng(1).integers(0, 255, 8 << 20, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    monkeypatch.setattr(ov_runtime, "_weight_files", set())
    ov_runtime._register_weights(path, "")
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = np.frombuffer(mapped, dtype=np.uint8)
        assert int(view.sum()) == int(data.sum())  # every page read: resident
        before = _resident_kib(path)
        dropped = drop_weight_pages()
        after = _resident_kib(path)
        assert before >= 8 * 1024 - 4 and dropped >= 8 << 20 and after < 256, (before, dropped, after)
        assert np.array_equal(view, data)  # read back from the page cache, unchanged
        del view


def test_runner_drops_its_weight_pages_after_the_first_calls(tmp_path, weight):
    runner = OvRunner.from_path(_matmul_ir(tmp_path, weight), "matmul_graph", threads=1)
    bin_path = tmp_path / "matmul.bin"
    x = np.random.default_rng(2).standard_normal((3, _IN)).astype(np.float32)  # [3, 1024]
    first = runner.infer({"x": x})["y"]
    resident = _resident_kib(bin_path)
    if resident < 0:
        pytest.skip("this OpenVINO reads the weights file instead of mapping it: nothing to drop")
    assert resident < 1024, f"{resident} KiB of the 8 MiB weights file still resident after the first call"
    np.testing.assert_allclose(first, x @ weight, rtol=1e-4, atol=1e-3)
    for rows in (1, 7, 3):  # later calls (past the dropping ones), other shapes: same weights
        x = np.random.default_rng(rows).standard_normal((rows, _IN)).astype(np.float32)  # [rows, 1024]
        np.testing.assert_allclose(runner.infer({"x": x})["y"], x @ weight, rtol=1e-4, atol=1e-3)


class _Recording:
    """A compiled model that counts ``release_memory`` calls and forwards everything else."""

    def __init__(self, compiled):
        self._compiled, self.releases = compiled, 0

    def release_memory(self) -> None:
        self.releases += 1
        self._compiled.release_memory()

    def __getattr__(self, name):
        return getattr(self._compiled, name)


@pytest.mark.parametrize("name", ("hift", "flow_encoder", "flow_estimator"))
def test_vocoder_and_encoder_calls_release_intermediate_memory(tmp_path, weight, name):
    compiled = ov.Core().compile_model(str(_matmul_ir(tmp_path, weight)), "CPU", _FP32)
    recording = _Recording(compiled)
    runner = OvRunner(recording, name)
    x = np.ones((4, _IN), np.float32)  # [4, 1024]
    for _ in range(3):
        np.testing.assert_allclose(runner.infer({"x": x})["y"], x @ weight, rtol=1e-4, atol=1e-3)
    assert recording.releases == (3 if name in RELEASE_AFTER_GRAPHS else 0)


def test_concurrent_calls_never_release_a_busy_compiled_model(tmp_path, weight):
    """OpenVINO raises when ``release_memory`` meets a running request: the runner releases only when
    none of its calls runs, so overlapping vocoder calls all succeed."""
    compiled = ov.Core().compile_model(str(_matmul_ir(tmp_path, weight)), "CPU", _FP32)
    recording = _Recording(compiled)
    runner = OvRunner(recording, "hift")
    x = np.random.default_rng(3).standard_normal((512, _IN)).astype(np.float32)  # [512, 1024]
    expected, errors = x @ weight, []

    def work() -> None:
        try:
            for _ in range(5):
                np.testing.assert_allclose(runner.infer({"x": x})["y"], expected, rtol=1e-4, atol=1e-3)
        except Exception as exc:  # collected: a thread's exception would not fail the test
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert 1 <= recording.releases <= 20
