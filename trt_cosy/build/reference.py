"""The torch reference backend: our modules on the official checkpoint, behind Runners.

``load_torch_model`` reads any family: CosyVoice 1 and 3 releases are handed to
``reference_v1.load_torch_model_v1`` / ``reference_v3.load_torch_model_v3``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..config import ModelConfig, release_family
from ..runtime import graphs
from ..runtime.model import LoadedModel
from .modules.flow import EstimatorGraph, FlowEncoderGraph, load_flow
from .modules.hift import HiFTGraph, load_hift
from .modules.llm import LLMGraph, embedding_tables, load_llm
from .noise import official_flow_noise
from .torch_runner import TorchRunner

__all__ = ["load_torch_model"]

_LOGGER = logging.getLogger(__name__)


def load_torch_model(
    model_dir: Path, threads: int | None = None, *, hift_noise_seconds: float | None = None
) -> LoadedModel:
    """Load an official release directory (any family) into our torch modules (fp32, CPU).

    Args:
        model_dir: the release folder; its yaml picks the family (``config.release_family``).
        threads: torch intra-op threads (None: torch's default).
        hift_noise_seconds: CosyVoice3 only: how much of the fixed 300 s HiFT noise buffer to keep
            (None: all of it, about 0.26 GB); ignored for the other families.
    """
    model_dir = Path(model_dir)
    family = release_family(model_dir)
    if family == "v1":
        from .models.v1.reference import load_torch_model_v1

        return load_torch_model_v1(model_dir, threads=threads)
    if family == "v3":
        from .models.v3.reference import load_torch_model_v3

        return load_torch_model_v3(model_dir, threads=threads, hift_noise_seconds=hift_noise_seconds)
    if threads:
        torch.set_num_threads(threads)
    config = ModelConfig.from_release_dir(model_dir)
    llm = load_llm(model_dir, config.llm)
    flow = load_flow(model_dir, config.flow)
    hift = load_hift(model_dir, config.hift)
    runners = {
        graphs.LLM.name: TorchRunner(graphs.LLM, LLMGraph(llm)),
        graphs.FLOW_ENCODER.name: TorchRunner(graphs.FLOW_ENCODER, FlowEncoderGraph(flow)),
        graphs.FLOW_ESTIMATOR.name: TorchRunner(graphs.FLOW_ESTIMATOR, EstimatorGraph(flow, streaming=False)),
        graphs.FLOW_ESTIMATOR_STREAM.name: TorchRunner(
            graphs.FLOW_ESTIMATOR_STREAM, EstimatorGraph(flow, streaming=True)
        ),
        graphs.HIFT.name: TorchRunner(graphs.HIFT, HiFTGraph(hift)),
    }
    _LOGGER.debug("loaded torch reference model from %s", model_dir)
    return LoadedModel(
        config=config,
        backend="torch",
        runners=runners,
        llm_tables=embedding_tables(llm),
        flow_noise=official_flow_noise(config.flow.cfm.noise_frames),
    )
