"""The CosyVoice2 torch reference model: our modules on the official checkpoint, behind Runners."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ....builder.modules.flow import EstimatorGraph, FlowEncoderGraph, load_flow
from ....builder.modules.hift import HiFTGraph, load_hift
from ....builder.modules.llm import LLMGraph, embedding_tables, load_llm
from ....builder.noise import official_flow_noise
from ....builder.torch_runner import torch_reference_model
from ....runtime import graphs
from ....runtime.model import LoadedModel
from ..config import v2_config_from_release_dir

__all__ = ["load_torch_model_v2"]

_LOGGER = logging.getLogger(__name__)


def load_torch_model_v2(model_dir: Path, threads: int | None = None) -> LoadedModel:
    """Load a CosyVoice2 release into our torch modules (fp32, CPU), with the official fixed CFM noise."""
    model_dir = Path(model_dir)
    if threads:
        torch.set_num_threads(threads)
    config = v2_config_from_release_dir(model_dir)
    llm = load_llm(model_dir, config.llm)
    flow = load_flow(model_dir, config.flow)
    hift = load_hift(model_dir, config.hift)
    modules = {
        graphs.LLM.name: LLMGraph(llm),
        graphs.FLOW_ENCODER.name: FlowEncoderGraph(flow),
        graphs.FLOW_ESTIMATOR.name: EstimatorGraph(flow, streaming=False),
        graphs.FLOW_ESTIMATOR_STREAM.name: EstimatorGraph(flow, streaming=True),
        graphs.HIFT.name: HiFTGraph(hift),
    }
    _LOGGER.debug("loaded torch reference model from %s", model_dir)
    flow_noise = official_flow_noise(config.flow.cfm.noise_frames)
    return torch_reference_model(config, graphs.GRAPHS, modules, embedding_tables(llm), flow_noise)
