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
