"""tools/experiments/decode/llm_batch_variants.py derives llm_batch variants that compute what the int4 graph computes:
requantising at block 32 reproduces ``trt-cosy build``'s weights, the gate/up fusion and the bias
fold change no result, other block sizes and int8 weights err like the build's int4."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")
ort = pytest.importorskip("onnxruntime", reason="needs onnxruntime")

import onnx
from onnx import TensorProto, helper, numpy_helper

from trt_cosy.builder.quantize.engines import quantize_weights_nbits

_SPEC = importlib.util.spec_from_file_location(
    "llm_batch_variants", Path(__file__).parents[1] / "tools" / "experiments" / "decode" / "llm_batch_variants.py"
)
variants = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(variants)

_K, _N, _QKV = 256, 64, 96


def _toy_mlp(directory: Path) -> None:
    """x [1, T, K] -> qkv (+bias) and SiLU(x Wg) * (x Wu) Wd: the LLM's MatMul patterns, fp32,
    weights in an external data file as the fp32 engines store them."""
    rng = np.random.default_rng(0)
    weights = {
        "qkv_w": rng.standard_normal((_K, _QKV)).astype(np.float32),  # [K, 3H]
        "qkv_b": rng.standard_normal(_QKV).astype(np.float32),
        "gate_w": rng.standard_normal((_K, _N)).astype(np.float32),  # [K, N]
        "up_w": rng.standard_normal((_K, _N)).astype(np.float32),
        "down_w": rng.standard_normal((_N, _K)).astype(np.float32),  # [N, K]
    }
    nodes = [
        helper.make_node("MatMul", ["x", "qkv_w"], ["qkv_p"], name="qkv/matmul"),
        helper.make_node("Add", ["qkv_p", "qkv_b"], ["qkv"], name="qkv/bias"),
        helper.make_node("MatMul", ["x", "gate_w"], ["gate"], name="gate"),
        helper.make_node("Sigmoid", ["gate"], ["sig"]),
        helper.make_node("Mul", ["gate", "sig"], ["silu"]),
        helper.make_node("MatMul", ["x", "up_w"], ["up"], name="up"),
        helper.make_node("Mul", ["silu", "up"], ["act"]),
        helper.make_node("MatMul", ["act", "down_w"], ["y"], name="down"),
    ]
    graph = helper.make_graph(
        nodes,
        "llm_batch",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", _K])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("qkv", TensorProto.FLOAT, None),
        ],
        [numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    directory.mkdir()
    onnx.save(model, str(directory / "llm_batch.onnx"), save_as_external_data=True,
              location="llm_batch.onnx.data", size_threshold=0)  # fmt: skip


def _run(model: onnx.ModelProto | Path, x: np.ndarray) -> list[np.ndarray]:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return session.run(["y", "qkv"], {"x": x})


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("variants")
    _toy_mlp(root / "fp32")
    (root / "int4").mkdir()
    quantize_weights_nbits(root / "fp32" / "llm_batch.onnx", root / "int4" / "llm_batch.onnx", bits=4)
    return root / "int4", root / "fp32"


def test_block_32_requantisation_reproduces_the_build(toy):
    int4, fp32 = toy
    built = {
        i.name: numpy_helper.to_array(i) for i in onnx.load(str(int4 / "llm_batch.onnx")).graph.initializer
    }
    derived = variants.derive(int4, fp32, "llm_batch", "block=32")
    for init in derived.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(init), built[init.name])


def test_gate_up_fusion_and_bias_fold_change_no_result(toy):
    int4, fp32 = toy
    fused = variants.derive(int4, fp32, "llm_batch", "gateup,bias")
    ops = [node.op_type for node in fused.graph.node]
    assert ops.count("MatMulNBits") == 3 and "Split" in ops and "Add" not in ops
    x = np.random.default_rng(1).standard_normal((1, 4, _K)).astype(np.float32)  # [1, T, K]
    for got, want in zip(_run(fused, x), _run(int4 / "llm_batch.onnx", x), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_other_precisions_err_like_the_build(toy):
    """RMS error against fp32: block 128 within 1.5x the build's block 32, int8 weights well under it."""
    int4, fp32 = toy
    x = np.random.default_rng(2).standard_normal((1, 3, _K)).astype(np.float32)  # [1, T, K]
    exact = _run(fp32 / "llm_batch.onnx", x)[0]

    def error(output: np.ndarray) -> float:
        return float(np.sqrt(((output - exact) ** 2).mean() / (exact**2).mean()))

    build = error(_run(int4 / "llm_batch.onnx", x)[0])
    assert 0 < build < 0.2
    block_128 = variants.derive(int4, fp32, "llm_batch", "block=128")
    blocks = {
        a.i
        for n in block_128.graph.node
        if n.op_type == "MatMulNBits"
        for a in n.attribute
        if a.name == "block_size"
    }
    assert blocks == {128}
    assert error(_run(block_128, x)[0]) < 1.5 * build
    assert error(_run(variants.derive(int4, fp32, "llm_batch", "int8dyn"), x)[0]) < 0.25 * build
