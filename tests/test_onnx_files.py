"""builder.onnx.files.save_onnx: large graphs keep their weights in <file>.data, wherever the CWD is."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from trt_cosy.builder.onnx import files as onnx_files


def _model(weight: np.ndarray) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, weight.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, weight.shape[1]])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


def test_large_graph_goes_to_external_data_even_beside_a_same_named_file(tmp_path, monkeypatch):
    weight = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    monkeypatch.setattr(onnx_files, "EXTERNAL_DATA_BYTES", 0)  # every graph counts as large
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    (elsewhere / "g.onnx.data").write_bytes(b"not ours")  # onnx's own check would refuse this
    monkeypatch.chdir(elsewhere)
    out = tmp_path / "engines" / "g.onnx"
    stale = out.with_name("g.onnx.data")
    stale.parent.mkdir()
    stale.write_bytes(b"stale")
    onnx_files.save_onnx(_model(weight), out, check=True)
    assert stale.stat().st_size == weight.nbytes, "weights belong in <file>.data, the stale file replaced"
    assert (elsewhere / "g.onnx.data").read_bytes() == b"not ours"
    x = np.ones((1, 64), np.float32)
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, x @ weight, rtol=1e-5)


def test_small_graph_stays_in_one_file(tmp_path):
    out = onnx_files.save_onnx(_model(np.eye(4, dtype=np.float32)), tmp_path / "small.onnx")
    assert not out.with_name("small.onnx.data").exists()
