"""The torch reference backend for CosyVoice3 releases, and the fixed noise buffers v3 needs.

``load_torch_model_v3`` mirrors ``reference.load_torch_model`` (which dispatches here for a
``cosyvoice3.yaml`` release): our modules on the official checkpoint behind ``TorchRunner``s keyed by
the ``graphs_v3.GRAPHS_V3`` names, and the fixed HiFT noise in ``LoadedModel.hift_noise``.

``official_hift_noise`` regenerates the causal HiFT's ``SineGen2.sine_waves`` buffer. The official
class draws it from the global torch RNG during construction, so its values depend on every draw
made since the CFM's ``set_all_random_seed(0)``: the CFM noise itself, the flow's token embedding
and speaker affine layer, the f0 predictor's five convs and classifier, then ``rand(1, 9)``
(``rand_ini``) and ``rand(1, 7.2 M, 9)``. Re-making modules of the same shapes in the same order
replays those draws exactly (checked bit for bit on the golden tiny model), so the buffer of a
release follows from its config; the weights' values do not matter.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

import numpy as np
import torch
from torch import nn

from ....builder.noise import NOISE_FRAMES, NOISE_SEED, official_flow_noise
from ....builder.torch_runner import torch_reference_model
from ....runtime.model import LoadedModel
from .. import graphs as graphs_v3
from ..config import V3ModelConfig, v3_config_from_release_dir
from .causal_hift import CausalHiFTGraph, load_causal_hift
from .flow import EstimatorGraph, V3FlowEncoderGraph, load_flow_v3
from .llm import LLMGraph, embedding_tables_v3, load_llm_v3

__all__ = ["load_torch_model_v3", "official_hift_noise"]

_LOGGER = logging.getLogger(__name__)
_F0_LAYERS: Final = 5
_F0_FIRST_KERNEL: Final = 4
_F0_KERNEL: Final = 3


def official_hift_noise(config: V3ModelConfig, seconds: float | None = None) -> np.ndarray:
    """The official ``sine_waves[:, :seconds · sr]`` as float32 [1, S, nb_harmonics + 1], uniform [0, 1).

    The whole 300 s buffer is always drawn (about 0.3 GB, briefly) and then cut; the global torch
    RNG state is restored afterwards.
    """
    hift, flow = config.hift, config.flow
    total = hift.noise_seconds * hift.sampling_rate
    keep = total if seconds is None else min(total, int(round(seconds * hift.sampling_rate)))
    channels = hift.nb_harmonics + 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(NOISE_SEED)  # CausalConditionalCFM: set_all_random_seed(0) ...
        torch.randn(1, flow.output_size, NOISE_FRAMES)  # ... then its rand_noise
        nn.Embedding(flow.vocab_size, flow.input_size)  # CausalMaskedDiffWithDiT.input_embedding
        nn.Linear(flow.spk_embed_dim, flow.output_size)  # .spk_embed_affine_layer
        nn.Conv1d(hift.f0_in_channels, hift.f0_cond_channels, _F0_FIRST_KERNEL)  # f0_predictor.condnet
        for _ in range(_F0_LAYERS - 1):
            nn.Conv1d(hift.f0_cond_channels, hift.f0_cond_channels, _F0_KERNEL)
        nn.Linear(hift.f0_cond_channels, 1)  # f0_predictor.classifier
        torch.rand(1, channels)  # SineGen2.rand_ini (no effect on the output)
        buffer = torch.rand(1, total, channels)  # SineGen2.sine_waves: [1, 7.2M, 9]
    return buffer[:, :keep].numpy().copy()  # [1, S, 9]


def load_torch_model_v3(
    model_dir: Path,
    threads: int | None = None,
    *,
    hift_noise_seconds: float | None = None,
    f0_float64: bool = False,
) -> LoadedModel:
    """Load a CosyVoice3 release directory into our torch modules (fp32, CPU).

    Args:
        model_dir: the release folder (``cosyvoice3.yaml``, ``llm.pt``, ``flow.pt``, ``hift.pt``, ...).
        threads: torch intra-op threads (None: torch's default).
        hift_noise_seconds: how much of the 300 s HiFT noise buffer to keep (None: all of it).
        f0_float64: run the f0 predictor in float64 as the official code does (the exported graphs
            and the default reference use float32; both are within the golden tolerances).
    """
    if threads:
        torch.set_num_threads(threads)
    model_dir = Path(model_dir)
    config = v3_config_from_release_dir(model_dir)
    llm = load_llm_v3(model_dir, config.llm)
    flow = load_flow_v3(model_dir, config.flow)
    hift = load_causal_hift(model_dir, config.hift)
    specs = graphs_v3.GRAPHS_V3
    modules = {
        graphs_v3.LLM.name: LLMGraph(llm),
        graphs_v3.FLOW_ENCODER_V3.name: V3FlowEncoderGraph(flow),
        graphs_v3.FLOW_ESTIMATOR.name: EstimatorGraph(flow, streaming=False),
        graphs_v3.FLOW_ESTIMATOR_STREAM.name: EstimatorGraph(flow, streaming=True),
        graphs_v3.HIFT_V3.name: CausalHiFTGraph(hift, finalize=True, f0_float64=f0_float64),
        graphs_v3.HIFT_V3_STREAM.name: CausalHiFTGraph(hift, finalize=False, f0_float64=f0_float64),
    }
    _LOGGER.debug("loaded torch reference CosyVoice3 model from %s", model_dir)
    return torch_reference_model(
        config,
        specs,
        modules,
        embedding_tables_v3(llm),
        official_flow_noise(config.flow.cfm.noise_frames),
        hift_noise=official_hift_noise(config, hift_noise_seconds),
    )
