"""`trt-cosy verify` on the goldens of the official ``inference_vc`` run end to end (tests/data/vc,
tools/golden/make_vc_golden.py): the ``vc:`` rows of ``verify.official_vc``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _support import family_engines, family_release, shared_tiny_engines
from click.testing import CliRunner

from trt_cosy.cli import main

pytest.importorskip("torch", reason="needs the [build] extra (torch) to build the tiny engines")

DATA = Path(__file__).parent / "data"
VC = DATA / "vc"


def _release_and_engines(factory, family: str) -> tuple[Path, Path]:
    if family == "v2":
        return shared_tiny_engines(factory, DATA / "cosyvoice2-tiny")
    return family_release(factory, family), family_engines(factory, family)


def _verify(factory, family: str, golden: Path):
    release, engines = _release_and_engines(factory, family)
    args = ["verify", "--model-dir", str(release), "--golden", str(golden), "--backend", "onnxruntime"]
    return CliRunner().invoke(main, [*args, "--engines", str(engines), "--threads", "1"])


@pytest.mark.parametrize("family", ["v1", "v2", "v3"])
def test_verify_reproduces_official_inference_vc(tmp_path_factory, family):
    result = _verify(tmp_path_factory, family, VC / f"{family}.npz")
    assert result.exit_code == 0, result.output
    meta = json.loads(str(np.load(VC / f"{family}.npz")["meta_json"]))
    rows = [line.split()[0] for line in result.output.splitlines()[1:-1]]
    expected = ["vc:source_tokens", "vc:prompt_tokens", "vc:prompt_feat", "vc:embedding"]
    for run in meta["runs"]:
        calls = len(meta[run]["calls"])
        mels = [f"vc:{run}_c{k}_flow_mel" for k in range(calls)] if meta[run]["speed"] == 1.0 else []
        expected += [f"vc:{run}_calls", *mels, f"vc:{run}_wav"]
    assert rows == expected
    assert f"summary: {len(expected)} ok, 0 failed, 0 skipped" in result.output
    assert len(meta["stream"]["calls"]) > 1  # the streamed run has a chunk before the final one


def test_verify_fails_on_a_changed_official_output(tmp_path_factory, tmp_path):
    with np.load(VC / "v2.npz") as data:
        arrays = {key: data[key] for key in data.files}
    arrays["stream_wav"] = (arrays["stream_wav"].astype(np.int32) + 100).clip(-32768, 32767).astype(np.int16)
    arrays["source_tokens"] = arrays["source_tokens"].copy()
    arrays["source_tokens"][0] += 1
    broken = tmp_path / "broken.npz"
    np.savez(broken, **arrays)
    result = _verify(tmp_path_factory, "v2", broken)
    assert result.exit_code == 1, result.output
    failed = {line.split()[0] for line in result.output.splitlines() if line.endswith("FAIL")}
    assert failed == {"vc:stream_wav", "vc:source_tokens"}, result.output


def test_vc_golden_of_another_family_is_refused(tmp_path_factory):
    result = _verify(tmp_path_factory, "v2", VC / "v3.npz")
    assert result.exit_code != 0
    assert "voice-conversion golden of v3" in result.output and "Traceback" not in result.output
