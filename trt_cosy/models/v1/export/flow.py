"""CosyVoice 1 flow (official ``MaskedDiffWithXvec``) as torch modules, and its exportable graphs.

docs/cosyvoice-spec §4.5: token embedding → full-attention Conformer encoder → ``encoder_proj``
(token rate, ``h``) → ``InterpolateRegulator`` (linear interpolation to mel rate, then 4 × [conv k3,
GroupNorm(1), Mish] and a 1×1 conv) → the CFM with the non-causal ``ConditionalDecoder`` estimator
(a two-level 1-D U-Net: stride-2 down-sampling, mid blocks at half rate, transposed-conv
up-sampling). Attribute names are the ``flow.pt`` keys.

The interpolation sizes depend on the token count (head/mid/tail split), so the host computes the
gather indices and weights (``trt_cosy.models.v1.stages.regulator_indices``) and the graph only gathers:
the exported graph has no data-dependent shapes. The CFM loop runs on the host around
``EstimatorGraphV1`` (the v2 estimator contract), with fresh noise per call drawn by the host.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ....builder.checkpoint import load_checkpoint
from ....builder.modules.flow import CFMWeights, FlowWeights
from ....builder.modules.flow_estimator import (
    TransformerBlock,
    _TimeMLP,
    estimator_attention_bias,
    sinusoidal_embedding,
)
from ....config import EstimatorConfig
from ....errors import ModelDirError
from ..config import V1FlowConfig
from .llm import ConformerEncoder

__all__ = [
    "InterpolateRegulator",
    "ConditionalDecoder",
    "MaskedDiffWithXvecV1",
    "FlowEncoderGraphV1",
    "EstimatorGraphV1",
    "load_flow_v1",
]

_LOGGER = logging.getLogger(__name__)
_FLOW_FILE = "flow.pt"
_GROUPS = 8  # Matcha Block1D GroupNorm groups


class InterpolateRegulator(nn.Module):
    """The conv stack of the official regulator (keys ``model.{0,1,3,4,...,12}``); the interpolation
    itself is a gather done by the caller."""

    def __init__(self, channels: int, stages: int):
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(stages):
            layers.extend([nn.Conv1d(channels, channels, 3, padding=1), nn.GroupNorm(1, channels), nn.Mish()])
        layers.append(nn.Conv1d(channels, channels, 1))
        self.model = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)  # x: [B, C, F]


class _Block1D(nn.Module):
    """Matcha ``Block1D``: conv k3 → GroupNorm(8) → Mish, masked (keys ``block.0``, ``block.1``)."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv1d(dim, dim_out, 3, padding=1), nn.GroupNorm(_GROUPS, dim_out), nn.Mish()
        )

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        return self.block(x * mask) * mask  # x: [B, C, T] -> [B, C', T]


class _ResnetBlock1D(nn.Module):
    """Matcha ``ResnetBlock1D``: two blocks, the time embedding added in between, 1×1 residual."""

    def __init__(self, dim: int, dim_out: int, time_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = _Block1D(dim, dim_out)
        self.block2 = _Block1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: Tensor, mask: Tensor, temb: Tensor) -> Tensor:
        h = self.block1(x, mask) + self.mlp(temb).unsqueeze(-1)  # h: [B, C', T]
        return self.block2(h, mask) + self.res_conv(x * mask)  # [B, C', T]


class _Resample(nn.Module):
    """Holds ``conv`` like Matcha's ``Downsample1D`` (k3 s2 p1) / ``Upsample1D`` (transposed k4 s2 p1)."""

    def __init__(self, conv: nn.Module):
        super().__init__()
        self.conv = conv

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)  # x: [B, C, T] -> [B, C, T/2] or [B, C, 2T]


class ConditionalDecoder(nn.Module):
    """The v1 estimator: ``forward(x, mask, mu, t, spks, cond) -> velocity [B, 80, T]`` (non-causal)."""

    def __init__(self, config: EstimatorConfig):
        super().__init__()
        channels = tuple(config.channels)
        if len(channels) < 1:
            raise ModelDirError("estimator channels must list at least one width; re-download the release.")
        time_dim = channels[0] * 4
        self.config = config
        self.time_mlp = _TimeMLP(config.in_channels, time_dim)

        def blocks(width: int) -> nn.ModuleList:
            return nn.ModuleList(
                TransformerBlock(width, config.num_heads, config.attention_head_dim)
                for _ in range(config.n_blocks)
            )

        self.down_blocks = nn.ModuleList()
        width_in = config.in_channels
        for i, width in enumerate(channels):
            last = i == len(channels) - 1
            down = (
                nn.Conv1d(width, width, 3, padding=1) if last else _Resample(nn.Conv1d(width, width, 3, 2, 1))
            )
            self.down_blocks.append(
                nn.ModuleList([_ResnetBlock1D(width_in, width, time_dim), blocks(width), down])
            )
            width_in = width
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([_ResnetBlock1D(channels[-1], channels[-1], time_dim), blocks(channels[-1])])
            for _ in range(config.num_mid_blocks)
        )
        ups = channels[::-1] + (channels[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(len(ups) - 1):
            width = ups[i + 1]
            last = i == len(ups) - 2
            up = (
                nn.Conv1d(width, width, 3, padding=1)
                if last
                else _Resample(nn.ConvTranspose1d(width, width, 4, 2, 1))
            )
            self.up_blocks.append(
                nn.ModuleList([_ResnetBlock1D(ups[i] * 2, width, time_dim), blocks(width), up])
            )
        self.final_block = _Block1D(ups[-1], ups[-1])
        self.final_proj = nn.Conv1d(ups[-1], config.out_channels, 1)

    @staticmethod
    def _attend(h: Tensor, blocks: nn.ModuleList, mask: Tensor) -> Tensor:
        bias = estimator_attention_bias(mask, 0, streaming=False)  # [B, 1, T, T]
        h = h.transpose(1, 2)  # h: [B, T, C]
        for block in blocks:
            h = block(h, bias)
        return h.transpose(1, 2)  # [B, C, T]

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        """x, mu, cond: [B, 80, T]; mask: [B, 1, T]; t: [B]; spks: [B, 80] -> [B, 80, T]."""
        temb = self.time_mlp(sinusoidal_embedding(t, self.config.in_channels).to(t.dtype))  # [B, 4W]
        speaker = spks.unsqueeze(-1).expand(spks.shape[0], spks.shape[1], x.shape[-1])  # [B, 80, T]
        h = torch.cat((x, mu, speaker, cond), dim=1)  # h: [B, in_channels, T]
        skips, masks = [], [mask]
        for resnet, blocks, down in self.down_blocks:
            level_mask = masks[-1]  # [B, 1, T_l]
            h = self._attend(resnet(h, level_mask, temb), blocks, level_mask)  # [B, W, T_l]
            skips.append(h)
            h = down(h * level_mask)  # [B, W, T_{l+1}]
            masks.append(level_mask[:, :, ::2])
        mid_mask = masks[-2]  # the deepest level that has a skip
        for resnet, blocks in self.mid_blocks:
            h = self._attend(resnet(h, mid_mask, temb), blocks, mid_mask)  # [B, W, T_mid]
        for (resnet, blocks, up), level_mask, skip in zip(
            self.up_blocks, reversed(masks[:-1]), reversed(skips), strict=True
        ):
            h = torch.cat((h[:, :, : skip.shape[-1]], skip), dim=1)  # [B, 2W, T_l]
            h = self._attend(resnet(h, level_mask, temb), blocks, level_mask)  # [B, W, T_l]
            h = up(h * level_mask)  # [B, W, 2 T_l] or [B, W, T_l]
        h = self.final_block(h, mask)  # [B, W, T]
        return self.final_proj(h * mask) * mask  # [B, 80, T]


class MaskedDiffWithXvecV1(FlowWeights):
    """Weights of the v1 flow; built from the release config, loaded from ``flow.pt``."""

    def __init__(self, config: V1FlowConfig):
        super().__init__(config)
        self.encoder = ConformerEncoder(config.encoder, causal=config.encoder.static_chunk_size > 0)
        self.encoder_proj = nn.Linear(config.encoder.output_size, config.output_size)
        self.length_regulator = InterpolateRegulator(config.regulator_channels, config.regulator_stages)
        self.decoder = CFMWeights(ConditionalDecoder(config.estimator))


class FlowEncoderGraphV1(nn.Module):
    """Contract ``V1_FLOW_ENCODER``: (tokens, embedding, index0, index1, weight1) -> (h, mu, spks)."""

    def __init__(self, flow: MaskedDiffWithXvecV1):
        super().__init__()
        self.flow = flow

    def forward(
        self, tokens: Tensor, embedding: Tensor, index0: Tensor, index1: Tensor, weight1: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """tokens: [1, N] (prompt ++ new); index0/index1: [F] int64; weight1: [F] -> h [1, N, 80],
        mu [1, 80, F], spks [1, 80]."""
        flow = self.flow
        spks = flow.spk_embed_affine_layer(F.normalize(embedding, dim=1))  # [1, 80]
        x = flow.input_embedding(torch.clamp(tokens, min=0))  # [1, N, input_size]
        h = flow.encoder_proj(flow.encoder(x))  # h: [1, N, 80]
        weight1 = weight1.reshape(1, -1, 1)  # [1, F, 1]
        frames = (1.0 - weight1) * torch.index_select(h, 1, index0) + weight1 * torch.index_select(
            h, 1, index1
        )
        mu = flow.length_regulator(frames.transpose(1, 2))  # [1, 80, F]
        return h, mu, spks


class EstimatorGraphV1(nn.Module):
    """Contract ``FLOW_ESTIMATOR``: the official estimator I/O (full attention)."""

    def __init__(self, flow: MaskedDiffWithXvecV1):
        super().__init__()
        self.estimator = flow.decoder.estimator

    def forward(self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor) -> Tensor:
        """x, mu, cond: [2, 80, F]; mask: [2, 1, F]; t: [2]; spks: [2, 80] -> estimator_out [2, 80, F]."""
        return self.estimator(x, mask, mu, t, spks, cond)


def load_flow_v1(model_dir: Path, config: V1FlowConfig) -> MaskedDiffWithXvecV1:
    """Build the v1 flow from ``config`` and load ``<model_dir>/flow.pt`` strictly (eval, fp32)."""
    path = Path(model_dir) / _FLOW_FILE
    flow = load_checkpoint(MaskedDiffWithXvecV1(config), path)
    _LOGGER.debug("v1 flow loaded from %s", path)
    return flow
