"""Reduced-precision graphs (builder/quantize/engines.py) and the ORT KV decoder, on the golden tiny LLM.

The tiny LLM graph is exported once per module (dynamo, a few seconds). The fp32 graph through
``OrtKVDecoder`` must match the golden cached log-probs (1e-4, golden README); the 4/8-bit graphs
are held to the quality guard's KL bar against the golden teacher-forced logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs the [build] extra (torch)")
pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import onnx
from _support import save_test_graph
from onnx import TensorProto, helper, numpy_helper

from trt_cosy.builder.export import export_graph, graph_export_plan
from trt_cosy.builder.modules.llm import LLMGraph, embedding_tables, load_llm
from trt_cosy.builder.quantize.engines import (
    fuse_rms_norm,
    nbits_blocks,
    precision_plan,
    quantize_float_matmuls_nbits,
    quantize_matmul_int8,
    quantize_weights_nbits,
)
from trt_cosy.errors import InputError
from trt_cosy.models.registry import read_release_config
from trt_cosy.runtime import graphs
from trt_cosy.runtime.backends.onnxruntime.runner import OrtKVDecoder, OrtRunner
from trt_cosy.stages.llm import LLMStage
from trt_cosy.verify.quality import THRESHOLDS, next_token_agreement, snr_db

TOL = 1e-4  # golden README: llm_tf_cached_logp
PREFILL_LEN = 43  # [sos, 16 text, task, 25 prompt speech]


@pytest.fixture(scope="module")
def tiny_llm(v2_tiny_dir, tmp_path_factory) -> tuple[Path, LLMStage]:
    """(fp32 llm.onnx, an LLMStage over it on ORT)."""
    config = read_release_config(v2_tiny_dir)
    model = load_llm(v2_tiny_dir, config.llm)
    plan = graph_export_plan(graphs.LLM.name, config)
    path = tmp_path_factory.mktemp("quantize") / "llm.onnx"
    export_graph(
        graphs.LLM, LLMGraph(model), plan.sample, path, plan.dynamic_shapes, parity_inputs=plan.parity
    )
    runner = OrtRunner.from_path(path, "llm", threads=1, exported=True)
    return path, LLMStage(runner, embedding_tables(model), config.llm)


def _stage_on(path: Path, like: LLMStage) -> LLMStage:
    tables = {
        "text_embedding": like.text_embedding,
        "speech_embedding": like.speech_embedding,
        "llm_embedding": like.llm_embedding,
    }
    return LLMStage(OrtRunner.from_path(path, "llm", threads=1), tables, like.config)


def test_precision_plan():
    plan = {item.graph: item.method for item in precision_plan("int4", "v2")}
    assert plan == {
        "llm": "nbits4",
        "flow_encoder": "fp32",
        "flow_estimator": "int8",
        "flow_estimator_stream": "int8",
        "hift": "int8conv",
    }
    assert {item.method for item in precision_plan("fp32", "v2")} == {"fp32"}
    assert dict((item.graph, item.method) for item in precision_plan("int8", "v2"))["llm"] == "nbits8"
    with pytest.raises(InputError, match="unknown"):
        precision_plan("int2", "v2")


def test_nbits_block_sizes_and_their_manifest_record():
    """int4 LLMs: blocks of 128 (faster decode, same guard; docs/precision.md); every other n-bit user
    keeps 32 (int8 LLMs, the v3 DiT's AdaLN weights); the batched decode graph has the LLM's."""
    blocks = {
        family: {p.graph: p.nbits_block for p in precision_plan("int4", family)}
        for family in ("v1", "v2", "v3")
    }
    assert blocks["v2"] == dict.fromkeys(("llm",), 128) | dict.fromkeys(
        ("flow_encoder", "flow_estimator", "flow_estimator_stream", "hift")
    )
    assert blocks["v1"]["llm"] == blocks["v3"]["llm"] == 128
    assert blocks["v3"]["flow_estimator"] == blocks["v3"]["flow_estimator_stream"] == 32  # 8-bit AdaLN
    assert {p.nbits_block for p in precision_plan("int8", "v2")} == {32, None}
    assert {p.nbits_block for p in precision_plan("fp32", "v3")} == {None}
    names = ("llm", "llm_batch", "flow_estimator", "flow_estimator_stream", "hift")
    assert nbits_blocks("int4", "v2", names) == {"llm": 128, "llm_batch": 128}
    assert nbits_blocks("int4", "v3", names) == {
        "llm": 128, "llm_batch": 128, "flow_estimator": 32, "flow_estimator_stream": 32
    }  # fmt: skip
    assert nbits_blocks("int8", "v2", ("llm",)) == {"llm": 32}
    mixed = ("llm", "llm_batch")  # the ONNX Runtime graphs of mixed engines
    assert nbits_blocks("int4", "v3", mixed) == {"llm": 128, "llm_batch": 128}
    assert nbits_blocks("fp32", "v2", names) == {}


def _rms_norm_model(path: Path, width: int = 8) -> Path:
    """RMSNorm in the exported form: x * Reciprocal(Sqrt(mean(x²) + eps)) * weight."""
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["squared"]),
        helper.make_node("ReduceMean", ["squared", "axes"], ["mean"], keepdims=1),
        helper.make_node("Add", ["mean", "eps"], ["shifted"]),
        helper.make_node("Sqrt", ["shifted"], ["root"]),
        helper.make_node("Reciprocal", ["root"], ["rsqrt"]),
        helper.make_node("Mul", ["x", "rsqrt"], ["normed"]),
        helper.make_node("Mul", ["weight", "normed"], ["y"]),
    ]
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        nodes,
        "rms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", width])],
        initializer=[
            numpy_helper.from_array(np.array(2.0, np.float32), "two"),
            numpy_helper.from_array(np.array([-1], np.int64), "axes"),
            numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
            numpy_helper.from_array(rng.standard_normal(width).astype(np.float32), "weight"),
        ],
    )
    return save_test_graph(graph, path, check=False)


def test_fuse_rms_norm_is_exact(tmp_path):
    path = _rms_norm_model(tmp_path / "rms.onnx")
    model = onnx.load(str(path))
    assert fuse_rms_norm(model) == 1
    assert [node.op_type for node in model.graph.node].count("Reciprocal") == 0
    onnx.save(model, str(tmp_path / "fused.onnx"))
    x = np.random.default_rng(1).standard_normal((1, 5, 8)).astype(np.float32)  # x: [1, 5, 8]
    before = OrtRunner.from_path(path, "rms", threads=1).infer({"x": x})["y"]
    after = OrtRunner.from_path(tmp_path / "fused.onnx", "rms", threads=1).infer({"x": x})["y"]
    error = float(np.abs(before - after).max())
    assert error <= 1e-6, f"fused RMSNorm max error {error:.3g}"


def test_kv_decoder_matches_golden(tiny_llm, v2_reference):
    _, stage = tiny_llm
    assert isinstance(stage._decoder(), OrtKVDecoder)  # the ORT path, not the generic feed loop
    prefix = v2_reference["llm_tf_lm_input"][:, :PREFILL_LEN]  # [1, 43, D]
    forced = v2_reference["in_target_speech_token"][0, :8]
    logp = stage.cached_logp(prefix, forced)
    error = float(np.abs(logp - v2_reference["llm_tf_cached_logp"]).max())
    assert error <= TOL, f"llm_tf_cached_logp through OrtKVDecoder: max abs error {error:.3g} > {TOL}"


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_only_llm_meets_the_kl_bar(tiny_llm, v2_reference, tmp_path, bits):
    path, stage = tiny_llm
    target = tmp_path / f"llm_q{bits}.onnx"
    plan = {p.graph: p for p in precision_plan("int4" if bits == 4 else "int8", "v2")}["llm"]
    block = plan.nbits_block  # the build's: 128 (int4), 32 (int8)
    assert quantize_weights_nbits(path, target, bits=bits, block_size=block) == 15  # 2 layers x 7 + the head
    blocks = {
        helper.get_attribute_value(a)
        for node in onnx.load(str(target)).graph.node
        if node.op_type == "MatMulNBits"
        for a in node.attribute
        if a.name == "block_size"
    }
    assert blocks == {block}
    ops = {node.op_type for node in onnx.load(str(target)).graph.node}
    assert "MatMulNBits" in ops and "Reciprocal" not in ops
    logits, _ = _stage_on(target, stage).teacher_forced(v2_reference["llm_tf_lm_input"])  # [1, L, V]
    kl_mean, kl_max, top1 = next_token_agreement(v2_reference["llm_tf_logits"][0], logits[0])
    bound = THRESHOLDS["llm_kl_mean"][0]
    assert kl_mean <= bound, (
        f"{bits}-bit LLM KL mean {kl_mean:.3g} > {bound} (max {kl_max:.3g}, top-1 {top1:.2f})"
    )
    if bits == 8:
        assert kl_mean < 1e-3, f"8-bit LLM KL mean {kl_mean:.3g}: 8-bit weights should be near-lossless"


def test_int8_matmul_only_quantises_constant_weights(tmp_path):
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((64, 32)).astype(np.float32)  # [K, N]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),  # constant weight: quantised
        helper.make_node("MatMul", ["xw", "z"], ["y"]),  # activation x activation: left fp32
    ]
    graph = helper.make_graph(
        nodes,
        "mm",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [32, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[numpy_helper.from_array(weight, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "mm.onnx"))
    assert quantize_matmul_int8(tmp_path / "mm.onnx", tmp_path / "mm_int8.onnx") == 1
    ops = [node.op_type for node in onnx.load(str(tmp_path / "mm_int8.onnx")).graph.node]
    assert ops.count("MatMul") == 1, f"only the constant-weight MatMul may change: {ops}"
    feed = {
        "x": rng.standard_normal((50, 64)).astype(np.float32),
        "z": rng.standard_normal((32, 4)).astype(np.float32),
    }
    expected = OrtRunner.from_path(tmp_path / "mm.onnx", "mm", threads=1).infer(feed)["y"]
    got = OrtRunner.from_path(tmp_path / "mm_int8.onnx", "mm", threads=1).infer(feed)["y"]
    snr = snr_db(expected, got)
    assert snr >= 30.0, f"int8 MatMul SNR {snr:.1f} dB < 30 dB"


def test_float_matmuls_left_after_the_int8_pass_become_8_bit_weight_only(tmp_path):
    """The v3 DiT's AdaLN after ``quantize_matmul_int8``: a float MatMul on 2 rows -> MatMulNBits."""
    rng = np.random.default_rng(3)
    nodes = [
        helper.make_node("MatMul", ["t", "g"], ["tg_raw"]),  # [2, 64] x [64, 96]: the modulation
        helper.make_node("Add", ["tg_raw", "b"], ["tg"]),
        helper.make_node("MatMul", ["tg", "z"], ["y"]),  # activation x activation: left alone
    ]
    weights = {
        "g": rng.standard_normal((64, 96)).astype(np.float32),
        "b": rng.standard_normal(96).astype(np.float32),
    }
    graph = helper.make_graph(
        nodes,
        "adaln",
        [
            helper.make_tensor_value_info("t", TensorProto.FLOAT, [2, 64]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [96, 4]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        initializer=[numpy_helper.from_array(value, name) for name, value in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "g.onnx"))
    onnx.save(model, str(tmp_path / "g_q.onnx"))
    assert quantize_float_matmuls_nbits(tmp_path / "g_q.onnx") == 1
    ops = [node.op_type for node in onnx.load(str(tmp_path / "g_q.onnx")).graph.node]
    assert ops.count("MatMulNBits") == 1 and ops.count("MatMul") == 1, ops
    assert quantize_float_matmuls_nbits(tmp_path / "g_q.onnx") == 0  # nothing float is left
    feed = {
        "t": rng.standard_normal((2, 64)).astype(np.float32),
        "z": rng.standard_normal((96, 4)).astype(np.float32),
    }
    expected = OrtRunner.from_path(tmp_path / "g.onnx", "g", threads=1).infer(feed)["y"]
    got = OrtRunner.from_path(tmp_path / "g_q.onnx", "g", threads=1).infer(feed)["y"]
    snr = snr_db(expected, got)
    assert snr >= 30.0, f"8-bit weight-only MatMul SNR {snr:.1f} dB < 30 dB"
