"""int8 middle-block convolutions in the flow estimator (builder/quantize/estimator_int8.py), golden tiny CosyVoice2.

What is quantised (the middle blocks' kernel-3 convolutions; not their residual ones, none of the
outer blocks'), where the
calibration feeds come from (every solver step of the checkpoint's own flow, then the same feeds
moved into a trained flow's log-mel range), that the fp32 graph a derived directory hard-links is
never written through, that the directory keeps loading, and the mel against fp32 on the golden
inputs: measured 36.9 dB for the tiny CosyVoice2 (fp32 engines plus the int8 convolutions), held to
``MEL_SNR_BOUND``. Full size, int4 engines: 38.0 dB against 40.3 without (docs/precision.md).
"""

from __future__ import annotations

import hashlib
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs the [build] extra (torch)")
pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import onnx
from _support import tiny_engines

from trt_cosy.builder.derived import link_or_copy
from trt_cosy.builder.quantize.estimator_int8 import (
    CALIBRATION_UTTERANCES,
    ESTIMATOR_CONV_PATTERN,
    ESTIMATOR_GRAPHS,
    estimator_calibration_feeds,
    estimator_convolutions,
    quantize_estimators,
)
from trt_cosy.builder.quantize.int8_conv import LOG_MEL_FLOOR
from trt_cosy.runtime.engines import load_engines
from trt_cosy.runtime.manifest import Manifest
from trt_cosy.verify.quality import QualityInputs, quality_guard

MEL_SNR_BOUND = 30.0  # dB, flow mel vs fp32 on the golden inputs (measured 36.9)


@pytest.fixture(scope="module")
def engines(tmp_path_factory, v2_tiny_dir) -> Path:
    return tiny_engines(tmp_path_factory, v2_tiny_dir)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_middle_blocks_are_chosen_and_the_outer_blocks_are_not(engines):
    model = onnx.load(str(engines / "flow_estimator.onnx"), load_external_data=False)
    weights = {node.name: node.input[1] for node in model.graph.node if node.op_type == "Conv"}
    chosen = estimator_convolutions(model)
    assert chosen and set(chosen) <= set(weights)
    assert all(ESTIMATOR_CONV_PATTERN.match(weights[name]) for name in chosen)
    left = Counter(weights[name].split(".")[1] for name in set(weights) - set(chosen))
    # fp32: the blocks whose inputs concatenate differently scaled tensors, the output projection, and
    # the middle blocks' 1x1 residual convolutions (as much error as the rest for a seventh of the work)
    assert set(left) == {"down_blocks", "mid_blocks", "up_blocks", "final_block", "final_proj"}, left
    middle = {weights[name].split(".")[2] for name in chosen}
    assert len(chosen) == 2 * len(middle) == 2 * left["mid_blocks"]  # block1 and block2 of each
    assert all(weights[name].split(".")[-2] == "res_conv" for name in set(weights) - set(chosen)
               if weights[name].split(".")[1] == "mid_blocks")  # fmt: skip
    assert ESTIMATOR_GRAPHS["v3"] == {}  # the DiT has no middle blocks


def test_calibration_records_every_solver_step_then_the_log_mel_range(engines):
    model = load_engines(engines, threads=1)
    runner = model.runners["flow_estimator"]
    feeds = estimator_calibration_feeds(model, "flow_estimator")
    assert model.runners["flow_estimator"] is runner  # the stand-in is taken out again
    recorded, moved = feeds[: len(feeds) // 2], feeds[len(feeds) // 2 :]
    assert len(recorded) == len(moved) and len(recorded) % CALIBRATION_UTTERANCES == 0
    steps = len(recorded) // CALIBRATION_UTTERANCES
    assert steps > 1 and len({float(feed["t"][0]) for feed in recorded[:steps]}) == steps  # the solver's t
    inputs = {tensor.name for tensor in runner.session.get_inputs()}
    assert all(set(feed) == inputs for feed in feeds)
    for before, after in zip(recorded, moved, strict=True):
        t = before["t"].reshape(-1, 1, 1)  # [2, 1, 1]
        np.testing.assert_array_equal(after["mu"], before["mu"])
        if float(t.min()) > 0.05:  # x moved by t times a log-mel-range target
            target = (after["x"] - before["x"]) / t
            assert (
                target.min() >= LOG_MEL_FLOOR - 1e-3 and target.max() <= 2.0 + 1e-3 and target.mean() < -4.0
            )
        prompt = before["cond"] != 0
        assert prompt.any() and np.all(after["cond"][~prompt] == 0)
        assert after["cond"][prompt].min() >= LOG_MEL_FLOOR and after["cond"][prompt].mean() < -4.0


def test_quantised_estimator_is_written_aside_and_keeps_the_mel(engines, v2_tiny_dir, tmp_path):
    copy = tmp_path / "engines"
    shutil.copytree(engines, copy, copy_function=link_or_copy)  # hard links, as derive_engines makes
    before = _sha(engines / "flow_estimator.onnx")
    expected = len(estimator_convolutions(onnx.load(str(engines / "flow_estimator.onnx"))))
    assert quantize_estimators(copy, "v3") == {}  # nothing for the DiT family, nothing touched
    assert quantize_estimators(copy, "v2") == {"flow_estimator": expected}
    assert _sha(engines / "flow_estimator.onnx") == before, "the fp32 graph was written through its hard link"
    Manifest.read(copy).check(copy)  # the manifest's sizes were refreshed
    ops = Counter(node.op_type for node in onnx.load(str(copy / "flow_estimator.onnx")).graph.node)
    assert ops["QuantizeLinear"] >= expected and ops["DequantizeLinear"] >= 2 * expected, ops
    with np.load(v2_tiny_dir / "reference.npz") as data:
        inputs = QualityInputs.from_golden({key: data[key] for key in data.files})
    rows = {
        row.metric: row.value
        for row in quality_guard(load_engines(engines, threads=1), load_engines(copy, threads=1), inputs)
    }
    assert MEL_SNR_BOUND <= rows["flow_mel_snr_db"] < 100.0, rows  # reduced, and within the bar
