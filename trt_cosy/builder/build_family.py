"""What a model family is to ``trt-cosy build``: the torch side of a ``Family`` (``BuildFamily``).

Each family has one subclass, ``trt_cosy/builder/models/<name>/family.py``, holding the torch reference
loader, the export plans and exporter of the family's graph set, the host data only it writes and
its random test-model writer; ``trt_cosy.builder.registry`` maps a release directory or a
model config to it. Torch is imported only under ``trt_cosy/builder/``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from ..config import QWEN_DIR
from ..runtime.model import LoadedModel
from .export import ExportResult, GraphPlan, Progress
from .quantize.policies import PrecisionPolicy
from .tokenizer_copy import copy_qwen_tokenizer

__all__ = ["BuildFamily"]


class BuildFamily(ABC):
    """The build steps of one family; ``family`` is its inference-side ``Family``."""

    family: ClassVar[Any]  # its ``models.family.Family`` (``family_lookup.FAMILIES[name]``)
    # Per graph: which nodes stay fp32 in the fp16 pass (``builder.quantize.policies``; by torch class
    # names, which only the build side knows); a graph not listed keeps the op-type islands only.
    precision_policies: ClassVar[Mapping[str, PrecisionPolicy]]

    @abstractmethod
    def load_torch_model(
        self, model_dir: Path, threads: int | None = None, *, hift_noise_seconds: float | None = None
    ) -> LoadedModel:
        """Our torch modules on the release's checkpoint (fp32, CPU), behind ``TorchRunner``s."""

    def precision_policy(self, graph: str) -> PrecisionPolicy:
        """The fp16 pass's policy of ``graph``; the op-type islands only for a graph not listed."""
        return self.precision_policies.get(graph, PrecisionPolicy())

    def load_for_build(self, model_dir: Path) -> LoadedModel:
        """The torch model ``trt-cosy build`` exports (the family may trim what the engines keep)."""
        return self.load_torch_model(model_dir)

    @abstractmethod
    def export_plan(self, config: Any, name: str) -> GraphPlan:
        """The export plan (sample and parity feeds, dynamic dims) of graph ``name``."""

    @abstractmethod
    def export(self, model: LoadedModel, out_dir: Path, progress: Progress | None = None) -> dict[str, ExportResult]:
        """Export every graph of the family to ``out_dir/<graph>.onnx`` with the parity checks."""

    def incremental_estimator_graph(self, model: LoadedModel) -> tuple[Any, Any, GraphPlan] | None:
        """(graph contract, torch module, export plan) of the family's incremental streaming estimator
        (``Family.incremental_estimator``), or None where it has none."""
        return None

    def copy_text_tokenizer(self, model_dir: Path, tokenizer_dir: Path) -> None:
        """Copy the release's text tokenizer into the engines' ``tokenizer_dir`` (Qwen2's by default)."""
        copy_qwen_tokenizer(Path(model_dir) / QWEN_DIR, tokenizer_dir)

    def write_extra_data(self, model: LoadedModel, model_dir: Path, staging: Path) -> None:
        """Host data only this family's engines carry (beyond the tables and fixed noise); none by default."""
        return None

    @abstractmethod
    def write_test_release(self, root: Path, size: str, seed: int) -> None:
        """Write a random-weight release directory of this family to ``root`` (``trt-cosy make-test-model``)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.family.name!r}>"
