"""CosyVoice2 flow (``CausalMaskedDiffWithXvec``) as torch modules, and its two exportable graphs.

``CosyVoice2Flow`` only holds the weights (attribute names = ``flow.pt`` keys). The CFM loop is
not here: it runs on the host (``trt_cosy.stages.flow``) around the estimator graph.

* ``FlowEncoderGraph`` follows ``runtime.graphs.FLOW_ENCODER``: token embedding, encoder,
  ``encoder_proj`` and the speaker affine layer.
* ``EstimatorGraph`` follows ``FLOW_ESTIMATOR`` (full attention) or ``FLOW_ESTIMATOR_STREAM``
  (50-frame chunk attention), picked at construction.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...config import FlowConfig
from ..checkpoint import load_checkpoint
from .flow_encoder import UpsampleConformerEncoder
from .flow_estimator import CausalConditionalDecoder

__all__ = ["CFMWeights", "FlowWeights", "CosyVoice2Flow", "load_flow", "FlowEncoderGraph", "EstimatorGraph"]

_LOGGER = logging.getLogger(__name__)

FLOW_CHECKPOINT = "flow.pt"


class CFMWeights(nn.Module):
    """Holds ``decoder.estimator`` (the official ``ConditionalCFM`` / ``CausalConditionalCFM`` of every
    family has no other weights)."""

    def __init__(self, estimator: nn.Module):
        super().__init__()
        self.estimator = estimator


class FlowWeights(nn.Module):
    """What every family's flow starts with, under the official key names: its config, the speech token
    ``input_embedding`` and the speaker ``spk_embed_affine_layer``; a family adds its encoder and
    ``decoder`` (``CFMWeights``) after them."""

    def __init__(self, config: Any):
        super().__init__()
        self.config = config
        self.input_embedding = nn.Embedding(config.vocab_size, config.input_size)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, config.output_size)


class CosyVoice2Flow(FlowWeights):
    """Weights of the CosyVoice2 flow; built from the release config, loaded from ``flow.pt``."""

    def __init__(self, config: FlowConfig):
        super().__init__(config)
        self.encoder = UpsampleConformerEncoder(config.encoder)
        self.encoder_proj = nn.Linear(config.encoder.output_size, config.output_size)
        self.decoder = CFMWeights(CausalConditionalDecoder(config.estimator))


def load_flow(model_dir: Path, config: FlowConfig) -> CosyVoice2Flow:
    """Build the flow from ``config`` and load ``<model_dir>/flow.pt`` strictly (eval mode, fp32)."""
    path = Path(model_dir) / FLOW_CHECKPOINT
    return load_checkpoint(CosyVoice2Flow(config), path)


class FlowEncoderGraph(nn.Module):
    """Contract ``FLOW_ENCODER``: (tokens, context, context_valid, streaming, embedding) -> (mu, spks)."""

    def __init__(self, flow: CosyVoice2Flow):
        super().__init__()
        self.flow = flow

    def forward(
        self,
        tokens: torch.Tensor,
        context: torch.Tensor,
        context_valid: torch.Tensor,
        streaming: torch.Tensor,
        embedding: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens: [1, N] int64 (prompt ++ new, no look-ahead); context: [1, L] int64;
        context_valid, streaming: [1] float; embedding: [1, 192] -> mu [1, 80, 2N], spks [1, 80]."""
        flow = self.flow
        spks = flow.spk_embed_affine_layer(F.normalize(embedding, dim=1))  # [1, 80]
        x = flow.input_embedding(torch.clamp(tokens, min=0))  # [1, N, input_size]
        right = flow.input_embedding(torch.clamp(context, min=0))  # [1, L, input_size]
        h = flow.encoder(x, right, context_valid, streaming)  # [1, 2N, D]
        mu = flow.encoder_proj(h).transpose(1, 2)  # [1, 80, 2N]
        return mu, spks


class EstimatorGraph(nn.Module):
    """Contract ``FLOW_ESTIMATOR`` / ``FLOW_ESTIMATOR_STREAM``: the official estimator I/O."""

    def __init__(self, flow: CosyVoice2Flow, streaming: bool):
        super().__init__()
        self.estimator = flow.decoder.estimator
        self.streaming = streaming

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
    ) -> torch.Tensor:
        """x, mu, cond: [2, 80, F]; mask: [2, 1, F]; t: [2]; spks: [2, 80] -> estimator_out [2, 80, F]."""
        return self.estimator(x, mask, mu, t, spks, cond, streaming=self.streaming)
