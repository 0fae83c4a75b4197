"""OrtRunner on a small ONNX model made with onnx.helper: names, dtype casting, errors, threads."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

from _support import save_test_graph
from onnx import TensorProto, helper, numpy_helper

from trt_cosy.errors import EngineMismatchError, InputError, ModelDirError
from trt_cosy.runtime import heap
from trt_cosy.runtime.backends.base import Runner
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner, default_threads

TABLE = np.random.default_rng(7).standard_normal((50, 16)).astype(np.float32)  # TABLE: [V, D]


def _write_lookup_model(path: Path) -> Path:
    """``ids`` int32 [1, T], ``scale`` float32 [1] -> ``embedded`` float32 [1, T, 16], ``next_ids`` int32 [1, T]."""
    nodes = [
        helper.make_node("Gather", ["table", "ids"], ["gathered"], axis=0),  # [1, T, 16]
        helper.make_node("Mul", ["gathered", "scale"], ["embedded"]),
        helper.make_node("Add", ["ids", "one"], ["next_ids"]),
    ]
    graph = helper.make_graph(
        nodes,
        "lookup",
        [
            helper.make_tensor_value_info("ids", TensorProto.INT32, [1, "T"]),
            helper.make_tensor_value_info("scale", TensorProto.FLOAT, [1]),
        ],
        [
            helper.make_tensor_value_info("embedded", TensorProto.FLOAT, [1, "T", 16]),
            helper.make_tensor_value_info("next_ids", TensorProto.INT32, [1, "T"]),
        ],
        initializer=[
            numpy_helper.from_array(TABLE, "table"),
            numpy_helper.from_array(np.array(1, dtype=np.int32), "one"),
        ],
    )
    return save_test_graph(graph, path)


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> OrtRunner:
    path = _write_lookup_model(tmp_path_factory.mktemp("ort") / "lookup.onnx")
    return OrtRunner.from_path(path, "lookup", threads=1)


def test_names_and_specs(runner):
    assert isinstance(runner, Runner)
    assert runner.name == "lookup"
    assert runner.input_names == ("ids", "scale")
    assert runner.output_names == ("embedded", "next_ids")
    specs = runner.input_specs()
    assert specs["ids"] == ((1, "T"), np.dtype(np.int32))
    assert specs["scale"] == ((1,), np.dtype(np.float32))


def test_session_options(runner):
    options = runner.session.get_session_options()
    assert options.intra_op_num_threads == 1
    assert options.inter_op_num_threads == 1
    assert runner.session.get_providers() == ["CPUExecutionProvider"]
    assert default_threads() >= 1


def test_infer_casts_int64_and_float64(runner):
    ids = np.array([[3, 0, 49, 7]], dtype=np.int64)  # ids: [1, 4], int64 where the model wants int32
    outputs = runner.infer({"ids": ids, "scale": np.array([2.0])})  # scale: float64
    assert set(outputs) == {"embedded", "next_ids"}
    assert outputs["next_ids"].dtype == np.int32
    np.testing.assert_array_equal(outputs["next_ids"], ids + 1)
    expected = 2.0 * TABLE[ids[0]][None]  # expected: [1, 4, 16]
    max_error = float(np.abs(outputs["embedded"] - expected).max())
    assert outputs["embedded"].dtype == np.float32 and max_error <= 1e-6, f"max error {max_error:.3g}"


def test_infer_rejects_unsafe_cast_and_missing_input(runner):
    with pytest.raises(InputError, match="'ids' is int32"):
        runner.infer({"ids": np.array([[1.5]]), "scale": np.array([1.0], np.float32)})
    with pytest.raises(InputError, match="missing \\['scale'\\]"):
        runner.infer({"ids": np.array([[1]], np.int32)})


def test_outputs_belong_to_caller(runner):
    feed = {"ids": np.array([[1, 2]], np.int32), "scale": np.array([1.0], np.float32)}
    first = runner.infer(feed)
    kept = first["embedded"].copy()
    runner.infer({"ids": np.array([[5, 6]], np.int32), "scale": np.array([3.0], np.float32)})
    np.testing.assert_array_equal(first["embedded"], kept)


def test_shared_runner_across_threads(runner):
    rng = np.random.default_rng(0)
    feeds = [
        {"ids": rng.integers(0, 50, (1, int(rng.integers(1, 40)))), "scale": rng.random(1)} for _ in range(32)
    ]
    serial = [runner.infer(feed) for feed in feeds]
    with ThreadPoolExecutor(max_workers=4) as pool:
        parallel = list(pool.map(runner.infer, feeds))
    for one, other in zip(serial, parallel, strict=True):
        for key in runner.output_names:
            np.testing.assert_array_equal(one[key], other[key])


def test_loading_returns_the_freed_heap_pages(tmp_path, monkeypatch):
    """The model bytes and pre-prepacking copies freed by a session load go back to the OS at once."""
    calls = []
    monkeypatch.setattr(heap, "release_free", lambda: calls.append(True) or True)
    OrtRunner.from_path(_write_lookup_model(tmp_path / "lookup.onnx"), "lookup", threads=1)
    assert calls == [True]


def test_missing_and_corrupt_files(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist. Re-download"):
        OrtRunner.from_path(tmp_path / "absent.onnx", "campplus")
    corrupt = tmp_path / "corrupt.onnx"
    corrupt.write_bytes(b"not an onnx model" * 8)
    with pytest.raises(ModelDirError, match="could not load"):
        OrtRunner.from_path(corrupt, "campplus")
    with pytest.raises(EngineMismatchError, match="trt-cosy build"):
        OrtRunner.from_path(corrupt, "flow_estimator", exported=True)


@pytest.mark.parametrize(
    ("version", "ok"), [("1.32.0", True), ("1.22.1", True), ("1.20.1", False), ("1.9.0", False)]
)
def test_engines_need_a_recent_onnxruntime(version, ok):
    from trt_cosy.errors import MissingDependencyError
    from trt_cosy.runtime.backends.onnxruntime.runner import check_engine_runtime

    if ok:
        check_engine_runtime(version)
    else:
        with pytest.raises(MissingDependencyError, match=r"pip install 'onnxruntime>=1\.22'"):
            check_engine_runtime(version)
