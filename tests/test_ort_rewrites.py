"""ONNX Runtime graph rewrites (builder.onnx.rewrites): matched structurally, proven numerically.

Hand-made graphs in the exporter's spelling check each rewrite against the graph it replaces; the
tiny CosyVoice2 build checks that the estimators really get fused (the golden-parity tests of
test_verify and test_tts then run on these graphs).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import onnx
from onnx import TensorProto, helper, numpy_helper

from trt_cosy.builder.onnx.passes import (
    EQUIVALENCE_TOLERANCE,
    GRAPH_REWRITES,
    check_equivalent,
    rewrite_model,
)
from trt_cosy.builder.onnx.rewrites import fuse_attention, fuse_gelu, fuse_tanh_gelu, rewrite_mish
from trt_cosy.errors import BuildError
from trt_cosy.models.registry import read_release_config

B, T, HEADS, HEAD_DIM = 2, 37, 4, 8
WIDTH = HEADS * HEAD_DIM


def _value(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _model(nodes, inputs, initializers, opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, [_value("out", None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _attention_model(scaled_value: bool = False, seed: int = 0) -> onnx.ModelProto:
    """Self-attention as the dynamo exporter writes SDPA: q·√s and kᵀ·√s, bias, softmax, ·v."""
    rng = np.random.default_rng(seed)
    weights = {n: (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32) for n in "qkvo"}
    inits = [numpy_helper.from_array(w, f"w_{n}") for n, w in weights.items()]
    inits += [
        numpy_helper.from_array(np.array([B, -1, HEADS, HEAD_DIM], np.int64), "split"),
        numpy_helper.from_array(np.array([B, -1, WIDTH], np.int64), "merge"),
        numpy_helper.from_array(np.array(HEAD_DIM**-0.25, np.float32), "root_scale"),
    ]
    nodes = []
    for n in "qkv":
        nodes += [
            helper.make_node("MatMul", ["x", f"w_{n}"], [f"{n}_proj"]),  # [B, T, E]
            helper.make_node("Reshape", [f"{n}_proj", "split"], [f"{n}_split"]),  # [B, T, H, Dh]
            helper.make_node("Transpose", [f"{n}_split"], [f"{n}_heads"], perm=[0, 2, 1, 3]),  # [B, H, T, Dh]
        ]
    nodes += [
        helper.make_node("Mul", ["q_heads", "root_scale"], ["q_scaled"]),
        helper.make_node("Transpose", ["k_heads"], ["k_t"], perm=[0, 1, 3, 2]),  # [B, H, Dh, T]
        helper.make_node("Mul", ["root_scale", "k_t"], ["k_scaled"]),
        helper.make_node("MatMul", ["q_scaled", "k_scaled"], ["scores"]),  # [B, H, T, T]
        helper.make_node("Add", ["scores", "bias"], ["biased"]),
        helper.make_node("Softmax", ["biased"], ["weights"], axis=-1),
    ]
    value = "v_heads"
    if scaled_value:
        nodes.append(helper.make_node("Mul", ["v_heads", "root_scale"], ["v_scaled"]))
        value = "v_scaled"
    nodes += [
        helper.make_node("MatMul", ["weights", value], ["context"]),  # [B, H, T, Dh]
        helper.make_node("Transpose", ["context"], ["context_t"], perm=[0, 2, 1, 3]),  # [B, T, H, Dh]
        helper.make_node("Reshape", ["context_t", "merge"], ["merged"]),  # [B, T, E]
        helper.make_node("MatMul", ["merged", "w_o"], ["out"]),
    ]
    return _model(nodes, [_value("x", [B, T, WIDTH]), _value("bias", [B, 1, T, T])], inits)


def _attention_feed(bias_scale: float, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((B, T, WIDTH)).astype(np.float32),
        "bias": (bias_scale * rng.standard_normal((B, 1, T, T))).astype(np.float32),
    }


def _ops(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]


def test_attention_with_bias_becomes_one_node_with_the_same_outputs():
    before = _attention_model()
    after = copy.deepcopy(before)
    assert fuse_attention(after, drop_bias=False) == 1
    assert _ops(after).count("MultiHeadAttention") == 1
    assert "Softmax" not in _ops(after) and "Transpose" not in _ops(after)
    fused = next(n for n in after.graph.node if n.op_type == "MultiHeadAttention")
    assert list(fused.input) == ["q_proj", "k_proj", "v_proj", "", "", "bias"]
    worst = check_equivalent(before, after, [_attention_feed(3.0)], "attention")
    assert worst < 1e-5, f"fused attention differs by {worst:.2e} (relative)"


def test_dropping_the_bias_is_exact_for_a_zero_bias_and_caught_otherwise():
    before = _attention_model()
    after = copy.deepcopy(before)
    assert fuse_attention(after, drop_bias=True) == 1
    fused = next(n for n in after.graph.node if n.op_type == "MultiHeadAttention")
    assert list(fused.input) == ["q_proj", "k_proj", "v_proj"]  # the flash kernel's form
    worst = check_equivalent(before, after, [_attention_feed(0.0)], "attention")
    assert worst < 1e-5, f"zero-bias attention differs by {worst:.2e}"
    with pytest.raises(BuildError, match="changed the outputs"):
        check_equivalent(before, after, [_attention_feed(3.0)], "attention")


def test_a_site_outside_the_pattern_is_left_as_it_is():
    model = _attention_model(scaled_value=True)  # MultiHeadAttention has no scale on v
    untouched = copy.deepcopy(model)
    assert fuse_attention(model, drop_bias=False) == 0
    assert model == untouched


def test_mish_rewrite_matches_the_mish_op_at_every_magnitude():
    x = np.concatenate(
        [np.linspace(-30, 30, 4001), [-1e4, -100, -88, -20.5, 0.0, 1e-6, 19.99, 20.0, 20.01, 88, 100, 1e4]]
    ).astype(np.float32)
    before = _model([helper.make_node("Mish", ["x"], ["out"])], [_value("x", [len(x)])], [])
    after = copy.deepcopy(before)
    assert rewrite_mish(after) == 1
    assert "Mish" not in _ops(after)
    import onnxruntime as ort

    want, got = (
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
        for m in (before, after)
    )
    assert np.isfinite(got).all(), f"non-finite Mish at x = {x[~np.isfinite(got)]}"
    error = np.abs(got - want) / np.maximum(np.abs(want), 1e-30)
    small = np.abs(want) < 1e-30  # tails that underflow: both must be (signed) zero-ish
    assert np.abs(got[small]).max(initial=0.0) < 1e-30
    assert error[~small].max() < 2e-6, f"Mish rewrite relative error {error[~small].max():.2e}"


@pytest.mark.parametrize("half_first", [True, False])
def test_erf_gelu_in_either_multiplication_order_becomes_gelu(half_first):
    inits = [
        numpy_helper.from_array(np.array(np.sqrt(2.0), np.float32), "root2"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    first, second = (
        (["one_plus", "half"], ["scaled", "x"]) if half_first else (["x", "one_plus"], ["scaled", "half"])
    )
    nodes = [
        helper.make_node("Div", ["x", "root2"], ["ratio"]),
        helper.make_node("Erf", ["ratio"], ["erf"]),
        helper.make_node("Add", ["erf", "one"], ["one_plus"]),
        helper.make_node("Mul", first, ["scaled"]),
        helper.make_node("Mul", second, ["out"]),
    ]
    before = _model(nodes, [_value("x", [3, 50])], inits)
    after = copy.deepcopy(before)
    assert fuse_gelu(after) == 1
    assert _ops(after) == ["Gelu"]
    feed = {"x": np.random.default_rng(2).standard_normal((3, 50)).astype(np.float32) * 4}
    worst = check_equivalent(before, after, [feed], "gelu")
    assert worst < 1e-6, f"Gelu differs by {worst:.2e}"


def _tanh_gelu_model(half_first: bool, cubic: float = 0.044715) -> onnx.ModelProto:
    """``nn.GELU(approximate="tanh")`` as the exporter writes it (the CosyVoice3 DiT's FFN)."""
    inits = [
        numpy_helper.from_array(np.array(3.0, np.float32), "three"),
        numpy_helper.from_array(np.array(cubic, np.float32), "cubic"),
        numpy_helper.from_array(np.array(np.sqrt(2.0 / np.pi), np.float32), "scale"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
    ]
    first, second = (
        (["half", "one_plus"], ["x", "scaled"]) if half_first else (["x", "one_plus"], ["scaled", "half"])
    )
    nodes = [
        helper.make_node("Pow", ["x", "three"], ["cube"]),
        helper.make_node("Mul", ["cubic", "cube"], ["cube_scaled"]),
        helper.make_node("Add", ["x", "cube_scaled"], ["inner"]),
        helper.make_node("Mul", ["scale", "inner"], ["argument"]),
        helper.make_node("Tanh", ["argument"], ["tanh"]),
        helper.make_node("Add", ["tanh", "one"], ["one_plus"]),
        helper.make_node("Mul", first, ["scaled"]),
        helper.make_node("Mul", second, ["out"]),
    ]
    return _model(nodes, [_value("x", [3, 50])], inits)


@pytest.mark.parametrize("half_first", [True, False])
def test_tanh_gelu_in_either_multiplication_order_becomes_fast_gelu(half_first):
    before = _tanh_gelu_model(half_first)
    after = copy.deepcopy(before)
    assert fuse_tanh_gelu(after) == 1
    assert _ops(after) == ["FastGelu"]
    assert fuse_gelu(copy.deepcopy(before)) == 0  # the erf pattern does not take it
    feed = {"x": np.random.default_rng(3).standard_normal((3, 50)).astype(np.float32) * 4}
    worst = check_equivalent(before, after, [feed], "tanh gelu")
    assert worst < 1e-5, f"FastGelu differs by {worst:.2e}"


def test_a_tanh_gelu_with_another_constant_is_left_alone():
    model = _tanh_gelu_model(True, cubic=0.05)
    assert fuse_tanh_gelu(model) == 0
    assert "Tanh" in _ops(model)


def test_the_tolerance_is_tight_enough_to_catch_a_wrong_scale():
    before = _attention_model()
    after = copy.deepcopy(before)
    fuse_attention(after, drop_bias=False)
    fused = next(n for n in after.graph.node if n.op_type == "MultiHeadAttention")
    for attribute in fused.attribute:
        if attribute.name == "scale":
            attribute.f *= 1.01  # a 1 % error in the softmax temperature
    with pytest.raises(BuildError):
        check_equivalent(before, after, [_attention_feed(0.0)], "attention")
    assert EQUIVALENCE_TOLERANCE <= 1e-4


def test_rewrite_model_notes_dropped_key_padding_in_the_graph():
    model = _attention_model()
    counts = rewrite_model(model, GRAPH_REWRITES["flow_estimator"])
    assert (counts.attention, counts.mish, counts.gelu, counts.qwen2_attention) == (1, 0, 0, 0)
    assert "unpadded" in model.doc_string


def test_the_built_estimators_are_fused(tmp_path_factory, v2_tiny_dir: Path):
    from _support import shared_tiny_engines


    _, engines = shared_tiny_engines(tmp_path_factory, v2_tiny_dir)
    estimator = read_release_config(v2_tiny_dir).flow.estimator
    blocks = (2 + estimator.num_mid_blocks) * estimator.n_blocks  # down, mid blocks, up
    for name, inputs in (("flow_estimator", 3), ("flow_estimator_stream", 6)):
        model = onnx.load(str(engines / f"{name}.onnx"), load_external_data=False)
        fused = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"]
        assert len(fused) == blocks, f"{name}: {len(fused)} fused attention nodes, want {blocks}"
        assert all(len(n.input) == inputs for n in fused), f"{name}: wrong attention inputs"
        assert {"Softmax", "Mish", "Erf"}.isdisjoint(_ops(model)), f"{name}: unfused ops left"
    llm = onnx.load(str(engines / "llm.onnx"), load_external_data=False)
    layers = read_release_config(v2_tiny_dir).llm.qwen.num_layers
    assert _ops(llm).count("GroupQueryAttention") == layers, "every Qwen2 layer's attention is fused"
    assert {"Softmax", "Where", "Neg"}.isdisjoint(_ops(llm)), "unfused attention or rotary ops left"
    assert _ops(llm).count("Cos") == 1, "one rotary table for all layers"


def test_the_v3_dit_estimators_are_fused(tmp_path_factory):
    from _support import family_engines, family_release

    engines = family_engines(tmp_path_factory, "v3")
    depth = read_release_config(family_release(tmp_path_factory, "v3")).flow.estimator.depth
    for name in ("flow_estimator", "flow_estimator_stream"):
        model = onnx.load(str(engines / f"{name}.onnx"), load_external_data=False)
        ops = [n.op_type for n in model.graph.node]
        assert ops.count("MultiHeadAttention") == depth, f"{name}: {ops.count('MultiHeadAttention')} attention"
        assert ops.count("FastGelu") == depth, f"{name}: {ops.count('FastGelu')} FastGelu, want {depth}"
        assert "Tanh" not in ops and "Pow" not in ops, f"{name}: an unfused tanh GELU is left"
