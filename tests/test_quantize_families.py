"""int8/int4 engines for CosyVoice 1 and 3 (builder/quantize/engines.py): plan, graphs, quality vs fp32, say.

The fp32 engines are the session's golden-tiny builds of tests/test_families_e2e.py
(``family_engines``: built here only when that module did not run first in the session); the int4
engines are derived from them once per module (``derive_engines``, the same ``quantize_engines``
step ``trt-cosy build --precision int4`` runs after the export).

Quality bounds (docs/precision.md, "CosyVoice 1 and 3"): measured on these golden inputs, int4 (LLM
block 128) gives an LLM KL mean of 0.0019 (v1) and 0.0009 (v3) nats and a flow mel SNR of 39.3 / 38.0 dB. The test
holds KL ≤ 0.01 (5x headroom for other CPUs' int8 kernels, 5x under the 0.05 product bar) and mel
SNR ≥ 30 dB (v1 36.3 dB with its estimator's int8 middle-block convolutions); HiFT's residual-block convolutions are int8 (calibrated through the flow): waveform SNR
38.9 (v1) / 42.6 (v3) dB measured, held to ≥ 30 dB.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs the [build] extra (torch)")
pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import onnx
import soundfile
from _support import GOLDEN, family_engines
from click.testing import CliRunner

from trt_cosy.builder.family_engines import check_family_options
from trt_cosy.builder.quantize.engines import QUANTIZABLE_FAMILIES, derive_engines, precision_plan
from trt_cosy.builder.quantize.estimator_int8 import ESTIMATOR_GRAPHS, estimator_convolutions
from trt_cosy.builder.quantize.vocoder_int8 import int8_convolutions
from trt_cosy.cli import main
from trt_cosy.errors import InputError
from trt_cosy.runtime.engines import load_engines
from trt_cosy.runtime.manifest import Manifest
from trt_cosy.verify.quality import THRESHOLDS, QualityInputs, quality_guard

FAMILIES = ("v1", "v3")
KL_BOUND = 0.01  # nats, LLM next-token KL mean vs fp32 (measured int4: 0.0019 v1, 0.0009 v3)
MEL_SNR_BOUND = 30.0  # dB, flow mel vs fp32 (measured: 36.3 v1 with int8 middle-block convolutions, 38.0 v3)
HIFT_SNR_BOUND = 30.0  # dB, waveform vs fp32, int8 residual-block convolutions (measured: 38.9 v1, 42.6 v3)
TOP1_BOUND = 0.5  # sanity only: near-ties of random weights flip (measured int4: 0.78 v1, 0.81 v3)
_QUANTIZED_OPS = ("MatMulNBits", "DynamicQuantizeLinear", "MatMulInteger")


@pytest.fixture(scope="module")
def fp32(tmp_path_factory) -> dict[str, Path]:
    return {family: family_engines(tmp_path_factory, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def int4(fp32, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("int4-families")
    return {family: derive_engines(path, root / family, "int4") for family, path in fp32.items()}


def _ops(path: Path) -> Counter:
    return Counter(node.op_type for node in onnx.load(str(path)).graph.node)


def _blocks(path: Path) -> int:
    """The one block size of the MatMulNBits nodes of ``path``."""
    (block,) = {
        onnx.helper.get_attribute_value(attribute)
        for node in onnx.load(str(path), load_external_data=False).graph.node
        if node.op_type == "MatMulNBits"
        for attribute in node.attribute
        if attribute.name == "block_size"
    }
    return block


def _matrix_weight_matmuls(path: Path) -> int:
    """MatMuls whose second input is a constant 2-D weight (what the quantisers may change)."""
    graph = onnx.load(str(path)).graph
    matrices = {init.name for init in graph.initializer if len(init.dims) == 2}
    return sum(node.op_type == "MatMul" and node.input[1] in matrices for node in graph.node)


def test_plans_of_v1_and_v3():
    assert {"v1", "v2", "v3"} <= QUANTIZABLE_FAMILIES
    v1 = {plan.graph: (plan.method, plan.fuse_rms_norm) for plan in precision_plan("int4", "v1")}
    assert v1 == {
        "v1_text_encoder": ("fp32", False),
        "llm": ("nbits4", False),  # TransformerLM: LayerNorm, nothing to fuse
        "v1_flow_encoder": ("fp32", False),
        "flow_estimator": ("int8", False),
        "v1_hift": ("int8conv", False),  # the residual blocks' convolutions, calibrated
    }
    v3 = {plan.graph: (plan.method, plan.fuse_rms_norm) for plan in precision_plan("int8", "v3")}
    assert v3 == {
        "llm": ("nbits8", True),  # Qwen2: RMSNorms fused first
        "flow_encoder": ("fp32", False),
        "flow_estimator": ("int8+nbits8", False),  # DiT: its AdaLN Gemms 8-bit weight-only too
        "flow_estimator_stream": ("int8+nbits8", False),
        "hift": ("int8conv", False),
        "hift_stream": ("int8conv", False),
    }
    assert {plan.method for plan in precision_plan("fp32", "v1")} == {"fp32"}
    with pytest.raises(InputError, match="family"):
        precision_plan("int4", "v9")


@pytest.mark.parametrize("family", FAMILIES)
def test_build_accepts_reduced_precisions(family):
    assert check_family_options(GOLDEN[family], "onnxruntime", "int4") == family
    assert check_family_options(GOLDEN[family], "onnxruntime", "int8") == family


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_int4_graphs_change_where_the_plan_says(fp32, int4, family):
    Manifest.read(int4[family]).check(int4[family], precision="int4")
    for plan in precision_plan("int4", family):
        before, after = _ops(fp32[family] / f"{plan.graph}.onnx"), _ops(int4[family] / f"{plan.graph}.onnx")
        expected = _matrix_weight_matmuls(fp32[family] / f"{plan.graph}.onnx")
        if plan.method == "fp32":  # encoders: untouched
            assert not any(after[op] for op in _QUANTIZED_OPS), (plan.graph, after)
            assert after == before, plan.graph
        elif plan.method == "int8conv":  # HiFT: the residual blocks' convolutions in QDQ form, nothing else
            quantised = len(int8_convolutions(onnx.load(str(fp32[family] / f"{plan.graph}.onnx"))))
            assert quantised > 0 and after["Conv"] == before["Conv"], (plan.graph, after)
            # per convolution: its input and its output quantised (QuantizeLinear), three DequantizeLinear
            # (input, output, the int8 weight); a tensor two convolutions share is quantised once
            assert after["DequantizeLinear"] >= 2 * quantised and after["QuantizeLinear"] >= quantised, after
            assert after - Counter({"QuantizeLinear": after["QuantizeLinear"],
                                    "DequantizeLinear": after["DequantizeLinear"]}) == before, plan.graph  # fmt: skip
        elif plan.method == "nbits4":
            assert after["MatMulNBits"] == expected > 0, (plan.graph, expected, after)
            moved = before - Counter({"MatMul": expected})
            if plan.fuse_rms_norm:  # x * Reciprocal(Sqrt(v)) -> x / Sqrt(v)
                fused = before["Reciprocal"]
                assert fused > 0 and after["Reciprocal"] == 0, after
                moved = moved - Counter({"Reciprocal": fused, "Mul": fused}) + Counter({"Div": fused})
            assert after - Counter({"MatMulNBits": expected}) == moved, (plan.graph, before, after)
        else:  # dynamic int8: every matrix-weight MatMul becomes MatMulInteger on quantised inputs
            assert after["MatMulInteger"] == expected > 0 and after["DynamicQuantizeLinear"] > 0, after
            # the quantiser rewrites each Gemm (time-embedding MLPs, the DiT's AdaLN) as a float MatMul
            # (+ Add); the DiT's plan then makes those 8-bit weight-only
            gemms = before["Gemm"]
            if plan.method == "int8+nbits8":
                assert after["MatMulNBits"] == gemms > 0, (plan.graph, before, after)
                gemms = 0
            assert after["MatMul"] == before["MatMul"] - expected + gemms, (plan.graph, after)
            assert after["Gemm"] == 0, after
            # the U-Net's middle-block convolutions in QDQ form (builder/quantize/estimator_int8.py), none in the DiT
            middle = len(estimator_convolutions(onnx.load(str(fp32[family] / f"{plan.graph}.onnx"))))
            assert (middle > 0) == (plan.graph in ESTIMATOR_GRAPHS[family]), (plan.graph, middle)
            if plan.graph not in ESTIMATOR_GRAPHS[family]:
                middle = 0
            assert after["QuantizeLinear"] >= middle and after["DequantizeLinear"] >= 2 * middle, after
            assert after["Conv"] == before["Conv"] and (middle or not after["QuantizeLinear"]), after
    # the manifest's n-bit block sizes are those of the graphs' MatMulNBits nodes (LLM 128, DiT AdaLN 32)
    recorded = Manifest.read(int4[family]).nbits_blocks
    assert recorded == {name: _blocks(int4[family] / f"{name}.onnx") for name in recorded}, recorded
    assert recorded["llm"] == 128 and all(recorded.get(plan.graph) for plan in precision_plan("int4", family)
                                           if "nbits" in plan.method), recorded  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_int4_quality_vs_fp32_on_the_golden_inputs(fp32, int4, family):
    with np.load(GOLDEN[family] / "reference.npz") as data:
        inputs = QualityInputs.from_golden({key: data[key] for key in data.files})
    rows = {
        row.metric: row
        for row in quality_guard(
            load_engines(fp32[family], threads=1), load_engines(int4[family], threads=1), inputs
        )
    }
    report = ", ".join(f"{name} {row.value:.4g}" for name, row in rows.items())
    assert all(rows[name].passed for name in THRESHOLDS), report
    assert rows["llm_kl_mean"].value <= KL_BOUND, report
    assert rows["flow_mel_snr_db"].value >= MEL_SNR_BOUND, report
    assert rows["hift_wav_snr_db"].value >= HIFT_SNR_BOUND, report
    assert rows["llm_top1"].value >= TOP1_BOUND, report


@pytest.mark.slow
def test_v1_int4_engines_say(int4, tmp_path):
    out = tmp_path / "int4.wav"
    result = CliRunner().invoke(
        main,
        ["say", "Good morning.", "--speaker", "英文男", "--engines", str(int4["v1"]), "--threads", "1",
         "--seed", "3", "-o", str(out)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    audio, rate = soundfile.read(out, dtype="float32")
    assert rate == 22050 and audio.ndim == 1 and audio.size > 0 and np.isfinite(audio).all()
    assert float(np.abs(audio).max()) > 1e-3, "silent int4 output"
