"""CosyVoice2 CFM estimator (``CausalConditionalDecoder``), re-expressed for ONNX export.

A one-level causal 1-D U-Net (docs/cosyvoice-spec §4.4): time MLP, a down block, ``num_mid_blocks``
mid blocks and an up block, each a causal ResNet block followed by ``n_blocks`` transformer blocks
(Matcha's copy of diffusers' ``BasicTransformerBlock``), then a final causal block and a 1×1
projection. State-dict keys match the official checkpoint under ``decoder.estimator.``.

The attention mask is fixed per module instance: full (key padding only) or 50-frame chunked
(streaming). Both graphs keep the official estimator I/O ``(x, mask, mu, t, spks, cond)``.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...config import EstimatorConfig
from ...errors import ModelDirError

__all__ = [
    "CausalConv1d",
    "CausalBlock1D",
    "CausalResnetBlock1D",
    "TransformerBlock",
    "sinusoidal_embedding",
    "estimator_attention_bias",
    "CFMEstimator",
    "CausalConditionalDecoder",
]

_LOGGER = logging.getLogger(__name__)

_MASK_BIAS = -1.0e10  # cosyvoice.utils.common.mask_to_bias
_TIME_SCALE = 1000.0  # Matcha SinusoidalPosEmb default scale
_FF_MULT = 4  # diffusers FeedForward default


class CausalConv1d(nn.Conv1d):
    """Conv1d padded with ``kernel_size - 1`` zeros on the left only (stride 1)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.left_pad = kernel_size - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.left_pad, 0)))  # x: [B, C, T] -> [B, C', T]


class _ChannelsLast(nn.Module):
    """Swap the channel and time axes (holds the Sequential slot of the official ``Transpose``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2)


class CausalBlock1D(nn.Module):
    """``conv(k3, causal) → LayerNorm over channels → Mish``, masked before and after.

    Keys ``block.0`` (conv) and ``block.2`` (LayerNorm), as in the official Sequential.
    """

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.block = nn.Sequential(
            CausalConv1d(dim, dim_out, 3), _ChannelsLast(), nn.LayerNorm(dim_out), _ChannelsLast(), nn.Mish()
        )

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.block(x * mask) * mask  # x: [B, C, T], mask: [B, 1, T] -> [B, C', T]


class CausalResnetBlock1D(nn.Module):
    """Two causal blocks with the time embedding added in between, plus a 1×1 residual conv."""

    def __init__(self, dim: int, dim_out: int, time_dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.block1(x, mask) + self.mlp(temb).unsqueeze(-1)  # h: [B, C', T]
        h = self.block2(h, mask)  # [B, C', T]
        return h + self.res_conv(x * mask)  # [B, C', T]


class _SelfAttention(nn.Module):
    """diffusers ``Attention`` (self-attention only): q/k/v without bias, ``to_out.0`` with bias."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], x.shape[1], self.heads, -1).transpose(1, 2)  # [B, H, T, Dh]

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D]; bias: additive mask [B, 1, T, T]."""
        q, k, v = self._split(self.to_q(x)), self._split(self.to_k(x)), self._split(self.to_v(x))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # [B, H, T, Dh]
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)  # [B, T, H·Dh]
        return self.to_out[0](out)  # [B, T, D]


class _GeluProjection(nn.Module):
    """diffusers ``GELU``: Linear then exact (erf) GELU; key ``proj``."""

    def __init__(self, dim: int, dim_out: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class _FeedForward(nn.Module):
    """diffusers ``FeedForward`` with ``activation_fn='gelu'``: keys ``net.0.proj``, ``net.2``."""

    def __init__(self, dim: int):
        super().__init__()
        self.net = nn.Sequential(
            _GeluProjection(dim, dim * _FF_MULT), nn.Identity(), nn.Linear(dim * _FF_MULT, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # x: [B, T, D]


class TransformerBlock(nn.Module):
    """``BasicTransformerBlock`` without cross-attention: pre-LN self-attention, pre-LN GELU FFN."""

    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = _SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = _FeedForward(dim)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), bias)  # x: [B, T, D]
        return x + self.ff(self.norm3(x))  # [B, T, D]


def sinusoidal_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Matcha ``SinusoidalPosEmb(dim)(t)`` with scale 1000: [B] -> [B, dim] = [sin, cos]."""
    half = dim // 2
    step = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * -step)  # [half]
    angles = _TIME_SCALE * t.unsqueeze(1) * freqs.unsqueeze(0)  # [B, half]
    return torch.cat((angles.sin(), angles.cos()), dim=-1)  # [B, dim]


def estimator_attention_bias(mask: torch.Tensor, chunk: int, streaming: bool) -> torch.Tensor:
    """Additive attention bias [B, 1, T, T] from the frame mask [B, 1, T] (``mask_to_bias``).

    Full: key padding only. Streaming: also ``j < (i // chunk + 1) · chunk``.
    """
    keys = mask > 0.5  # [B, 1, T]
    length = mask.shape[-1]
    allowed = keys.expand(mask.shape[0], length, length)  # [B, T, T]
    if streaming:  # a construction-time flag: each graph is exported with one value
        index = torch.arange(length)  # [T]
        limit = (torch.div(index, chunk, rounding_mode="floor") + 1) * chunk  # [T]
        allowed = allowed & (index.unsqueeze(0) < limit.unsqueeze(1)).unsqueeze(0)  # [B, T, T]
    return ((1.0 - allowed.to(mask.dtype)) * _MASK_BIAS).unsqueeze(1)  # [B, 1, T, T]


class CFMEstimator(nn.Module):
    """A CFM estimator (v2's U-Net, v3's DiT): ``forward(x, mask, mu, t, spks, cond) -> velocity [B, 80, T]``,
    attention full or chunked (``streaming``); a subclass computes the ``velocity``."""

    def __init__(self, config: Any, streaming: bool):
        super().__init__()
        self.config = config
        self.streaming = streaming

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        streaming: bool | None = None,
    ) -> torch.Tensor:
        """x, mu, cond: [B, 80, T]; mask: [B, 1, T]; t: [B]; spks: [B, 80] -> [B, 80, T].

        ``streaming`` overrides the constructor flag (a Python bool, fixed in an exported graph).
        """
        return self.velocity(x, mask, mu, t, spks, cond, self.streaming if streaming is None else streaming)

    def velocity(
        self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, chunked: bool
    ) -> Tensor:
        """``forward`` with ``chunked``: the attention is chunked (``static_chunk_size``)."""
        raise NotImplementedError


class CausalConditionalDecoder(CFMEstimator):
    """The v2 estimator: ``forward(x, mask, mu, t, spks, cond) -> velocity [B, 80, T]``."""

    def __init__(self, config: EstimatorConfig, streaming: bool = False):
        super().__init__(config, streaming)
        if len(config.channels) != 1:
            raise ModelDirError(
                f"estimator channels {list(config.channels)}: only the one-level CausalConditionalDecoder "
                "of CosyVoice2 (channels: [256]) is supported. Use a CosyVoice2 release."
            )
        width = config.channels[0]
        time_dim = width * 4
        self.time_mlp = _TimeMLP(config.in_channels, time_dim)

        def stage(dim_in: int, with_conv: bool) -> nn.ModuleList:
            parts = [
                CausalResnetBlock1D(dim_in, width, time_dim),
                nn.ModuleList(
                    TransformerBlock(width, config.num_heads, config.attention_head_dim)
                    for _ in range(config.n_blocks)
                ),
            ]
            if with_conv:
                parts.append(CausalConv1d(width, width, 3))
            return nn.ModuleList(parts)

        self.down_blocks = nn.ModuleList([stage(config.in_channels, True)])
        self.mid_blocks = nn.ModuleList(stage(width, False) for _ in range(config.num_mid_blocks))
        self.up_blocks = nn.ModuleList([stage(2 * width, True)])
        self.final_block = CausalBlock1D(width, width)
        self.final_proj = nn.Conv1d(width, config.out_channels, 1)

    @staticmethod
    def _transformers(h: torch.Tensor, blocks: nn.ModuleList, bias: torch.Tensor) -> torch.Tensor:
        h = h.transpose(1, 2)  # h: [B, T, C]
        for block in blocks:
            h = block(h, bias)
        return h.transpose(1, 2)  # [B, C, T]

    def velocity(
        self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, chunked: bool
    ) -> Tensor:
        temb = self.time_mlp(sinusoidal_embedding(t, self.config.in_channels).to(t.dtype))  # [B, 4W]
        frames = x.shape[-1]
        speaker = spks.unsqueeze(-1).expand(spks.shape[0], spks.shape[1], frames)  # [B, 80, T]
        h = torch.cat((x, mu, speaker, cond), dim=1)  # h: [B, in_channels, T]
        bias = estimator_attention_bias(mask, self.config.static_chunk_size, chunked)  # [B, 1, T, T]

        resnet, blocks, conv = self.down_blocks[0]
        h = self._transformers(resnet(h, mask, temb), blocks, bias)  # [B, W, T]
        skip = h
        h = conv(h * mask)  # [B, W, T]
        for resnet, blocks in self.mid_blocks:
            h = self._transformers(resnet(h, mask, temb), blocks, bias)  # [B, W, T]
        resnet, blocks, conv = self.up_blocks[0]
        h = torch.cat((h, skip), dim=1)  # [B, 2W, T] (no resampling: lengths already match)
        h = self._transformers(resnet(h, mask, temb), blocks, bias)  # [B, W, T]
        h = conv(h * mask)  # [B, W, T]
        h = self.final_block(h, mask)  # [B, W, T]
        return self.final_proj(h * mask) * mask  # [B, 80, T]


class _TimeMLP(nn.Module):
    """diffusers ``TimestepEmbedding`` with SiLU: keys ``linear_1``, ``linear_2``."""

    def __init__(self, in_dim: int, time_dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, time_dim)
        self.linear_2 = nn.Linear(time_dim, time_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))  # [B, in] -> [B, time_dim]
