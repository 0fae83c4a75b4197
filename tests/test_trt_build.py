"""`trt-cosy build --backend tensorrt`: without a GPU, --onnx-only writes the TensorRT inputs, the plain
command says that TensorRT is needed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from trt_cosy.cli import main
from trt_cosy.runtime.backends.tensorrt.cuda import gpu_unavailable_reason

pytest.importorskip("torch", reason="building engines needs the [build] extra")

GRAPHS = ("llm", "flow_encoder", "flow_estimator", "flow_estimator_stream", "hift")


@pytest.fixture(scope="module")
def tiny_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trt_cosy.builder.testmodel.release import make_test_model

    return make_test_model(tmp_path_factory.mktemp("trt-release") / "tiny")


@pytest.mark.skipif(gpu_unavailable_reason() is None, reason="a GPU is present: the plain build would make plans")
def test_plain_tensorrt_build_says_tensorrt_is_needed(tiny_release: Path, tmp_path: Path) -> None:
    out = tmp_path / "engines"
    result = CliRunner().invoke(main, ["build", "--model-dir", str(tiny_release), "--out", str(out),
                                       "--backend", "tensorrt"])
    assert result.exit_code == 2
    assert "TensorRT" in result.output and "trt-cosy[gpu]" in result.output
    assert not out.exists(), "nothing may be written when plans cannot be built"


@pytest.mark.slow
def test_onnx_only_writes_fp16_graphs_profiles_and_manifest(tiny_release: Path, tmp_path: Path) -> None:
    import onnx

    out = tmp_path / "engines"
    result = CliRunner().invoke(main, ["build", "--model-dir", str(tiny_release), "--out", str(out),
                                       "--backend", "tensorrt", "--onnx-only"])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "tensorrt" and manifest["precision"] == "fp16"
    for graph in GRAPHS:
        model = onnx.load(str(out / f"{graph}.fp16.onnx"), load_external_data=False)
        dtypes = {init.data_type for init in model.graph.initializer}
        assert onnx.TensorProto.FLOAT16 in dtypes, f"{graph}: no fp16 weights"
        assert f"{graph}.fp16.onnx" in manifest["files"]
    profiles = json.loads((out / "profiles.json").read_text())
    assert set(GRAPHS) <= set(profiles if isinstance(profiles, dict) else {})
    summary = json.loads((out / "tensorrt.json").read_text())
    for graph in GRAPHS:
        errors = summary["graphs"][graph]
        assert errors, graph
    for step, estimator in (("flow_step", "flow_estimator"), ("flow_step_stream", "flow_estimator_stream")):
        assert summary["graphs"][step]["derived_from"] == estimator and f"{step}.fp16.onnx" in manifest["files"]
        assert step in profiles
    # the batched decode graph (runtime.llm_decode): batch as data in every profile, one per position bucket
    assert "llm_decode.fp16.onnx" in manifest["files"] and "llm_decode" in summary["graphs"]
    decode = profiles["llm_decode"]["profiles"]
    assert [p["name"] for p in decode] == ["decode_512", "decode_2048", "decode_4096"]
    assert all(p["shapes"]["past_lengths"] == [[1], [4], [8]] for p in decode)
    # the incremental streaming estimator (issue 15 item 6): fp16 graph, T/P profiles, manifest record
    assert "flow_estimator_incremental.fp16.onnx" in manifest["files"] and "flow_estimator_incremental" in manifest["graphs"]
    assert [p["name"] for p in profiles["flow_estimator_incremental"]["profiles"]] == ["chunk", "long"]
    assert summary["graphs"]["flow_estimator_incremental"]["onnx"] == "flow_estimator_incremental.fp16.onnx"
    assert not (out / "plans").exists()
    # every graph's parity feeds with the fp32 outputs each plan is checked against (issue 29 item 8)
    from trt_cosy.builder.trt.parity import read_parity_feeds

    for graph, entry in summary["graphs"].items():
        pairs = read_parity_feeds(out / entry["parity_feeds"])
        assert pairs and all(feed and outputs for feed, outputs in pairs), graph
        assert all(np.isfinite(v).all() for _, outputs in pairs for v in outputs.values()), graph
    assert set(read_parity_feeds(out / "parity" / "flow_step.npz")[0][1]) == {"x_next"}
    size = sum(path.stat().st_size for path in (out / "parity").iterdir())
    assert size < 16 * 2**20, size  # tiny engines stay small enough to carry to a GPU host
    # rerun is a manifest-match skip
    again = CliRunner().invoke(main, ["build", "--model-dir", str(tiny_release), "--out", str(out),
                                      "--backend", "tensorrt", "--onnx-only"])
    assert again.exit_code == 0 and "up to date" in again.output
    assert np.load(out / "flow_noise.npy", mmap_mode="r").shape == (1, 80, 15000)
    if gpu_unavailable_reason() is not None:
        # the runtime refuses to go on without a GPU, with the reason, before touching TensorRT
        from trt_cosy.errors import MissingDependencyError
        from trt_cosy.runtime.engines import load_engines

        with pytest.raises(MissingDependencyError, match="NVIDIA GPU"):
            load_engines(out, backend="tensorrt")
    # ONNX Runtime never loads engines built for TensorRT (the manifest names the backend)
    from trt_cosy.errors import EngineMismatchError
    from trt_cosy.runtime.engines import load_engines

    with pytest.raises(EngineMismatchError, match="trt-cosy build"):
        load_engines(out)
