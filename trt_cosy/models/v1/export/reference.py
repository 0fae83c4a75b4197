"""The torch reference backend for CosyVoice 1: our v1 modules on the official checkpoint."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch.export import Dim

from ....builder.export import GraphPlan, hift_plan
from ....builder.torch_runner import torch_reference_model
from ....runtime.model import LoadedModel
from .. import graphs as graphs_v1
from ..config import V1ModelConfig, v1_config_from_release_dir
from ..stages import regulator_indices
from .flow import EstimatorGraphV1, FlowEncoderGraphV1, load_flow_v1
from .hift import HiFTGraphV1, load_hift_v1
from .llm import TextEncoderGraph, TransformerLMGraph, embedding_tables_v1, load_llm_v1

__all__ = ["load_torch_model_v1", "torch_graphs_v1", "export_plans_v1"]

_LOGGER = logging.getLogger(__name__)


def torch_graphs_v1(
    model_dir: Path, config: V1ModelConfig
) -> tuple[dict[str, torch.nn.Module], dict[str, np.ndarray]]:
    """The v1 graph modules keyed by graph name (for export and the reference), and the LLM tables."""
    llm = load_llm_v1(model_dir, config.llm)
    flow = load_flow_v1(model_dir, config.flow)
    hift = load_hift_v1(model_dir, config.hift)
    modules = {
        graphs_v1.V1_TEXT_ENCODER.name: TextEncoderGraph(llm),
        graphs_v1.V1_LLM.name: TransformerLMGraph(llm),
        graphs_v1.V1_FLOW_ENCODER.name: FlowEncoderGraphV1(flow),
        graphs_v1.V1_FLOW_ESTIMATOR.name: EstimatorGraphV1(flow),
        graphs_v1.V1_HIFT.name: HiFTGraphV1(hift),
    }
    return modules, embedding_tables_v1(llm)


def load_torch_model_v1(model_dir: Path, threads: int | None = None) -> LoadedModel:
    """Load a CosyVoice-300M(-SFT/-Instruct) release into our torch modules (fp32, CPU).

    ``flow_noise`` is empty: v1 draws fresh CFM noise per call (``trt_cosy.models.v1.stages.V1Draws``).
    """
    if threads:
        torch.set_num_threads(threads)
    model_dir = Path(model_dir)
    config = v1_config_from_release_dir(model_dir)
    modules, tables = torch_graphs_v1(model_dir, config)
    _LOGGER.debug("loaded v1 torch reference model from %s", model_dir)
    return torch_reference_model(config, graphs_v1.V1_GRAPHS, modules, tables, np.zeros((1, 80, 0), np.float32))


def export_plans_v1(config: V1ModelConfig, seed: int = 0) -> dict[str, GraphPlan]:
    """Sample feed, parity feeds and dynamic dims of every v1 graph (for ``builder.export.export_graph``).

    Sample lengths avoid 0 and 1 and coincidences between dims (torch.export specialises those);
    the parity feeds cover T = 1, P = 0, S = 0, odd estimator lengths and the regulator's 3-piece split.
    """
    rng = np.random.default_rng(seed)
    return {
        graphs_v1.V1_TEXT_ENCODER.name: _text_encoder_plan(config, rng),
        graphs_v1.V1_LLM.name: _llm_plan(config, rng),
        graphs_v1.V1_FLOW_ENCODER.name: _flow_encoder_plan(config, rng),
        graphs_v1.V1_FLOW_ESTIMATOR.name: _estimator_plan(config, rng),
        graphs_v1.V1_HIFT.name: hift_plan(config.hift, rng, rand_phase=True),
    }


def _text_encoder_plan(config: V1ModelConfig, rng: np.random.Generator) -> GraphPlan:
    llm = config.llm

    def feed(tokens: int) -> dict[str, np.ndarray]:
        return {
            "text_embeds": rng.standard_normal((1, tokens, llm.text_encoder_input_size), dtype=np.float32),
            "embedding": rng.standard_normal((1, llm.spk_embed_dim), dtype=np.float32),  # [1, 192]
        }

    return GraphPlan(feed(11), (feed(2), feed(23)), {"text_embeds": {1: Dim("N", min=1)}})


def _llm_plan(config: V1ModelConfig, rng: np.random.Generator) -> GraphPlan:
    lm = config.llm.llm

    def feed(new: int, past: int) -> dict[str, np.ndarray]:
        cache = (lm.num_blocks, 1, lm.attention_heads, past, lm.output_size // lm.attention_heads)
        return {
            "inputs_embeds": rng.standard_normal((1, new, config.llm.llm_input_size), dtype=np.float32),
            "past_keys": rng.standard_normal(cache, dtype=np.float32),  # [L, 1, H, P, Dh]
            "past_values": rng.standard_normal(cache, dtype=np.float32),
        }

    past = Dim("P", min=0)
    dynamic = {"inputs_embeds": {1: Dim("T", min=1)}, "past_keys": {3: past}, "past_values": {3: past}}
    return GraphPlan(feed(5, 7), (feed(1, 9), feed(6, 0)), dynamic)


def _flow_encoder_plan(config: V1ModelConfig, rng: np.random.Generator) -> GraphPlan:
    flow = config.flow

    def feed(prompt: int, tokens: int, prompt_frames: int) -> dict[str, np.ndarray]:
        index0, index1, weight1 = regulator_indices(prompt, tokens, prompt_frames, flow)
        return {
            "tokens": rng.integers(0, flow.vocab_size, (1, prompt + tokens), dtype=np.int64),  # [1, N]
            "embedding": rng.standard_normal((1, flow.spk_embed_dim), dtype=np.float32),  # [1, 192]
            "index0": index0,
            "index1": index1,
            "weight1": weight1,
        }

    frames = Dim("F", min=1)
    dynamic = {
        "tokens": {1: Dim("N", min=1)},
        "index0": {0: frames},
        "index1": {0: frames},
        "weight1": {0: frames},
    }
    return GraphPlan(feed(7, 23, 12), (feed(0, 50, 0), feed(25, 120, 43)), dynamic)


def _estimator_plan(config: V1ModelConfig, rng: np.random.Generator) -> GraphPlan:
    mels = config.flow.output_size

    def feed(frames: int) -> dict[str, np.ndarray]:
        return {
            "x": rng.standard_normal((2, mels, frames), dtype=np.float32),  # [2, 80, F]
            "mask": np.ones((2, 1, frames), dtype=np.float32),  # [2, 1, F]
            "mu": rng.standard_normal((2, mels, frames), dtype=np.float32),
            "t": rng.uniform(0.0, 1.0, 2).astype(np.float32),  # [2]
            "spks": rng.standard_normal((2, mels), dtype=np.float32),  # [2, 80]
            "cond": rng.standard_normal((2, mels, frames), dtype=np.float32),
        }

    frames = Dim("F", min=2)
    return GraphPlan(
        feed(60), (feed(37), feed(131)), {name: {2: frames} for name in ("x", "mask", "mu", "cond")}
    )


