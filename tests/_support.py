"""Helpers shared by several test files (tests/ is on sys.path under pytest's default import mode)."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import numpy as np
import pytest
import soundfile

from trt_cosy.config import QWEN_DIR

# Prepended to `python -c` code: any `import torch` in that process raises ImportError.
BLOCK_TORCH = textwrap.dedent(
    """
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
            return None
    sys.meta_path.insert(0, _NoTorch())
    """
)


def require_build_extra() -> None:
    """Skip the calling test (with the reason) unless the [build] extra (torch, onnx) is installed:
    the tiny test models and engines are made with it."""
    import pytest

    pytest.importorskip("torch", reason="needs the [build] extra (torch) to make the tiny test model")
    pytest.importorskip("onnx", reason="needs the [build] extra (onnx) to build the tiny engines")


def save_test_graph(graph, path, check: bool = True):
    """Save an ``onnx.helper.make_graph`` graph as an opset-18, IR-8 model at ``path`` (readable by
    every onnxruntime this project supports); returns ``path``."""
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    if check:
        onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def tiny_release(factory, golden_dir):
    """The golden tiny CosyVoice2 checkpoint plus the test tokenizer and stand-in frontend models,
    written once per session into ``factory``'s base temp directory; returns its path."""
    import shutil

    require_build_extra()
    from trt_cosy.builder.testmodel.release import make_test_model
    from trt_cosy.config import QWEN_DIR

    base = factory.getbasetemp()
    release = base / "tiny-release"
    if not release.is_dir():
        extras = make_test_model(base / "tiny-extras", size="tiny", seed=0, overwrite=True)
        shutil.copytree(golden_dir, release, ignore=shutil.ignore_patterns("reference.npz", "MANIFEST.json"))
        for name in ("campplus.onnx", "speech_tokenizer_v2.onnx"):
            shutil.copy2(extras / name, release / name)
        for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
            shutil.copy2(extras / QWEN_DIR / name, release / QWEN_DIR / name)
    return release


def tiny_engines(factory, golden_dir):
    """ONNX Runtime engines of ``tiny_release``, built once per session (later calls are manifest skips)."""
    require_build_extra()
    from trt_cosy.builder.engines import build_engines

    return build_engines(tiny_release(factory, golden_dir), factory.getbasetemp() / "tiny-engines")


def shared_tiny_engines(factory, golden_dir):
    """(release, engines) of the session's tiny build (``tiny_release``, ``tiny_engines``)."""
    return tiny_release(factory, golden_dir), tiny_engines(factory, golden_dir)


# --- the speech references of the synthesis tests (test_tts, test_families, server, streaming) ---
FEATURES_AUDIO = Path(__file__).parent / "data" / "features" / "audio"
REF_TEXT = "Hello, this is me."


def reference_wavs(folder: Path) -> dict[str, Path]:
    """A 1.5 s speech reference (few prompt tokens keep the flow fast) and the bad references."""
    speech, rate = soundfile.read(FEATURES_AUDIO / "en_16k_mono.wav", dtype="float32")
    paths = {name: folder / f"{name}.wav" for name in ("ref", "short", "long", "silent")}
    soundfile.write(paths["ref"], speech[rate // 2 : 2 * rate], rate)
    soundfile.write(paths["short"], speech[: rate // 2], rate)
    soundfile.write(paths["long"], np.tile(speech, 8), rate)  # ~35 s
    soundfile.write(paths["silent"], np.zeros(2 * rate, np.float32), rate)
    paths["unreadable"] = folder / "unreadable.wav"
    paths["unreadable"].write_text("not audio", encoding="utf-8")
    return paths


# --- CosyVoice 1 and 3 releases and engines of the family tests ---
DATA = Path(__file__).parent / "data"
GOLDEN = {"v1": DATA / "cosyvoice1-tiny", "v3": DATA / "cosyvoice3-tiny"}
# What the golden checkpoints lack for synthesis, taken from a make-test-model release of the family.
_EXTRAS = {
    "v1": ("multilingual.tiktoken", "campplus.onnx", "speech_tokenizer_v1.onnx"),
    "v3": (
        "campplus.onnx",
        "speech_tokenizer_v3.onnx",
        f"{QWEN_DIR}/vocab.json",
        f"{QWEN_DIR}/merges.txt",
        f"{QWEN_DIR}/tokenizer_config.json",
    ),
}
INSTRUCT = "Speak slowly and warmly."


def family_release(factory: pytest.TempPathFactory, family: str) -> Path:
    """The golden tiny checkpoint of ``family`` plus a test tokenizer and stand-in frontend models.

    Built once per session in the pytest base temp (the e2e tests build their engines from it and
    verify them against the golden reference with it as ``--model-dir``).
    """
    require_build_extra()
    from trt_cosy.builder.testmodel.release import make_test_model

    base = factory.getbasetemp()
    release = base / f"{family}-tiny-release"
    if not release.is_dir():
        extras = make_test_model(
            base / f"{family}-tiny-extras", size="tiny", seed=0, overwrite=True, family=family
        )
        staging = base / f"{family}-tiny-release.partial"
        shutil.copytree(
            GOLDEN[family], staging, ignore=shutil.ignore_patterns("reference.npz", "MANIFEST.json")
        )
        for name in _EXTRAS[family]:
            shutil.copy2(extras / name, staging / name)
        staging.rename(release)
    return release


def family_engines(factory: pytest.TempPathFactory, family: str) -> Path:
    """ONNX Runtime engines of ``family_release``, built once per session (later calls are manifest skips)."""
    require_build_extra()
    from trt_cosy.builder.engines import build_engines

    return build_engines(family_release(factory, family), factory.getbasetemp() / f"{family}-tiny-engines")
