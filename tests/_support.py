"""Helpers shared by several test files (tests/ is on sys.path under pytest's default import mode)."""

from __future__ import annotations

import textwrap

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
    from trt_cosy.build.testmodel import make_test_model
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
    from trt_cosy.build.engines import build_engines

    return build_engines(tiny_release(factory, golden_dir), factory.getbasetemp() / "tiny-engines")


def shared_tiny_engines(factory, golden_dir):
    """(release, engines) of the session's tiny build (``tiny_release``, ``tiny_engines``)."""
    return tiny_release(factory, golden_dir), tiny_engines(factory, golden_dir)
