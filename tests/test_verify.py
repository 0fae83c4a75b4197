"""`trt-cosy verify --backend torch` on the golden tiny sets of CosyVoice 1, 2 and 3."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from trt_cosy.cli import main
from trt_cosy.errors import InputError
from trt_cosy.verify import compare_outputs, compute_outputs, format_table
from trt_cosy.verify.golden import GoldenSet

pytest.importorskip("torch", reason="the torch reference backend needs the [build] extra")

DATA = Path(__file__).parent / "data"
DIRS = {"v1": DATA / "cosyvoice1-tiny", "v2": DATA / "cosyvoice2-tiny", "v3": DATA / "cosyvoice3-tiny"}
# Compared keys per golden set: all ok but llm_sampled_tokens (informational); plus the voice-conversion
# request on each golden run with a flow prompt (``conversion:<run>_wav``, verify.conversion).
CONVERSION_RUNS = {"v1": 2, "v2": 3, "v3": 3}
EXPECTED_OK = {"v1": 65 + 2, "v2": 60 + 3, "v3": 49 + 3}
# Keys that must be among the compared ones (one of each kind per family).
MUST_COMPARE = {
    "v1": (
        "llm_tf_lm_input",
        "llm_tf_cached_hidden",
        "sft_llm_greedy_tokens",
        "stream_c1_flow_cache_in",
        "stream_c2_mel_overlap_in",
        "stream_c1_hift_speech_cache_in",
        "stream_c2_hift_wav",
        "sft_wav",
        "hift_synth_source",
    ),
    "v2": (
        "llm_tf_logits",
        "llm_tf_cached_logp",
        "llm_greedy_tokens",
        "nonstream_c0_flow_mu",
        "nonstream_c0_flow_mel",
        "hift_synth_f0",
        "hift_synth_source",
        "hift_synth_wav",
        "stream_c2_out_speech",
        "streampad_wav",
    ),
    "v3": (
        "llm_tf_logits",
        "llm_tf_cached_hidden",
        "llm_greedy_logits",
        "stream_c1_flow_h",
        "streampad_c1_hift_mel",
        "nonstream_c0_hift_source",
        "stream_c2_hift_wav",
        "streampad_wav",
    ),
}
# An output-only key (never fed back as an input), its tolerance, and a greedy token key per family.
PERTURBED = {
    "v1": ("stream_c1_flow_mel", 2e-4, "sft_llm_greedy_tokens"),
    "v2": ("nonstream_c0_flow_mel", 2e-4, "llm_greedy_tokens"),
    "v3": ("streampad_c1_flow_mel", 2e-4, "llm_greedy_tokens"),
}

Verified = tuple[GoldenSet, dict, dict]


@pytest.fixture(scope="module")
def verified() -> Callable[[str], Verified]:
    """Per family, computed once: (golden set, our outputs, skipped keys)."""
    from trt_cosy.builder.reference import load_torch_model

    cache: dict[str, Verified] = {}

    def get(family: str) -> Verified:
        if family not in cache:
            model = load_torch_model(DIRS[family], threads=1, hift_noise_seconds=4)
            golden = GoldenSet.load(DIRS[family] / "reference.npz")
            ours, skipped = compute_outputs(model, golden)
            cache[family] = (golden, ours, skipped)
        return cache[family]

    return get


@pytest.mark.parametrize("family", ["v1", "v2", "v3"])
def test_every_compared_key_is_ok(verified, family: str) -> None:
    golden, ours, skipped = verified(family)
    rows = compare_outputs(ours, skipped, golden)
    failed = [row for row in rows if row.status == "FAIL"]
    assert not failed, format_table(failed)
    assert {row.key for row in rows if row.status == "skipped"} == {"llm_sampled_tokens"}
    assert len(rows) == len(golden.compared_keys()) + CONVERSION_RUNS[family]
    by_key = {row.key: row for row in rows}
    for key in (*MUST_COMPARE[family], "conversion:nonstream_wav", "conversion:stream_wav"):
        assert by_key[key].status == "ok", by_key[key]
    assert f"summary: {EXPECTED_OK[family]} ok, 0 failed, 1 skipped" in format_table(rows)


@pytest.mark.parametrize("family", ["v1", "v2", "v3"])
def test_a_perturbed_golden_fails(verified, family: str) -> None:
    golden, ours, skipped = verified(family)
    mel_key, tolerance, token_key = PERTURBED[family]
    arrays = dict(golden.arrays)
    arrays[mel_key] = arrays[mel_key] + 5 * tolerance
    arrays[token_key] = arrays[token_key].copy()
    arrays[token_key][min(3, arrays[token_key].size - 1)] += 1
    arrays["stream_wav"] = arrays["stream_wav"] + 0.01
    rows = {
        row.key: row for row in compare_outputs(ours, skipped, GoldenSet(arrays, golden.meta, golden.source))
    }
    assert rows[mel_key].status == "FAIL"
    assert rows[mel_key].max_abs_err == pytest.approx(5 * tolerance, rel=0.05), rows[mel_key]
    assert rows[token_key].status == "FAIL"
    assert rows["conversion:stream_wav"].status == "FAIL" and rows["conversion:nonstream_wav"].status == "ok"
    assert rows[mel_key.replace("flow_mel", "flow_mu")].status == "ok"


@pytest.mark.parametrize("family", ["v2", "v3"])
def test_cli_prints_table(family: str) -> None:
    args = ["verify", "--model-dir", str(DIRS[family]), "--backend", "torch", "--threads", "1"]
    result = CliRunner().invoke(main, [*args, "--golden", str(DIRS[family] / "reference.npz")])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["key", "max_abs_err", "tolerance", "result"]
    assert f"summary: {EXPECTED_OK[family]} ok, 0 failed, 1 skipped" in result.output


def test_cli_exit_code_on_failure(tmp_path: Path) -> None:
    golden = GoldenSet.load(DIRS["v1"] / "reference.npz")
    broken = dict(golden.arrays)
    broken["hift_synth_wav"] = broken["hift_synth_wav"] * 2.0
    bad_path = tmp_path / "bad.npz"
    np.savez(bad_path, meta_json=np.array(json.dumps(golden.meta)), **broken)
    args = ["verify", "--model-dir", str(DIRS["v1"]), "--golden", str(bad_path), "--threads", "1"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert any(line.startswith("hift_synth_wav") and "FAIL" in line for line in result.output.splitlines())
    assert f"summary: {EXPECTED_OK['v1'] - 1} ok, 1 failed, 1 skipped" in result.output


def test_bad_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    golden = str(DIRS["v2"] / "reference.npz")
    result = CliRunner().invoke(
        main, ["verify", "--model-dir", str(tmp_path / "missing"), "--golden", golden]
    )
    assert result.exit_code == 2
    assert "does not exist" in result.output and "Traceback" not in result.output


def test_golden_of_another_family_is_refused() -> None:
    from trt_cosy.builder.reference import load_torch_model

    model = load_torch_model(DIRS["v1"], threads=1)
    with pytest.raises(InputError, match="CosyVoice3 golden set"):
        compute_outputs(model, GoldenSet.load(DIRS["v3"] / "reference.npz"))


@pytest.mark.slow
def test_verify_on_quantised_engines_says_which_engines_parity_needs(tmp_path_factory, tmp_path) -> None:
    from _support import shared_tiny_engines

    from trt_cosy.builder.quantize.engines import derive_engines

    _, engines = shared_tiny_engines(tmp_path_factory, DIRS["v2"])
    int4 = derive_engines(engines, tmp_path / "int4", "int4")
    args = ["verify", "--model-dir", str(DIRS["v2"]), "--golden", str(DIRS["v2"] / "reference.npz")]
    result = CliRunner().invoke(
        main, [*args, "--backend", "onnxruntime", "--engines", str(int4), "--threads", "1"]
    )
    assert result.exit_code == 1, result.output  # int4 logits are outside the fp32 tolerances by design
    assert "holds int4 engines" in result.output and "--precision fp32" in result.output, result.output[
        -2000:
    ]
