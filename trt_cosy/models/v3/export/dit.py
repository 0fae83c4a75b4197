"""CosyVoice3 CFM estimator (official ``cosyvoice.flow.DiT.dit.DiT``), re-expressed for ONNX export.

An F5-TTS style diffusion transformer (docs/cosyvoice-spec §4.6):

* time: Matcha-style sinusoid (256-d, scale 1000) -> ``Linear, SiLU, Linear`` (``time_embed.time_mlp``);
* input: ``proj(concat[x, cond, mu, spks])`` (note the order) plus a causal depth-wise conv position
  embedding (two ``Conv1d(k31, groups 16)`` + Mish, left-padded);
* ``depth`` ``DiTBlock``s: AdaLayerNormZero (shift/scale/gate from the time embedding, LayerNorm
  eps 1e-6 without affine), self-attention with x-transformers rotary embeddings, tanh-GELU FFN;
* ``AdaLayerNormZero_Final`` (scale first, then shift) and ``proj_out``.

RoPE follows x-transformers 2.11 exactly: frequencies repeated pairwise ``[f0, f0, f1, f1, ...]``,
``rotate_half`` on adjacent pairs, and it is applied to the *un-split* projections ``[B, T, H·Dh]``
with a table of width ``dim_head``, so only the first ``dim_head`` channels (head 0) are rotated and
the other heads get no position signal (partial rotary, as the official model was trained).
The attention mask is the CosyVoice2 one (``estimator_attention_bias``): key padding, plus the
50-frame chunk mask when the instance is built with ``streaming=True``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ....builder.modules.flow_estimator import CFMEstimator, estimator_attention_bias, sinusoidal_embedding
from ..config import DiTConfig

__all__ = ["DiT", "DiTBlock", "rotary_tables", "apply_rotary"]

_LOGGER = logging.getLogger(__name__)

_NORM_EPS = 1e-6  # AdaLayerNormZero / ff_norm LayerNorm eps (no affine)
_ROPE_BASE = 10000.0  # x-transformers RotaryEmbedding default base


def rotary_tables(inv_freq: torch.Tensor, length: int | torch.SymInt) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, Dh] for positions 0..T-1, frequencies repeated pairwise (x-transformers layout)."""
    positions = torch.arange(length, device=inv_freq.device).to(inv_freq.dtype)  # [T]
    freqs = positions[:, None] * inv_freq[None, :]  # freqs: [T, Dh/2]
    freqs = torch.stack((freqs, freqs), dim=-1).flatten(-2)  # freqs: [T, Dh], [f0, f0, f1, f1, ...]
    return freqs.cos(), freqs.sin()


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """x-transformers ``rotate_half``: each adjacent pair (a, b) -> (-b, a)."""
    pairs = x.unflatten(-1, (-1, 2))  # pairs: [..., Dh/2, 2]
    first, second = pairs[..., 0], pairs[..., 1]
    return torch.stack((-second, first), dim=-1).flatten(-2)  # [..., Dh]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``Dh`` channels of x [B, T, C] (C >= Dh); the rest pass through."""
    width = cos.shape[-1]
    rotated, passed = x[..., :width], x[..., width:]  # rotated: [B, T, Dh], passed: [B, T, C - Dh]
    rotated = rotated * cos + _rotate_pairs(rotated) * sin  # [B, T, Dh]
    return torch.cat((rotated, passed), dim=-1)  # [B, T, C]


class _RotaryEmbedding(nn.Module):
    """Holds ``inv_freq`` (a persistent buffer in the official checkpoint: ``rotary_embed.inv_freq``)."""

    def __init__(self, dim_head: int):
        super().__init__()
        exponent = torch.arange(0, dim_head, 2).float() / dim_head  # [Dh/2]
        self.register_buffer("inv_freq", 1.0 / (_ROPE_BASE**exponent))


class _TimestepEmbedding(nn.Module):
    """Keys ``time_mlp.0`` and ``time_mlp.2``: ``Linear(256, dim), SiLU, Linear(dim, dim)``."""

    def __init__(self, dim: int, freq_dim: int):
        super().__init__()
        self.freq_dim = freq_dim
        self.time_mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        hidden = sinusoidal_embedding(t, self.freq_dim).to(t.dtype)  # hidden: [B, 256]
        return self.time_mlp(hidden)  # [B, D]


class _CausalConvPositionEmbedding(nn.Module):
    """Two grouped ``Conv1d(k)`` + Mish, each left-padded with ``k - 1`` zeros (keys ``conv1.0``, ``conv2.0``)."""

    def __init__(self, dim: int, kernel_size: int, groups: int):
        super().__init__()
        self.left_pad = kernel_size - 1
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, kernel_size, groups=groups), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)  # h: [B, D, T]
        h = self.conv1(F.pad(h, (self.left_pad, 0)))  # [B, D, T]
        h = self.conv2(F.pad(h, (self.left_pad, 0)))  # [B, D, T]
        return h.transpose(1, 2)  # [B, T, D]


class _InputEmbedding(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        self.proj = nn.Linear(config.in_channels, config.dim)
        self.conv_pos_embed = _CausalConvPositionEmbedding(
            config.dim, config.conv_pos_kernel, config.conv_pos_groups
        )

    def forward(
        self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor
    ) -> torch.Tensor:
        """x, cond, mu: [B, T, 80]; spks: [B, 80] -> [B, T, D]."""
        speaker = spks.unsqueeze(1).expand(spks.shape[0], x.shape[1], spks.shape[1])  # [B, T, 80]
        h = self.proj(torch.cat((x, cond, mu, speaker), dim=-1))  # h: [B, T, D]
        return self.conv_pos_embed(h) + h  # [B, T, D]


class _AdaLayerNorm(nn.Module):
    """``linear(silu(t))`` split into ``chunks`` modulation vectors (key ``linear``)."""

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, dim * chunks)

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.chunk(self.linear(F.silu(temb)).unsqueeze(1), self.chunks, dim=-1)  # each [B, 1, D]


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    normed = F.layer_norm(x, (x.shape[-1],), eps=_NORM_EPS)  # [B, T, D]
    return normed * (1 + scale) + shift  # [B, T, D]


class _Attention(nn.Module):
    """F5 ``Attention`` + ``AttnProcessor``: q/k/v/out with bias, RoPE on the un-split projections."""

    def __init__(self, dim: int, heads: int, dim_head: int):
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.heads, -1)).transpose(1, 2)  # [B, H, T, Dh]

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """x: [B, T, D]; bias: [B, 1, T, T] additive; cos/sin: [T, Dh] -> [B, T, D]."""
        query = apply_rotary(self.to_q(x), cos, sin)  # query: [B, T, H·Dh]
        key = apply_rotary(self.to_k(x), cos, sin)  # key: [B, T, H·Dh]
        value = self.to_v(x)  # value: [B, T, H·Dh]
        out = F.scaled_dot_product_attention(
            self._split(query), self._split(key), self._split(value), attn_mask=bias
        )  # out: [B, H, T, Dh]
        return self.to_out[0](out.transpose(1, 2).flatten(2))  # [B, T, D]


class _FeedForward(nn.Module):
    """Keys ``ff.0.0`` (Linear in, tanh-GELU) and ``ff.2`` (Linear out); ``ff.1`` is dropout."""

    def __init__(self, dim: int, mult: float):
        super().__init__()
        inner = int(dim * mult)
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
            nn.Identity(),
            nn.Linear(inner, dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)  # [B, T, D]


class DiTBlock(nn.Module):
    """AdaLN-Zero transformer block: gated attention and gated FFN, both modulated by the time."""

    def __init__(self, config: DiTConfig):
        super().__init__()
        self.attn_norm = _AdaLayerNorm(config.dim, 6)
        self.attn = _Attention(config.dim, config.heads, config.dim_head)
        self.ff = _FeedForward(config.dim, config.ff_mult)

    def forward(
        self, x: torch.Tensor, temb: torch.Tensor, bias: torch.Tensor, keep: torch.Tensor, rope: tuple
    ) -> torch.Tensor:
        """x: [B, T, D]; temb: [B, D]; keep: [B, T, 1] (the official output masking) -> [B, T, D]."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(temb)
        attended = self.attn(_modulate(x, shift_msa, scale_msa), bias, *rope) * keep  # [B, T, D]
        x = x + gate_msa * attended  # [B, T, D]
        return x + gate_mlp * self.ff(_modulate(x, shift_mlp, scale_mlp))  # [B, T, D]


class DiT(CFMEstimator):
    """The v3 estimator: ``forward(x, mask, mu, t, spks, cond) -> velocity [B, 80, T]``.

    State-dict keys equal the official ones under ``decoder.estimator.``.
    """

    def __init__(self, config: DiTConfig, streaming: bool = False):
        super().__init__(config, streaming)
        self.time_embed = _TimestepEmbedding(config.dim, config.time_freq_dim)
        self.input_embed = _InputEmbedding(config)
        self.rotary_embed = _RotaryEmbedding(config.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(config) for _ in range(config.depth))
        self.norm_out = _AdaLayerNorm(config.dim, 2)
        self.proj_out = nn.Linear(config.dim, config.mel_dim)

    def velocity(
        self, x: Tensor, mask: Tensor, mu: Tensor, t: Tensor, spks: Tensor, cond: Tensor, chunked: bool
    ) -> Tensor:
        temb = self.time_embed(t)  # temb: [B, D]
        h = self.input_embed(x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks)  # [B, T, D]
        rope = rotary_tables(self.rotary_embed.inv_freq, h.shape[1])  # cos, sin: [T, Dh]
        bias = estimator_attention_bias(mask, self.config.static_chunk_size, chunked)  # [B, 1, T, T]
        # The official processor zeroes outputs where the last query row's mask is False: that row
        # sees every key in both modes, so this is the key-padding mask.
        keep = mask.transpose(1, 2)  # keep: [B, T, 1]
        for block in self.transformer_blocks:
            h = block(h, temb, bias, keep, rope)  # [B, T, D]
        scale, shift = self.norm_out(temb)  # each [B, 1, D]
        return self.proj_out(_modulate(h, shift, scale)).transpose(1, 2)  # [B, 80, T]
