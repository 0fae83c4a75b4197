"""CosyVoice3 flow (official ``CausalMaskedDiffWithDiT``) as torch modules, and its graphs.

``CosyVoice3Flow`` holds the weights (attribute names = ``flow.pt`` keys). There is no conformer
encoder: ``mu`` is the token embedding (80-d) through the ``PreLookaheadLayer`` (each token sees
itself and 3 future tokens), repeated ``token_mel_ratio`` times along time, with no projection.

* ``V3FlowEncoderGraph`` follows ``runtime.graphs_v3.FLOW_ENCODER_V3`` (the CosyVoice2 encoder
  contract minus ``streaming``, which v3 does not need: the look-ahead conv has no attention).
* The estimator graph is the CosyVoice2 ``EstimatorGraph`` around the ``DiT`` (same contract).

The CFM loop runs on the host (``trt_cosy.stages.flow.FlowStage`` works unchanged with these graphs).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ....builder.checkpoint import load_checkpoint
from ....builder.modules.flow import CFMWeights, EstimatorGraph, FlowWeights
from ....builder.modules.flow_encoder import PreLookaheadLayer
from ..config import PreLookaheadConfig, V3FlowConfig
from .dit import DiT

__all__ = ["CosyVoice3Flow", "V3PreLookaheadLayer", "V3FlowEncoderGraph", "EstimatorGraph", "load_flow_v3"]

_LOGGER = logging.getLogger(__name__)

FLOW_CHECKPOINT = "flow.pt"


class V3PreLookaheadLayer(PreLookaheadLayer):
    """The CosyVoice2 look-ahead layer with a bottleneck: ``conv1`` in->channels, ``conv2`` channels->in.

    The forward (right context or zeros, conv1 k=L+1, leaky ReLU 0.01, causal conv2 k3, residual)
    is inherited unchanged.
    """

    def __init__(self, config: PreLookaheadConfig):
        nn.Module.__init__(self)
        self.conv1 = nn.Conv1d(config.in_channels, config.channels, kernel_size=config.pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(config.channels, config.in_channels, kernel_size=3)


class CosyVoice3Flow(FlowWeights):
    """Weights of the CosyVoice3 flow; built from the release config, loaded from ``flow.pt``."""

    def __init__(self, config: V3FlowConfig):
        super().__init__(config)
        self.pre_lookahead_layer = V3PreLookaheadLayer(config.encoder)
        self.decoder = CFMWeights(DiT(config.estimator))


def load_flow_v3(model_dir: Path, config: V3FlowConfig) -> CosyVoice3Flow:
    """Build the flow from ``config`` and load ``<model_dir>/flow.pt`` strictly (eval mode, fp32)."""
    path = Path(model_dir) / FLOW_CHECKPOINT
    return load_checkpoint(CosyVoice3Flow(config), path)


class V3FlowEncoderGraph(nn.Module):
    """Contract ``FLOW_ENCODER_V3``: (tokens, context, context_valid, embedding) -> (mu, spks)."""

    def __init__(self, flow: CosyVoice3Flow):
        super().__init__()
        self.flow = flow
        self.ratio = flow.config.token_mel_ratio

    def forward(
        self,
        tokens: torch.Tensor,
        context: torch.Tensor,
        context_valid: torch.Tensor,
        embedding: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens: [1, N] int64 (prompt ++ new, no look-ahead); context: [1, L] int64; context_valid: [1]
        (1 = real look-ahead tokens, 0 = finalize: zeros); embedding: [1, 192] -> mu [1, 80, 2N], spks [1, 80]."""
        flow = self.flow
        spks = flow.spk_embed_affine_layer(F.normalize(embedding, dim=1))  # [1, 80]
        x = flow.input_embedding(torch.clamp(tokens, min=0))  # x: [1, N, 80]
        right = flow.input_embedding(torch.clamp(context, min=0)) * context_valid  # right: [1, L, 80]
        h = flow.pre_lookahead_layer(x, right)  # h: [1, N, 80]
        mu = (
            h.unsqueeze(2).expand(-1, -1, self.ratio, -1).flatten(1, 2)
        )  # mu: [1, 2N, 80] (repeat_interleave)
        return mu.transpose(1, 2), spks  # [1, 80, 2N], [1, 80]
