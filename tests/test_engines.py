"""Engines directory: build layout, manifest checks, skip/force/atomic rebuilds, torch-free loading on ORT.

The tiny engines are built once per session (shared with tests/test_export.py through the pytest
base temp); tests that damage engines work on a copy.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs the [build] extra (torch)")
pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

from _support import BLOCK_TORCH, shared_tiny_engines

from trt_cosy.builder import engines as build_module
from trt_cosy.builder.export import ExportResult, graph_export_plan
from trt_cosy.builder.noise import official_flow_noise
from trt_cosy.builder.reference import load_torch_model
from trt_cosy.errors import EngineMismatchError, InputError
from trt_cosy.models.registry import read_release_config
from trt_cosy.runtime import graphs
from trt_cosy.runtime.engines import load_engines
from trt_cosy.runtime.manifest import Manifest, model_config_from_dict

ROOT = Path(__file__).resolve().parents[1]
GRAPH_FILES = [f"{name}.onnx" for name in graphs.GRAPHS]
HOST_FILES = [
    "text_embedding.npy",
    "speech_embedding.npy",
    "llm_embedding.npy",
    "flow_noise.npy",
    "model_config.json",
    "manifest.json",
    "campplus.onnx",
    "speech_tokenizer_v2.onnx",
    "tokenizer/vocab.json",
    "tokenizer/merges.txt",
    "tokenizer/tokenizer_config.json",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, v2_tiny_dir) -> tuple[Path, Path]:
    return shared_tiny_engines(tmp_path_factory, v2_tiny_dir)


@pytest.fixture(scope="module")
def torch_model(v2_tiny_dir):
    return load_torch_model(v2_tiny_dir)


@pytest.fixture
def engines_copy(tiny, tmp_path) -> Path:
    return Path(shutil.copytree(tiny[1], tmp_path / "engines"))


# --- fast checks: config and manifest, no build ---------------------------------------------------


def test_model_config_round_trips_through_json(v2_tiny_dir):
    config = read_release_config(v2_tiny_dir)
    again = model_config_from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config
    assert isinstance(again.hift.resblock_dilation_sizes[0], tuple) and again.flow.estimator.channels == (64,)
    with pytest.raises(EngineMismatchError, match="trt-cosy build"):
        model_config_from_dict({**config.to_dict(), "surprise": 1})


def test_missing_engines_dir_says_build(tmp_path):
    with pytest.raises(EngineMismatchError, match="trt-cosy build --model-dir DIR --out"):
        load_engines(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("backend", "precision", "hint"),
    [("cuda", "fp32", "onnxruntime, tensorrt"), ("onnxruntime", "fp16", "fp32"), ("tensorrt", "int4", "fp16, fp32")],
)
def test_unknown_backend_or_precision(v2_tiny_dir, tmp_path, backend, precision, hint):
    with pytest.raises(InputError, match=hint):
        build_module.build_engines(v2_tiny_dir, tmp_path / "engines", backend=backend, precision=precision)


def test_refuses_to_replace_a_foreign_directory(v2_tiny_dir, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="not an engines directory"):
        build_module.build_engines(v2_tiny_dir, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


# --- the built tiny engines -------------------------------------------------------------------------


@pytest.mark.slow
def test_layout(tiny, torch_model):
    release, engines = tiny
    for name in GRAPH_FILES + HOST_FILES:
        assert (engines / name).is_file(), name
    assert not list(engines.parent.glob(f".{engines.name}.*")), "staging or old directories left behind"
    assert engines.stat().st_mode & 0o055, "engines dir kept mkdtemp's private mode"
    manifest = Manifest.read(engines)
    assert set(manifest.files) == {
        p.relative_to(engines).as_posix()
        for p in engines.rglob("*")
        if p.is_file() and p.name != "manifest.json"
    }
    assert manifest.backend == "onnxruntime" and manifest.precision == "fp32"
    assert set(manifest.checkpoint) == {
        "cosyvoice2.yaml",
        "llm.pt",
        "flow.pt",
        "hift.pt",
        "CosyVoice-BlankEN/config.json",
    }
    noise = np.load(engines / "flow_noise.npy")
    assert noise.shape == (1, 80, 15000) and np.array_equal(noise[:, :, :100], official_flow_noise(100))
    assert (engines / "campplus.onnx").read_bytes() == (release / "campplus.onnx").read_bytes()


@pytest.mark.slow
def test_load_engines_matches_torch(tiny, torch_model):
    release, engines = tiny
    model = load_engines(engines, threads=2, model_dir=release)
    assert model.backend == "onnxruntime" and model.config == torch_model.config
    # + the batched decode graph and the incremental streaming estimator
    assert set(model.runners) == set(graphs.GRAPHS) | {graphs.LLM_BATCH.name, graphs.FLOW_ESTIMATOR_INCREMENTAL.name}
    for name, table in torch_model.llm_tables.items():
        assert isinstance(model.llm_tables[name], np.memmap) and np.array_equal(model.llm_tables[name], table)
    assert np.array_equal(model.flow_noise, torch_model.flow_noise)
    for name, spec in graphs.GRAPHS.items():
        feed = graph_export_plan(name, model.config, seed=5).sample
        got, expected = model.runners[name].infer(feed), torch_model.runners[name].infer(feed)
        for output in spec.output_names:
            error = float(np.abs(got[output] - expected[output]).max())
            scale = max(1.0, float(np.abs(expected[output]).max()))
            assert error / scale <= (1e-3 if name == "hift" else 1e-4), (
                f"{name}.{output}: max error {error:.3e}"
            )


def _no_export(*args, **kwargs):
    raise AssertionError("build_engines exported although the engines were current")


@pytest.mark.slow
def test_second_build_is_a_fast_skip(tiny, monkeypatch):
    release, engines = tiny
    before = (engines / "manifest.json").read_text()
    monkeypatch.setattr(build_module, "export_family", _no_export)
    lines: list[str] = []
    start = time.perf_counter()
    assert build_module.build_engines(release, engines, progress=lines.append) == engines
    seconds = time.perf_counter() - start
    assert seconds < 2.0, f"skip took {seconds:.2f} s"
    assert (engines / "manifest.json").read_text() == before
    assert any("up to date" in line for line in lines), lines


def _copying_export(source: Path, calls: list[Path]):
    """Stands in for export_family: copies the graphs of an earlier build (keeps --force tests fast)."""

    def export(model, out_dir, progress=None):
        calls.append(out_dir)
        results = {}
        for name in graphs.GRAPHS:
            path = Path(shutil.copy2(source / f"{name}.onnx", Path(out_dir) / f"{name}.onnx"))
            results[name] = ExportResult(name, path, (path,), {"copied": 0.0}, 0.0)
        return results

    return export


@pytest.mark.slow
def test_force_rebuilds_and_swaps_atomically(tiny, engines_copy, monkeypatch):
    release, engines = tiny
    calls: list[Path] = []
    monkeypatch.setattr(build_module, "export_family", _copying_export(engines, calls))
    (engines_copy / "stale-extra.txt").write_text("from an older build")
    build_module.build_engines(release, engines_copy, force=True)
    assert len(calls) == 1 and calls[0] != engines_copy, "export must write into a staging directory"
    assert not (engines_copy / "stale-extra.txt").exists(), "old directory was not replaced"
    assert not list(engines_copy.parent.glob(".engines.*")), "staging or old directories left behind"
    assert Manifest.read(engines_copy).graphs["llm"].max_errors == {"copied": 0.0}
    load_engines(engines_copy, threads=1, model_dir=release)


@pytest.mark.slow
def test_failed_build_keeps_old_engines(tiny, engines_copy, monkeypatch):
    release, _ = tiny
    before = (engines_copy / "manifest.json").read_text()

    def broken(*args, **kwargs):
        raise RuntimeError("export exploded")

    monkeypatch.setattr(build_module, "export_family", broken)
    with pytest.raises(RuntimeError, match="exploded"):
        build_module.build_engines(release, engines_copy, force=True)
    assert (engines_copy / "manifest.json").read_text() == before
    assert not list(engines_copy.parent.glob(".engines.*")), "staging directory left behind"
    load_engines(engines_copy, threads=1)


def _edit_manifest(engines: Path, **changes) -> None:
    path = engines / "manifest.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


STALE_CASES = {
    "deleted graph": (lambda e: (e / "hift.onnx").unlink(), "lack hift.onnx"),
    "deleted table": (lambda e: (e / "speech_embedding.npy").unlink(), "lack speech_embedding.npy"),
    "truncated file": (lambda e: (e / "llm.onnx").write_bytes((e / "llm.onnx").read_bytes()[:100]), "bytes"),
    "no manifest": (lambda e: (e / "manifest.json").unlink(), "has no manifest.json"),
    "other backend": (lambda e: _edit_manifest(e, backend="tensorrt"), "backend 'tensorrt'"),
    "other version": (lambda e: _edit_manifest(e, trt_cosy_version="0.0.1"), "trt-cosy 0.0.1"),
    "broken manifest": (lambda e: (e / "manifest.json").write_text("{not json"), "malformed"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(STALE_CASES))
def test_stale_engines_say_rebuild(engines_copy, case):
    damage, detail = STALE_CASES[case]
    damage(engines_copy)
    with pytest.raises(EngineMismatchError, match="trt-cosy build") as info:
        load_engines(engines_copy, threads=1)
    assert detail in str(info.value), str(info.value)


@pytest.mark.slow
def test_changed_checkpoint_byte_is_detected(tiny, tmp_path):
    release, engines = tiny
    changed = Path(shutil.copytree(release, tmp_path / "release"))
    data = bytearray((changed / "hift.pt").read_bytes())
    data[-100] ^= 0x01
    (changed / "hift.pt").write_bytes(bytes(data))
    with pytest.raises(EngineMismatchError, match="trt-cosy build --model-dir") as info:
        load_engines(engines, threads=1, model_dir=changed)
    assert "hift.pt changed" in str(info.value), str(info.value)
    assert not build_module._is_current(engines, build_module.hash_checkpoint(changed), "onnxruntime", "fp32")




@pytest.mark.slow
def test_engines_load_and_pass_golden_without_torch(tiny, v2_tiny_dir):
    release, engines = tiny
    code = BLOCK_TORCH + textwrap.dedent(
        f"""
        from trt_cosy.runtime.engines import load_engines
        from trt_cosy.verify import format_table, run_verify
        from trt_cosy.verify.golden import GoldenSet

        model = load_engines({str(engines)!r}, threads=2, model_dir={str(release)!r})
        rows = run_verify(model, GoldenSet.load({str(v2_tiny_dir / "reference.npz")!r}))
        print(format_table(rows))
        assert "torch" not in sys.modules, "torch was imported"
        assert not any(row.status == "FAIL" for row in rows)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failed" in result.stdout, result.stdout


@pytest.mark.slow
def test_build_engines_script(tiny, capsys):
    release, engines = tiny
    spec = importlib.util.spec_from_file_location("build_engines_script", ROOT / "build_engines.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--model-dir", str(release), "--out", str(engines), "--precision", "fp32"]) == 0
    captured = capsys.readouterr()
    assert "up to date" in captured.err and "engines ready" in captured.out
    assert script.main(["--model-dir", str(release), "--out", str(engines), "--precision", "int3"]) == 2
    assert "fp32" in capsys.readouterr().err
