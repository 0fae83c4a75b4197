"""int8 residual-block convolutions in HiFT (builder/quantize/vocoder_int8.py), on the golden tiny CosyVoice2.

What is quantised (the generator's and the source branch's residual blocks, nothing of the f0
predictor), where the calibration feeds come from (the checkpoint's own flow through the family's
vocoder stage, plus log-mel-range inputs), that the fp32 graph a derived directory hard-links is
never written through, and the waveform against fp32 on the golden HiFT inputs, whole-utterance and
streaming: measured 37.0-37.3 dB for the tiny CosyVoice2, held to ``SNR_BOUND``. Full size: 38.3 dB
(docs/precision.md).
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
from _support import tiny_engines, tiny_release

from trt_cosy.builder.derived import link_or_copy
from trt_cosy.builder.quantize.engines import derive_engines
from trt_cosy.builder.quantize.vocoder_int8 import (
    CALIBRATION_UTTERANCES,
    INT8_CONV_PREFIXES,
    calibration_feeds,
    int8_convolutions,
    quantize_vocoders,
)
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.engines import load_engines
from trt_cosy.runtime.manifest import Manifest
from trt_cosy.verify.quality import snr_db

SNR_BOUND = 30.0  # dB, waveform vs fp32 (measured 37.4 on the golden inputs)


@pytest.fixture(scope="module")
def engines(tmp_path_factory, v2_tiny_dir) -> Path:
    return tiny_engines(tmp_path_factory, v2_tiny_dir)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# whole-utterance and streaming vocoder calls (the streaming ones carry the previous chunk's source)
GOLDEN_CALLS = ("nonstream_c0", "stream_c1", "stream_c2", "streampad_c1")


def _golden_hift_feed(reference: dict[str, np.ndarray], call: str = "nonstream_c0") -> dict[str, np.ndarray]:
    return {
        "mel": reference[f"{call}_hift_mel"].astype(np.float32),  # [1, 80, F]
        "sine_noise": reference[f"{call}_hift_sine_noise"].astype(np.float32),  # [1, 480F, 9]
        "cache_source": reference[f"{call}_hift_cache_source"].astype(np.float32),  # [1, 1, S]
    }


def test_the_residual_block_convolutions_are_chosen_and_the_f0_predictor_is_not(engines):
    model = onnx.load(str(engines / "hift.onnx"), load_external_data=False)
    weights = {node.name: node.input[1] for node in model.graph.node if node.op_type == "Conv"}
    chosen = int8_convolutions(model)
    assert chosen and set(chosen) <= set(weights)
    assert all(weights[name].startswith(INT8_CONV_PREFIXES) for name in chosen)
    left = Counter(weights[name].split(".")[1] for name in set(weights) - set(chosen))
    # fp32 islands: the f0 predictor (its f0 drives the NSF phase), conv_pre/post, source downs, STFT
    assert set(left) == {"f0_predictor", "conv_pre", "conv_post", "source_downs", "stft"}, left
    assert left["f0_predictor"] == 5


def test_calibration_runs_the_checkpoints_flow_and_the_log_mel_range(engines):
    model = load_engines(engines, threads=1)
    feeds = calibration_feeds(model, "hift")
    assert len(feeds) == 2 * CALIBRATION_UTTERANCES  # per utterance: its flow mel, then a log-mel-range one
    inputs = {tensor.name for tensor in model.runners["hift"].session.get_inputs()}
    assert all(set(feed) == inputs for feed in feeds)
    flow_mels = [feed["mel"] for feed in feeds[0::2]]
    log_mels = [feed["mel"] for feed in feeds[1::2]]
    # the random-weight flow's mels sit around 0; speech features span log(1e-5) = -11.5 .. 2
    assert all(abs(float(mel.mean())) < 3.0 for mel in flow_mels), [float(mel.mean()) for mel in flow_mels]
    assert all(mel.min() >= -11.52 and mel.max() <= 2.0 and mel.mean() < -5.0 for mel in log_mels)
    assert not np.array_equal(flow_mels[0], flow_mels[1])  # seeded per utterance
    assert model.runners["hift"].__class__.__name__ != "Recorder"  # the stand-in is taken out again


def test_quantised_vocoder_is_written_aside_and_stays_close_to_fp32(engines, v2_reference, tmp_path):
    copy = tmp_path / "engines"
    shutil.copytree(engines, copy, copy_function=link_or_copy)  # hard links, as derive_engines makes
    before = _sha(engines / "hift.onnx")
    assert quantize_vocoders(copy, "v2") == {
        "hift": len(int8_convolutions(onnx.load(str(engines / "hift.onnx"))))
    }
    assert _sha(engines / "hift.onnx") == before, "the fp32 graph was written through its hard link"
    ops = Counter(node.op_type for node in onnx.load(str(copy / "hift.onnx")).graph.node)
    assert ops["QuantizeLinear"] > 0 and ops["DequantizeLinear"] > 0, ops
    fp32 = OrtRunner.from_path(engines / "hift.onnx", "hift", threads=1)
    int8 = OrtRunner.from_path(copy / "hift.onnx", "hift", threads=1)
    for call in GOLDEN_CALLS:
        feed = _golden_hift_feed(v2_reference, call)
        reference, reduced = fp32.infer(feed), int8.infer(feed)
        snr = snr_db(reference["wav"], reduced["wav"])
        assert SNR_BOUND <= snr < 100.0, (call, snr)  # reduced (not the fp32 graph), and within the bar
        # the fp32 island: f0 comes from the f0 predictor before any int8 convolution
        np.testing.assert_array_equal(reduced["f0"], reference["f0"])


@pytest.mark.slow
def test_an_int4_build_quantises_the_vocoder_and_its_manifest_holds(tmp_path_factory, v2_tiny_dir, tmp_path):
    from trt_cosy.builder.engines import build_engines

    out = build_engines(tiny_release(tmp_path_factory, v2_tiny_dir), tmp_path / "int4", precision="int4")
    Manifest.read(out).check(out, precision="int4")  # file sizes recorded after the vocoder's rewrite
    ops = Counter(node.op_type for node in onnx.load(str(out / "hift.onnx")).graph.node)
    assert ops["QuantizeLinear"] > 0, ops
    model = load_engines(out, threads=1)
    wav = model.runners["hift"].infer(_golden_hift_feed_from_release(v2_tiny_dir))["wav"]
    assert np.isfinite(wav).all() and float(np.abs(wav).max()) > 0.0
    # derive_engines calibrates through its own int8 flow, as the build did: the same graphs, byte for byte
    derived = derive_engines(tiny_engines(tmp_path_factory, v2_tiny_dir), tmp_path / "derived", "int4")
    graphs = sorted(path.name for path in out.glob("*.onnx"))
    assert graphs == sorted(path.name for path in derived.glob("*.onnx")) and "hift.onnx" in graphs
    assert {name: _sha(out / name) for name in graphs} == {name: _sha(derived / name) for name in graphs}


def _golden_hift_feed_from_release(v2_tiny_dir: Path) -> dict[str, np.ndarray]:
    with np.load(v2_tiny_dir / "reference.npz") as data:
        return _golden_hift_feed({key: data[key] for key in data.files})
