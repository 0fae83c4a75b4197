"""ONNX export plans of the CosyVoice3 graphs (``models.v3.graphs``), on the generic ``export_graph``.

The LLM and the two estimator graphs have the CosyVoice2 contracts, so their CosyVoice2 plans are
reused (the DiT is traced like the U-Net). New here: the v3 flow encoder (no ``streaming`` input)
and the two causal HiFT graphs, whose NSF noise is uniform and whose streaming variant needs at
least ``HIFT_STREAM_MIN_FRAMES`` mel frames.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

import numpy as np
from torch.export import Dim

from ....builder.export import TOLERANCES, ExportResult, GraphPlan, Progress, export_graphs, graph_export_plan
from ....runtime.model import LoadedModel
from .. import graphs as graphs_v3
from ..config import V3ModelConfig

__all__ = ["V3_TOLERANCES", "v3_graph_export_plan", "export_model_v3"]

_LOGGER = logging.getLogger(__name__)

# Scaled max error: the CosyVoice2 ``TOLERANCES`` of the same graph names (HiFT waveforms and f0
# as for CosyVoice2); the streaming HiFT as the whole one.
V3_TOLERANCES: Final = {**TOLERANCES, graphs_v3.HIFT_V3_STREAM.name: TOLERANCES[graphs_v3.HIFT_V3.name]}


def v3_graph_export_plan(name: str, config: V3ModelConfig, seed: int = 0) -> GraphPlan:
    """Sample feed, parity feeds and dynamic dims of v3 graph ``name``."""
    rng = np.random.default_rng(seed)
    if name == graphs_v3.FLOW_ENCODER_V3.name:
        return _flow_encoder_plan(config, rng)
    if name == graphs_v3.HIFT_V3.name:
        return _hift_plan(config, rng, (12, 20, 7), min_frames=1)
    if name == graphs_v3.HIFT_V3_STREAM.name:
        return _hift_plan(
            config, rng, (23, 31, graphs_v3.HIFT_STREAM_MIN_FRAMES), graphs_v3.HIFT_STREAM_MIN_FRAMES
        )
    return graph_export_plan(name, config, seed)  # LLM, estimators: the CosyVoice2 contracts


def _flow_encoder_plan(config: V3ModelConfig, rng: np.random.Generator) -> GraphPlan:
    flow = config.flow

    def feed(tokens: int, context_valid: float) -> dict[str, np.ndarray]:
        return {
            "tokens": rng.integers(0, flow.vocab_size, (1, tokens), dtype=np.int64),  # [1, N]
            "context": rng.integers(0, flow.vocab_size, (1, flow.encoder.pre_lookahead_len), dtype=np.int64),
            "context_valid": np.array([context_valid], dtype=np.float32),  # [1]
            "embedding": rng.standard_normal((1, flow.spk_embed_dim), dtype=np.float32),  # [1, 192]
        }

    return GraphPlan(feed(30, 1.0), (feed(57, 1.0), feed(2, 0.0)), {"tokens": {1: Dim("N", min=1)}})


def _hift_plan(
    config: V3ModelConfig, rng: np.random.Generator, lengths: tuple[int, int, int], min_frames: int
) -> GraphPlan:
    hift = config.hift
    hop = hift.samples_per_frame
    harmonics = hift.nb_harmonics + 1

    def feed(frames: int) -> dict[str, np.ndarray]:
        mel = rng.standard_normal((1, hift.in_channels, frames), dtype=np.float32) - 4.0  # [1, 80, F]
        return {
            "mel": mel.astype(np.float32),
            "sine_noise": rng.uniform(0.0, 1.0, (1, frames * hop, harmonics)).astype(
                np.float32
            ),  # [1, 480F, 9]
        }

    frames = Dim("F", min=min_frames)
    dynamic = {"mel": {2: frames}, "sine_noise": {1: hop * frames}}
    sample, *parity = lengths
    return GraphPlan(feed(sample), tuple(feed(n) for n in parity), dynamic)


def export_model_v3(
    model: LoadedModel, out_dir: Path, progress: Progress | None = None
) -> dict[str, ExportResult]:
    """Export every graph of ``graphs_v3.GRAPHS_V3`` from a v3 torch reference model to ``out_dir``."""
    return export_graphs(
        model,
        out_dir,
        graphs_v3.GRAPHS_V3,
        lambda name: v3_graph_export_plan(name, model.config),
        V3_TOLERANCES.__getitem__,
        progress,
    )
