"""The CosyVoice3 DiT over new frames only (contract ``graphs_v3.FLOW_ESTIMATOR_INCREMENTAL_V3``).

With the 50-frame chunk mask the DiT is chunk-causal, checked numerically on the golden tiny model
(docs/benchmarks.md "Incremental chunk flow"): attention lets a frame see its own and earlier
chunks; the conv position embedding's two grouped ``Conv1d(k31)`` are left-padded (causal); the
input projection, AdaLayerNormZero (a per-frame LayerNorm modulated by the time embedding alone),
the FFN and the output layers work per frame; the speaker vector is the same on every frame and
the CFG rows never mix. RoPE positions are absolute, so the new frames are rotated at P .. P+T-1.
The official streaming schedule keeps chunk boundaries aligned and the CFM noise fixed, so every
Euler step of a later call reproduces the completed frames of an earlier call.

``V3IncrementalEstimatorGraph`` runs one Euler step on the T new frames given, for the P completed
frames (P a multiple of 50, the mask all ones):

* ``past_blocks`` [P, L, 2, D]: per DiT block (L = depth), per CFG row, the block's modulated
  attention input ``LayerNorm(h)·(1 + scale) + shift``; keys (rotated at positions 0 .. P-1) and
  values are recomputed from it (D numbers per frame and block instead of the 2·H·Dh of keys and
  values: half the memory, for about a quarter of a new frame's block work per cached frame);
* ``past_tails`` [2, C, 30]: the last ``kernel - 1`` = 30 input frames of each of the two conv
  position embedding convolutions (C = 2·D; zeros at the start: the convolutions' own left padding).

It returns the velocity of the new frames, their ``new_blocks`` [T, L, 2, D] and the updated
``new_tails``: the CosyVoice2 graph's contract (``builder.modules.flow_estimator_incremental``) with
the longer tails, run by the same runtime (``stages.flow_incremental``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ....builder.export import GraphPlan
from ....builder.flow_incremental import incremental_feeds_plan
from ....builder.modules.flow_estimator_incremental import chunk_attention_bias
from ..config import DiTConfig, V3ModelConfig
from .dit import DiT, DiTBlock, _modulate, apply_rotary, rotary_tables

__all__ = ["V3IncrementalEstimatorGraph", "v3_incremental_cache_layout", "v3_incremental_export_plan"]

_LOGGER = logging.getLogger(__name__)


def v3_incremental_cache_layout(config: DiTConfig) -> tuple[int, int, int, int]:
    """(DiT blocks L, width D, tail channels C = 2·D, tail frames K - 1)."""
    return config.depth, config.dim, 2 * config.dim, config.conv_pos_kernel - 1


class V3IncrementalEstimatorGraph(nn.Module):
    """Contract ``FLOW_ESTIMATOR_INCREMENTAL_V3``: one chunk-attention DiT Euler step on new frames only.

    Args:
        estimator: the loaded ``DiT`` (weights shared, not copied).
    """

    def __init__(self, estimator: DiT):
        super().__init__()
        self.estimator = estimator
        self.chunk = estimator.config.static_chunk_size
        self.tail = estimator.config.conv_pos_kernel - 1

    def forward(
        self,
        x: torch.Tensor,
        mu: torch.Tensor,
        t: torch.Tensor,
        spks: torch.Tensor,
        cond: torch.Tensor,
        past_blocks: torch.Tensor,
        past_tails: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x, mu, cond: [2, 80, T]; t: [2]; spks: [2, 80]; past_blocks: [P, L, 2, D];
        past_tails: [2, 2D, 30] -> (estimator_out [2, 80, T], new_blocks [T, L, 2, D], new_tails [2, 2D, 30])."""
        est = self.estimator
        temb = est.time_embed(t)  # temb: [2, D]
        frames = x.shape[-1]
        speaker = spks.unsqueeze(1).expand(spks.shape[0], frames, spks.shape[1])  # [2, T, 80]
        inputs = torch.cat((x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), speaker), dim=-1)
        h = est.input_embed.proj(inputs)  # h: [2, T, D]
        position, new_tails = self._conv_position(h, past_tails)  # position: [2, T, D]
        h = position + h  # [2, T, D]
        past = past_blocks.shape[0]
        cos, sin = rotary_tables(est.rotary_embed.inv_freq, past + frames)  # [P + T, Dh] each
        bias = chunk_attention_bias(past, frames, self.chunk)  # [1, 1, T, P + T]
        blocks_out = []
        for layer, block in enumerate(est.transformer_blocks):
            h, normed = self._block(block, h, temb, past_blocks[:, layer], bias, cos, sin)
            blocks_out.append(normed)  # [2, T, D]
        scale, shift = est.norm_out(temb)  # each [2, 1, D]
        out = est.proj_out(_modulate(h, shift, scale)).transpose(1, 2)  # [2, 80, T]
        new_blocks = torch.stack(blocks_out, dim=0).permute(2, 0, 1, 3)  # [T, L, 2, D]
        return out, new_blocks, new_tails

    def _conv_position(self, h: torch.Tensor, past_tails: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The causal conv position embedding with the stored tails as left context:
        h [2, T, D], past_tails [2, 2D, K-1] -> ([2, T, D], new tails [2, 2D, K-1])."""
        embed = self.estimator.input_embed.conv_pos_embed
        width = h.shape[-1]
        first = torch.cat((past_tails[:, :width], h.transpose(1, 2)), dim=2)  # [2, D, K-1 + T]
        middle = embed.conv1(first)  # conv + Mish: [2, D, T]
        second = torch.cat((past_tails[:, width:], middle), dim=2)  # [2, D, K-1 + T]
        out = embed.conv2(second)  # [2, D, T]
        tails = torch.cat((first[:, :, -self.tail :], second[:, :, -self.tail :]), dim=1)  # [2, 2D, K-1]
        return out.transpose(1, 2), tails

    @staticmethod
    def _block(
        block: DiTBlock,
        h: torch.Tensor,
        temb: torch.Tensor,
        past: torch.Tensor,
        bias: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One DiT block on the new frames: h [2, T, D], past [P, 2, D] -> (h [2, T, D], normed [2, T, D])."""
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.attn_norm(temb)  # [2, 1, D]
        normed = _modulate(h, shift_msa, scale_msa)  # [2, T, D]
        keys_in = torch.cat((past.transpose(0, 1).to(normed.dtype), normed), dim=1)  # [2, P + T, D]
        start = keys_in.shape[1] - h.shape[1]  # P: the new frames' first position
        attn = block.attn
        query = apply_rotary(attn.to_q(normed), cos[start:], sin[start:])  # [2, T, H·Dh]
        key = apply_rotary(attn.to_k(keys_in), cos, sin)  # [2, P + T, H·Dh]
        value = attn.to_v(keys_in)  # [2, P + T, H·Dh]
        out = torch.nn.functional.scaled_dot_product_attention(
            attn._split(query), attn._split(key), attn._split(value), attn_mask=bias
        )  # [2, H, T, Dh]
        attended = attn.to_out[0](out.transpose(1, 2).flatten(2))  # [2, T, D]
        h = h + gate_msa * attended  # [2, T, D]
        return h + gate_mlp * block.ff(_modulate(h, shift_mlp, scale_mlp)), normed


def v3_incremental_export_plan(config: V3ModelConfig, seed: int = 0) -> GraphPlan:
    """Sample and parity feeds (P = 0, a single new frame, T shorter than the tails included)."""
    dit = config.flow.estimator
    layout = v3_incremental_cache_layout(dit)  # tails: [2, 2D, 30]
    return incremental_feeds_plan(config.flow.output_size, layout, dit.static_chunk_size, 17, seed)
