"""The torch reference backend: our modules on the official checkpoint, behind Runners.

``load_torch_model`` reads any family: the release's yaml picks its ``BuildFamily``
(``trt_cosy.builder.registry``), whose loader lives in ``builder/models/<name>/reference.py``.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.model import LoadedModel
from .registry import build_family_of_release

__all__ = ["load_torch_model"]


def load_torch_model(
    model_dir: Path, threads: int | None = None, *, hift_noise_seconds: float | None = None
) -> LoadedModel:
    """Load an official release directory (any family) into our torch modules (fp32, CPU).

    Args:
        model_dir: the release folder; its yaml picks the family (``family_lookup.family_of_release``).
        threads: torch intra-op threads (None: torch's default).
        hift_noise_seconds: CosyVoice3 only: how much of the fixed 300 s HiFT noise buffer to keep
            (None: all of it, about 0.26 GB); ignored for the other families.
    """
    model_dir = Path(model_dir)
    build = build_family_of_release(model_dir)
    return build.load_torch_model(model_dir, threads=threads, hift_noise_seconds=hift_noise_seconds)
