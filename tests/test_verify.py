"""`trt-cosy verify --backend torch` on the golden tiny CosyVoice2 set."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from trt_cosy.cli import main
from trt_cosy.verify import format_table, run_verify
from trt_cosy.verify.golden import GoldenSet

pytest.importorskip("torch", reason="the torch reference backend needs the [build] extra")


@pytest.fixture(scope="module")
def torch_model(v2_tiny_dir: Path):
    from trt_cosy.build.reference import load_torch_model

    return load_torch_model(v2_tiny_dir)


@pytest.fixture(scope="module")
def golden(v2_tiny_dir: Path) -> GoldenSet:
    return GoldenSet.load(v2_tiny_dir / "reference.npz")


def test_every_compared_key_is_ok(torch_model, golden: GoldenSet) -> None:
    rows = run_verify(torch_model, golden)
    by_status = {row.key: row for row in rows}
    failed = [row for row in rows if row.status == "FAIL"]
    assert not failed, format_table(failed)
    skipped = {row.key for row in rows if row.status == "skipped"}
    assert skipped == {"llm_sampled_tokens"}, skipped
    # Every non-streaming key of issue 2 and every streaming key is compared.
    for key in ("llm_tf_logits", "llm_tf_cached_logp", "llm_greedy_tokens", "nonstream_c0_flow_mu",
                "nonstream_c0_flow_mel", "hift_synth_f0", "hift_synth_source", "hift_synth_wav",
                "stream_c2_out_speech", "streampad_wav"):
        assert by_status[key].status == "ok", by_status[key]
    assert len(rows) == len(golden.compared_keys())


def test_a_perturbed_golden_fails(torch_model, golden: GoldenSet) -> None:
    arrays = dict(golden.arrays)
    arrays["nonstream_c0_flow_mel"] = arrays["nonstream_c0_flow_mel"] + 1e-3  # 5x the tolerance
    arrays["llm_greedy_tokens"] = arrays["llm_greedy_tokens"].copy()
    arrays["llm_greedy_tokens"][3] += 1
    rows = {row.key: row for row in run_verify(torch_model, GoldenSet(arrays, golden.meta, golden.source))}
    assert rows["nonstream_c0_flow_mel"].status == "FAIL"
    assert rows["nonstream_c0_flow_mel"].max_abs_err == pytest.approx(1e-3, rel=0.05)
    assert rows["llm_greedy_tokens"].status == "FAIL"
    assert rows["nonstream_c0_flow_mu"].status == "ok"


def test_cli_prints_table_and_exit_codes(v2_tiny_dir: Path, tmp_path: Path, golden: GoldenSet) -> None:
    runner = CliRunner()
    args = ["verify", "--model-dir", str(v2_tiny_dir), "--backend", "torch"]
    result = runner.invoke(main, [*args, "--golden", str(v2_tiny_dir / "reference.npz")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["key", "max_abs_err", "tolerance", "result"]
    assert "summary: 60 ok, 0 failed, 1 skipped" in result.output

    broken = dict(golden.arrays)
    broken["hift_synth_wav"] = broken["hift_synth_wav"] * 2.0
    bad_path = tmp_path / "bad.npz"
    np.savez(bad_path, meta_json=np.array(__import__("json").dumps(golden.meta)), **broken)
    result = runner.invoke(main, [*args, "--golden", str(bad_path)])
    assert result.exit_code == 1
    assert any(line.startswith("hift_synth_wav") and "FAIL" in line for line in result.output.splitlines())


def test_bad_model_dir_is_a_clear_error(tmp_path: Path, v2_tiny_dir: Path) -> None:
    result = CliRunner().invoke(
        main,
        ["verify", "--model-dir", str(tmp_path / "missing"), "--golden", str(v2_tiny_dir / "reference.npz")],
    )
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output
