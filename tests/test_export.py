"""ONNX export: export_graph on a toy module (checks, external data, tolerance) and every tiny graph vs torch.

The five graphs of the golden tiny checkpoint are exported once per test session (``trt-cosy build``
into the pytest base temp; tests/test_engines.py reuses the same directory, its second build is a
manifest-match skip) and compared with the torch reference at two lengths that differ from the
lengths used during export.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs the [build] extra (torch)")
pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import torch
from _support import shared_tiny_engines
from torch import nn
from torch.export import Dim

from trt_cosy.builder import export as export_module
from trt_cosy.builder.export import TOLERANCES, export_graph, graph_export_plan, onnx_io_specs
from trt_cosy.builder.reference import load_torch_model
from trt_cosy.errors import TrtCosyError
from trt_cosy.runtime import graphs
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.graphs import GraphSpec, TensorSpec
from trt_cosy.runtime.manifest import Manifest

pytestmark = pytest.mark.slow  # one tiny build (five dynamo exports, ~45 s on 2 cores) per session



@pytest.fixture(autouse=True)
def _fresh_exports(monkeypatch):
    """These tests check the export itself: no export of an earlier build is reused here."""
    from trt_cosy.builder.export_reuse import EXPORT_CACHE_ENV

    monkeypatch.delenv(EXPORT_CACHE_ENV, raising=False)


TOY = GraphSpec(
    "toy",
    inputs=(TensorSpec("x", "float32", (1, "T", 8)),),
    outputs=(TensorSpec("y", "float32", (1, "T", 4)),),
)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(8, 64)
        self.proj = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.tanh(self.hidden(x)))  # [1, T, 4]


def _toy_feed(frames: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(frames).standard_normal((1, frames, 8), dtype=np.float32)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, v2_tiny_dir) -> tuple[Path, Path]:
    return shared_tiny_engines(tmp_path_factory, v2_tiny_dir)


@pytest.fixture(scope="module")
def torch_model(v2_tiny_dir):
    return load_torch_model(v2_tiny_dir)


def test_export_graph_toy_round_trip(tmp_path):
    messages: list[str] = []
    result = export_graph(
        TOY,
        _Toy(),
        _toy_feed(5),
        tmp_path / "toy.onnx",
        {"x": {1: Dim("T", min=1)}},
        parity_inputs=[_toy_feed(1), _toy_feed(33)],
        tolerance=1e-5,
        progress=messages.append,
    )
    assert result.files == (tmp_path / "toy.onnx",)
    assert max(result.max_errors.values()) < 1e-5, result.max_errors
    inputs, outputs = onnx_io_specs(result.path)
    assert inputs == [{"name": "x", "dtype": "float32", "shape": [1, "T", 8]}]
    assert outputs[0]["name"] == "y" and outputs[0]["shape"][1] == "T", outputs
    assert any("exporting" in m for m in messages) and any("done" in m for m in messages), messages


def test_export_graph_external_data(tmp_path, monkeypatch):
    monkeypatch.setattr(export_module, "_EXTERNAL_DATA_BYTES", 0)  # every model counts as large
    toy = _Toy().eval()
    result = export_graph(TOY, toy, _toy_feed(5), tmp_path / "toy.onnx", {"x": {1: Dim("T", min=1)}})
    data = tmp_path / "toy.onnx.data"
    assert result.files == (tmp_path / "toy.onnx", data) and data.stat().st_size >= 4 * (
        8 * 64 + 64 * 4
    )  # both weight matrices
    moved = tmp_path / "moved"  # the graph names its data file relatively: the pair can move together
    moved.mkdir()
    for path in result.files:
        shutil.move(path, moved / path.name)
    feed = _toy_feed(9)
    got = OrtRunner.from_path(moved / "toy.onnx", "toy", threads=1).infer(feed)["y"]
    with torch.no_grad():
        expected = toy(torch.from_numpy(feed["x"])).numpy()
    assert np.abs(got - expected).max() < 1e-5, np.abs(got - expected).max()


def test_export_graph_raises_over_tolerance(tmp_path):
    with pytest.raises(TrtCosyError, match=r"output 'y' max error .* > tolerance"):
        export_graph(
            TOY, _Toy(), _toy_feed(5), tmp_path / "toy.onnx", {"x": {1: Dim("T", min=1)}}, tolerance=-1.0
        )


class _NaNOutput(_Toy):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)  # [1, T, 4]
        return y * torch.sqrt(-torch.ones_like(y))  # NaN everywhere


def test_export_graph_refuses_non_finite_outputs(tmp_path):
    """A graph that yields NaN fails its parity check (NaN differences must not count as 0)."""
    with pytest.raises(TrtCosyError, match=r"output 'y' max error inf"):
        export_graph(TOY, _NaNOutput(), _toy_feed(5), tmp_path / "toy.onnx", {"x": {1: Dim("T", min=1)}})


class _TwoOutputs(_Toy):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = super().forward(x)  # y: [1, T, 4]
        return y, 2.0 * y


def test_export_graph_rejects_io_off_contract(tmp_path):
    with pytest.raises(TrtCosyError, match="contract 'toy' wants"):
        export_graph(TOY, _TwoOutputs(), _toy_feed(5), tmp_path / "toy.onnx", {"x": {1: Dim("T", min=1)}})


@pytest.mark.parametrize("name", list(graphs.GRAPHS))
def test_graph_matches_torch_at_two_new_lengths(tiny, torch_model, name):
    _, engines = tiny
    spec = graphs.GRAPHS[name]
    runner = OrtRunner.from_path(engines / f"{name}.onnx", name, threads=2, exported=True)
    plan = graph_export_plan(name, torch_model.config, seed=11)  # other values than the export used
    # The onnxruntime build fuses the non-streaming estimator's attention without key padding
    # (builder.onnx.rewrites): it serves unpadded rows only, which is all trt-cosy ever feeds it.
    unpadded = name != graphs.FLOW_ESTIMATOR.name
    feeds = [f for f in plan.parity if unpadded or bool(np.all(f["mask"] == 1))]
    assert feeds, "no parity feed left to check"
    for feed in feeds:
        expected = torch_model.runners[name].infer(feed)
        got = runner.infer(feed)
        for output in spec.output_names:
            assert got[output].shape == expected[output].shape, (name, output)
            error = float(np.abs(got[output] - expected[output]).max()) / max(
                1.0, np.abs(expected[output]).max()
            )
            lengths = {key: value.shape for key, value in feed.items()}
            assert error <= TOLERANCES[name], f"{name}.{output} at {lengths}: max error {error:.3e}"


def test_manifest_records_contract_io_with_symbolic_dims(tiny):
    _, engines = tiny
    manifest = Manifest.read(engines)
    assert manifest.opset == 18
    for name, spec in graphs.GRAPHS.items():
        record = manifest.graphs[name]
        assert tuple(t.name for t in record.inputs) == spec.input_names
        assert tuple(t.name for t in record.outputs) == spec.output_names
        assert max(record.max_errors.values()) <= TOLERANCES[name], record.max_errors
    llm = {t.name: t.shape for t in manifest.graphs["llm"].inputs}
    assert isinstance(llm["inputs_embeds"][1], str) and isinstance(llm["past_keys"][3], str), llm
    estimator = {t.name: t.shape for t in manifest.graphs["flow_estimator"].inputs}
    assert estimator["x"][0] == 2 and isinstance(estimator["x"][2], str), estimator
    hift = {t.name: t.shape for t in manifest.graphs["hift"].inputs}
    assert all(
        isinstance(hift[key][axis], str) for key, axis in (("mel", 2), ("sine_noise", 1), ("cache_source", 2))
    )
