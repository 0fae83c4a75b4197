"""Which ONNX Runtime rewrites each graph gets, and the numerical proof that they changed nothing.

``rewrite_engine_graphs`` runs in ``trt-cosy build`` for the onnxruntime backend, on the float32
graphs right after their export passed the torch parity check and before any quantisation:

* the estimators: attention fused into ``MultiHeadAttention`` (bias dropped in the non-streaming
  one, see ``builder.onnx.rewrites``), Mish vectorised, GELU fused (erf GELU of the U-Net, tanh GELU
  of the CosyVoice3 DiT);
* the Qwen2 LLM (v2, v3): each layer's attention fused into ``GroupQueryAttention``
  (``builder.onnx.llm_rewrites``).

Every rewritten graph is run beside the exported one on the export plan's feeds; a difference above
``EQUIVALENCE_TOLERANCE`` (relative to the output's scale) fails the build as a trt-cosy bug.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import onnx

from ...errors import BuildError
from ...runtime.graphs import FLOW_ESTIMATOR, FLOW_ESTIMATOR_STREAM, LLM
from .files import save_onnx
from .llm_rewrites import fuse_qwen2_attention
from .rewrites import fuse_attention, fuse_gelu, fuse_tanh_gelu, rewrite_mish

__all__ = [
    "EQUIVALENCE_TOLERANCE",
    "GraphRewrites",
    "GRAPH_REWRITES",
    "INCREMENTAL_REWRITES",
    "RewriteCounts",
    "rewrite_model",
    "check_equivalent",
    "rewrite_engine_graphs",
]

_LOGGER = logging.getLogger(__name__)

EQUIVALENCE_TOLERANCE: Final = 1e-4  # max |after - before| / max |before|; float32 reassociation is ~1e-6

Feed = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class GraphRewrites:
    """What one graph gets: estimator attention (and whether its bias is dropped), Qwen2 attention."""

    attention: bool = False
    drop_attention_bias: bool = False
    qwen2_attention: bool = False


GRAPH_REWRITES: Final = {
    FLOW_ESTIMATOR.name: GraphRewrites(attention=True, drop_attention_bias=True),
    FLOW_ESTIMATOR_STREAM.name: GraphRewrites(attention=True),
    LLM.name: GraphRewrites(qwen2_attention=True),  # matches nothing in the v1 TransformerLM
}
# The incremental estimator (``builder.flow_incremental`` rewrites it itself, before quantisation): its
# attention over [cached ++ new] keys keeps the chunk mask of the new frames ([1, 1, T, P + T]) as
# ``attention_bias``; without the fusion each block splits and transposes the P + T keys and values
# into heads and writes the [2, H, T, P + T] scores four times.
INCREMENTAL_REWRITES: Final = GraphRewrites(attention=True)


@dataclass
class RewriteCounts:
    """How many sites each rewrite replaced in one graph."""

    attention: int = 0
    mish: int = 0
    gelu: int = 0
    qwen2_attention: int = 0

    def total(self) -> int:
        return self.attention + self.mish + self.gelu + self.qwen2_attention

    def describe(self) -> str:
        parts = {"attention": self.attention, "Mish": self.mish, "GELU": self.gelu}
        parts["GQA attention"] = self.qwen2_attention
        return ", ".join(f"{count} {name}" for name, count in parts.items() if count)


def rewrite_model(model: onnx.ModelProto, rewrites: GraphRewrites) -> RewriteCounts:
    """Apply ``rewrites`` to a float32 graph in place (Mish and GELU wherever they match)."""
    counts = RewriteCounts()
    if rewrites.qwen2_attention:
        counts.qwen2_attention = fuse_qwen2_attention(model)
    if rewrites.attention:
        counts.attention = fuse_attention(model, drop_bias=rewrites.drop_attention_bias)
        if rewrites.drop_attention_bias and counts.attention:
            note = "trt-cosy: attention ignores key padding here; every row must be unpadded (all-ones mask)."
            model.doc_string = f"{model.doc_string}\n{note}" if model.doc_string else note
    counts.mish = rewrite_mish(model)
    counts.gelu = fuse_gelu(model) + fuse_tanh_gelu(model)
    return counts


def check_equivalent(
    before: onnx.ModelProto | Path, after: onnx.ModelProto | Path, feeds: Iterable[Feed], what: str
) -> float:
    """Run both graphs (protos, or files for graphs with external weights) on ONNX Runtime's CPU
    provider and return the worst relative difference over ``feeds``.

    Raises:
        BuildError: the difference exceeds ``EQUIVALENCE_TOLERANCE`` (a rewrite changed the maths).
    """
    feeds = [dict(feed) for feed in feeds]
    session = _session(before)  # one session at a time: a full-size LLM holds 1.5 GB of weights
    reference = [session.run(None, feed) for feed in feeds]
    del session
    session = _session(after)
    worst = 0.0
    for feed, wanted in zip(feeds, reference, strict=True):
        for want, got in zip(wanted, session.run(None, feed), strict=True):
            scale = max(float(np.abs(want).max()), 1e-12)
            worst = max(worst, float(np.abs(got - want).max()) / scale)
    if not worst <= EQUIVALENCE_TOLERANCE:
        raise BuildError(
            f"{what}: the ONNX Runtime rewrites changed the outputs (max relative difference {worst:.2e} > "
            f"{EQUIVALENCE_TOLERANCE:g}). This is a trt-cosy bug: please report it with the model name."
        )
    return worst


def _session(graph: onnx.ModelProto | Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    source = str(graph) if isinstance(graph, Path) else graph.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def rewrite_engine_graphs(
    directory: Path, feeds_for: Callable[[str], Iterable[Feed]], progress: Callable[[str], None] | None = None
) -> dict[str, RewriteCounts]:
    """Rewrite the ``GRAPH_REWRITES`` graphs present in an engines directory in place (float32 graphs).

    Each rewritten graph is written beside the original (in a scratch folder), proven equal to it
    with ``check_equivalent`` and only then moved over it, weights file included.

    Args:
        directory: a staging engines directory holding ``<graph>.onnx`` as exported.
        feeds_for: feeds per graph name for the equivalence proof (the export plan's feeds); where
            the attention bias is dropped, only feeds with an all-ones ``mask`` are used.
        progress: optional callback for one line per graph.

    Returns:
        ``{graph: counts}`` for every graph rewritten.
    """
    directory = Path(directory)
    done = {}
    for name, rewrites in GRAPH_REWRITES.items():
        path = directory / f"{name}.onnx"
        if not path.is_file():
            continue
        start = time.perf_counter()
        model = onnx.load(str(path))
        counts = rewrite_model(model, rewrites)
        if not counts.total():
            continue
        feeds = [f for f in feeds_for(name) if not rewrites.drop_attention_bias or _unpadded(f)]
        with tempfile.TemporaryDirectory(prefix=".rewrite-", dir=directory) as scratch:
            staged = save_onnx(model, Path(scratch) / path.name)  # weights beside it as <graph>.onnx.data
            del model
            worst = check_equivalent(path, staged, feeds, name)
            path.with_name(path.name + ".data").unlink(missing_ok=True)
            for file in Path(scratch).iterdir():
                file.replace(directory / file.name)
        done[name] = counts
        message = (
            f"{name}: {counts.describe()} rewritten for ONNX Runtime "
            f"(max relative change {worst:.1e}, {time.perf_counter() - start:.1f} s)"
        )
        _LOGGER.info("%s", message)
        if progress is not None:
            progress(message)
    return done


def _unpadded(feed: Feed) -> bool:
    return "mask" not in feed or bool(np.all(feed["mask"] == 1))
