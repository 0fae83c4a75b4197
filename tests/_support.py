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
