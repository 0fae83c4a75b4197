"""CosyVoice2 flow encoder (``UpsampleConformerEncoder``), re-expressed for ONNX export.

Structure (docs/cosyvoice-spec §4.2): linear embed → pre-lookahead conv → ``num_blocks``
relative-position Conformer layers (no conv module, no macaron) → nearest ×2 upsample + causal
conv → second linear embed → ``num_up_blocks`` Conformer layers → final LayerNorm.

Export notes: the relative positional table is computed from ``arange`` of the dynamic length
(no Python-sized buffer), ``rel_shift`` is the pad-and-reshape trick (no [B, H, T, T] index
tensor, which GatherElements would have to materialise at T = 3000), and the streaming
switch is a tensor (chunk masks OR-ed with "full attention"), so one graph serves both modes.
Batch is 1 in practice and lengths never pad, so no padding masks are needed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...config import FlowEncoderConfig

__all__ = [
    "LinearEmbed",
    "rel_position_table",
    "chunk_attention_mask",
    "RelPositionAttention",
    "PositionwiseFeedForward",
    "ConformerLayer",
    "PreLookaheadLayer",
    "UpsampleConv",
    "UpsampleConformerEncoder",
]

_LOGGER = logging.getLogger(__name__)

_EMBED_LN_EPS = 1e-5  # LinearNoSubsampling's LayerNorm and after_norm
_LAYER_LN_EPS = 1e-12  # ConformerEncoderLayer norm_mha / norm_ff
_LOOKAHEAD_SLOPE = 0.01  # F.leaky_relu default slope used by the official PreLookaheadLayer


class LinearEmbed(nn.Module):
    """``LinearNoSubsampling`` + ``EspnetRelPositionalEncoding`` scaling: ``LN(Wx + b) · √d``.

    State keys ``out.0`` (Linear) and ``out.1`` (LayerNorm) as in the checkpoint (the official
    ``out.2`` is a parameter-free dropout).
    """

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.out = nn.Sequential(nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim, eps=_EMBED_LN_EPS))
        self.scale = math.sqrt(out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.scale  # x: [B, T, D]


def rel_position_table(length: torch.Tensor | int, d_model: int) -> torch.Tensor:
    """ESPnet relative positional table for ``length`` positions: [1, 2T-1, d_model].

    Row r holds relative position ``p = T-1-r`` (from +(T-1) down to -(T-1)), interleaved
    ``[sin(p·f_0), cos(p·f_0), sin(p·f_1), ...]`` with ``f_k = exp(-2k·ln(10000)/d)``. Equal to the
    centre slice of the official ``EspnetRelPositionalEncoding.pe`` (its negative half computes
    ``sin(-|p|·f)``, the same float products).
    """
    rows = torch.arange(2 * length - 1, dtype=torch.float32)  # [2T-1]
    positions = (length - 1) - rows  # [2T-1], descending
    freqs = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    angles = positions.unsqueeze(1) * freqs.unsqueeze(0)  # [2T-1, d/2]
    table = torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1)  # [2T-1, d/2, 2]
    return table.reshape(1, -1, d_model)  # [1, 2T-1, d]


def chunk_attention_mask(length: torch.Tensor | int, chunk: int, streaming: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask [1, T, T]: ``j < (i // chunk + 1) · chunk`` if streaming, else all True.

    ``streaming`` is a float tensor (> 0.5 means streaming), so no Python branch enters the graph.
    """
    index = torch.arange(length)  # [T]
    limit = (torch.div(index, chunk, rounding_mode="floor") + 1) * chunk  # [T]
    chunked = index.unsqueeze(0) < limit.unsqueeze(1)  # [T, T]
    full = (streaming.reshape(1, 1) <= 0.5).expand_as(chunked)  # [T, T]
    return (chunked | full).unsqueeze(0)  # [1, T, T]


def _rel_shift(scores: torch.Tensor) -> torch.Tensor:
    """[B, H, T, 2T-1] scores against relative positions +(T-1)..-(T-1) -> [B, H, T, T].

    ``out[i, j] = scores[i, T-1-i+j]`` (key j sits at relative position i-j): prepend a zero
    column, read the buffer as [2T, T], drop the first row, read it back as [T, 2T-1] and keep
    the first T columns.
    """
    batch, heads, length, width = scores.shape
    zeros = scores.new_zeros(batch, heads, length, 1)  # [B, H, T, 1]
    padded = torch.cat((zeros, scores), dim=-1).reshape(batch, heads, width + 1, length)  # [B, H, 2T, T]
    shifted = padded[:, :, 1:].reshape(batch, heads, length, width)  # [B, H, T, 2T-1]
    return shifted[:, :, :, :length]  # [B, H, T, T]


class RelPositionAttention(nn.Module):
    """Transformer-XL style self-attention, ESPnet variant (``RelPositionMultiHeadedAttention``)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.linear_q = nn.Linear(dim, dim)
        self.linear_k = nn.Linear(dim, dim)
        self.linear_v = nn.Linear(dim, dim)
        self.linear_out = nn.Linear(dim, dim)
        self.linear_pos = nn.Linear(dim, dim, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, self.head_dim))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, self.head_dim))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], x.shape[1], self.heads, self.head_dim)  # [B, T, H, Dh]

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_table: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        q = self._split(self.linear_q(x))  # q: [B, T, H, Dh]
        k = self._split(self.linear_k(x)).transpose(1, 2)  # k: [B, H, T, Dh]
        v = self._split(self.linear_v(x)).transpose(1, 2)  # v: [B, H, T, Dh]
        p = self._split(self.linear_pos(pos_table)).transpose(1, 2)  # p: [1, H, 2T-1, Dh]
        q_u = (q + self.pos_bias_u).transpose(1, 2)  # [B, H, T, Dh]
        q_v = (q + self.pos_bias_v).transpose(1, 2)  # [B, H, T, Dh]
        content = torch.matmul(q_u, k.transpose(-2, -1))  # [B, H, T, T]
        position = torch.matmul(q_v, p.transpose(-2, -1))  # [B, H, T, 2T-1]
        position = _rel_shift(position)  # [B, H, T, T]
        scores = (content + position) / math.sqrt(self.head_dim)  # [B, H, T, T]
        # The official fills -inf; every row keeps its diagonal, so the lowest float is equivalent.
        scores = scores.masked_fill(~mask.unsqueeze(1), torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1)  # [B, H, T, T]
        out = torch.matmul(weights, v).transpose(1, 2)  # [B, T, H, Dh]
        return self.linear_out(out.reshape(out.shape[0], length, -1))  # [B, T, D]


class PositionwiseFeedForward(nn.Module):
    """``PositionwiseFeedForward`` with ``activation`` between its layers (SiLU (swish) in the Conformer
    layers, ReLU in CosyVoice 1's Transformer LM): keys ``w_1``, ``w_2``."""

    def __init__(self, dim: int, hidden: int, activation: Callable[[torch.Tensor], torch.Tensor] = F.silu):
        super().__init__()
        self.w_1 = nn.Linear(dim, hidden)
        self.w_2 = nn.Linear(hidden, dim)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.activation(self.w_1(x)))  # x: [B, T, D]


class ConformerLayer(nn.Module):
    """Pre-norm ``ConformerEncoderLayer`` without macaron FFN or conv module."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.self_attn = RelPositionAttention(dim, heads)
        self.feed_forward = PositionwiseFeedForward(dim, hidden)
        self.norm_mha = nn.LayerNorm(dim, eps=_LAYER_LN_EPS)
        self.norm_ff = nn.LayerNorm(dim, eps=_LAYER_LN_EPS)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, pos_table: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos_table)  # x: [B, T, D]
        return x + self.feed_forward(self.norm_ff(x))  # [B, T, D]


class PreLookaheadLayer(nn.Module):
    """Each token sees itself and ``lookahead`` future tokens (right context or zeros)."""

    def __init__(self, dim: int, lookahead: int):
        super().__init__()
        self.conv1 = nn.Conv1d(dim, dim, kernel_size=lookahead + 1)
        self.conv2 = nn.Conv1d(dim, dim, kernel_size=3)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """x: [B, T, D]; context: [B, lookahead, D] (zeros when there is none)."""
        h = torch.cat((x, context), dim=1).transpose(1, 2)  # h: [B, D, T+L]
        h = F.leaky_relu(self.conv1(h), _LOOKAHEAD_SLOPE)  # [B, D, T]
        h = self.conv2(F.pad(h, (self.conv2.kernel_size[0] - 1, 0)))  # [B, D, T]
        return h.transpose(1, 2) + x  # [B, T, D]


class UpsampleConv(nn.Module):
    """Nearest ×stride repeat, left pad 2·stride, conv (kernel 2·stride+1): key ``conv``."""

    def __init__(self, dim: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(dim, dim, kernel_size=2 * stride + 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, D, T] -> [B, D, stride·T]."""
        batch, dim, length = x.shape
        # Nearest interpolation by an integer factor is a plain repeat of every frame.
        x = x.unsqueeze(-1).expand(batch, dim, length, self.stride).reshape(batch, dim, -1)  # [B, D, sT]
        return self.conv(F.pad(x, (2 * self.stride, 0)))  # [B, D, sT]


class UpsampleConformerEncoder(nn.Module):
    """The CosyVoice2 flow encoder; widths from the config (the tiny golden model uses 64)."""

    def __init__(self, config: FlowEncoderConfig):
        super().__init__()
        dim = config.output_size
        self.config = config
        self.embed = LinearEmbed(config.input_size, dim)
        self.pre_lookahead_layer = PreLookaheadLayer(dim, config.pre_lookahead_len)
        self.encoders = nn.ModuleList(
            ConformerLayer(dim, config.attention_heads, config.linear_units) for _ in range(config.num_blocks)
        )
        self.up_layer = UpsampleConv(dim, config.upsample_stride)
        self.up_embed = LinearEmbed(config.input_size, dim)
        self.up_encoders = nn.ModuleList(
            ConformerLayer(dim, config.attention_heads, config.linear_units)
            for _ in range(config.num_up_blocks)
        )
        self.after_norm = nn.LayerNorm(dim, eps=_EMBED_LN_EPS)

    def _stage(
        self, x: torch.Tensor, layers: nn.ModuleList, chunk: int, streaming: torch.Tensor
    ) -> torch.Tensor:
        length = x.shape[1]
        pos_table = rel_position_table(length, self.config.output_size)  # [1, 2T-1, D]
        mask = chunk_attention_mask(length, chunk, streaming)  # [1, T, T]
        for layer in layers:
            x = layer(x, mask, pos_table)  # x: [B, T, D]
        return x

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, context_valid: torch.Tensor, streaming: torch.Tensor
    ) -> torch.Tensor:
        """Encode embedded tokens.

        Args:
            x: token embeddings [B, T, input_size] (prompt + new tokens, without look-ahead).
            context: embeddings of the look-ahead tokens [B, L, input_size].
            context_valid: [1] float, 1 uses ``context``, 0 replaces it by zeros (finalize).
            streaming: [1] float, 1 for the official chunk masks, 0 for full attention.

        Returns:
            [B, stride·T, output_size].
        """
        chunk = self.config.static_chunk_size
        h = self.embed(x)  # h: [B, T, D]
        right = self.embed(context) * context_valid.reshape(1, 1, 1)  # right: [B, L, D]
        h = self.pre_lookahead_layer(h, right)  # [B, T, D]
        h = self._stage(h, self.encoders, chunk, streaming)  # [B, T, D]
        h = self.up_layer(h.transpose(1, 2)).transpose(1, 2)  # [B, 2T, D]
        h = self.up_embed(h)  # [B, 2T, D]
        h = self._stage(h, self.up_encoders, chunk * self.config.upsample_stride, streaming)  # [B, 2T, D]
        return self.after_norm(h)  # [B, 2T, D]
