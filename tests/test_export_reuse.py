"""Exports shared between builds (``builder.export_reuse``): the same module, weights and feeds are
exported once; anything that shapes the export makes a new one."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs the [build] extra (torch)")
pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import torch
from torch import nn
from torch.export import Dim

from trt_cosy.builder.export import export_graph
from trt_cosy.builder.export_reuse import EXPORT_CACHE_ENV, shared_exports
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.graphs import GraphSpec, TensorSpec

SPEC = GraphSpec(
    "toy", inputs=(TensorSpec("x", "float32", (1, "T", 8)),), outputs=(TensorSpec("y", "float32", (1, "T", 4)),)
)


class _Toy(nn.Module):
    def __init__(self, scale: float = 1.0):
        super().__init__()
        self.scale = scale
        self.proj = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * self.proj(x)  # [1, T, 4]


def _toy(scale: float = 1.0) -> _Toy:
    torch.manual_seed(0)
    return _Toy(scale)


def _export(module: nn.Module, path, lines: list[str], frames: int = 5):
    feed = {"x": np.linspace(-1, 1, frames * 8, dtype=np.float32).reshape(1, frames, 8)}
    return export_graph(SPEC, module, feed, path, {"x": {1: Dim("T", min=1)}}, progress=lines.append)


@pytest.fixture(autouse=True)
def _no_session_store(monkeypatch):
    monkeypatch.delenv(EXPORT_CACHE_ENV, raising=False)  # each test its own store


def test_the_same_export_is_made_once_and_copied(tmp_path):
    lines: list[str] = []
    with shared_exports(tmp_path / "store"):
        first = _export(_toy(), tmp_path / "a" / "toy.onnx", lines)
        second = _export(_toy(), tmp_path / "b" / "toy.onnx", lines)
    assert sum("exporting to" in line for line in lines) == 1, lines
    assert any("reusing an earlier export" in line for line in lines), lines
    assert second.path == tmp_path / "b" / "toy.onnx" and second.path.read_bytes() == first.path.read_bytes()
    assert second.max_errors == first.max_errors
    x = np.ones((1, 3, 8), np.float32)
    expected = _toy()(torch.from_numpy(x)).detach().numpy()
    np.testing.assert_allclose(OrtRunner.from_path(second.path, "toy").infer({"x": x})["y"], expected, atol=1e-6)


def test_other_weights_attributes_or_feeds_export_again(tmp_path):
    lines: list[str] = []
    with shared_exports(tmp_path / "store"):
        _export(_toy(), tmp_path / "a" / "toy.onnx", lines)
        other = _toy()
        with torch.no_grad():
            other.proj.bias.add_(1.0)
        _export(other, tmp_path / "b" / "toy.onnx", lines)  # other weights
        _export(_toy(scale=2.0), tmp_path / "c" / "toy.onnx", lines)  # another attribute
        _export(_toy(), tmp_path / "d" / "toy.onnx", lines, frames=6)  # other feeds
    assert sum("exporting to" in line for line in lines) == 4, lines


def test_the_environment_shares_exports_between_processes_and_nothing_without_it(tmp_path, monkeypatch):
    lines: list[str] = []
    _export(_toy(), tmp_path / "a" / "toy.onnx", lines)
    _export(_toy(), tmp_path / "b" / "toy.onnx", lines)
    assert sum("exporting to" in line for line in lines) == 2  # nothing shared by default
    monkeypatch.setenv(EXPORT_CACHE_ENV, str(tmp_path / "store"))
    _export(_toy(), tmp_path / "c" / "toy.onnx", lines)
    _export(_toy(), tmp_path / "d" / "toy.onnx", lines)
    assert sum("exporting to" in line for line in lines) == 3
    assert [path.name for path in (tmp_path / "store").iterdir()] and not list((tmp_path / "store").glob(".*"))
