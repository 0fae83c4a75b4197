"""The CosyVoice2 estimator over new frames only, with what earlier chunks left behind as inputs.

With the 50-frame chunk mask the estimator is chunk-causal: attention lets a frame see its own and
earlier chunks, every convolution is causal (kernel 3, left padding) or 1×1, LayerNorms work per
frame and nothing else mixes frames. The official streaming schedule keeps chunk boundaries
aligned and the CFM noise fixed, so every Euler step of a later call reproduces the completed frames
of an earlier call. ``IncrementalEstimatorGraph`` therefore runs one Euler step on the T new
frames only (contract ``graphs.FLOW_ESTIMATOR_INCREMENTAL``) given, for the P completed frames:

* ``past_blocks`` [P, L, 2, D]: per transformer block (L of them), per CFG row, the block's
  normalised input ``norm1(h)`` (float32: float16 storage already moves the mel by 3e-4, above
  the golden 2e-4). Keys and values of the completed frames are recomputed from it (``to_k`` /
  ``to_v``): D = 256 numbers per frame and block instead of the 2·512 of keys and values;
* ``past_tails`` [2, C, 2]: the last two input frames of every causal convolution (zeros at the
  start: the convolution's own left padding).

It returns the velocity of the new frames, their ``new_blocks`` [T, L, 2, D] and the updated
``new_tails``. P must be a multiple of the chunk size (50) and the mask all ones: the runtime
(``trt_cosy.stages.flow_incremental``) only calls it so.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .flow_estimator import (
    _MASK_BIAS,
    CausalConditionalDecoder,
    CausalResnetBlock1D,
    TransformerBlock,
    sinusoidal_embedding,
)

__all__ = ["IncrementalEstimatorGraph", "incremental_cache_layout", "chunk_attention_bias"]

_LOGGER = logging.getLogger(__name__)

_TAIL = 2  # causal kernel 3 - 1: input frames a causal convolution needs from before its chunk


def _causal_convs(estimator: CausalConditionalDecoder) -> list[nn.Conv1d]:
    """Every causal convolution in the order the forward runs them."""
    convs: list[nn.Conv1d] = []

    def resnet(block: CausalResnetBlock1D) -> None:
        convs.extend((block.block1.block[0], block.block2.block[0]))

    resnet_down, _, conv_down = estimator.down_blocks[0]
    resnet(resnet_down)
    convs.append(conv_down)
    for resnet_mid, _ in estimator.mid_blocks:
        resnet(resnet_mid)
    resnet_up, _, conv_up = estimator.up_blocks[0]
    resnet(resnet_up)
    convs.extend((conv_up, estimator.final_block.block[0]))
    return convs


def incremental_cache_layout(estimator: CausalConditionalDecoder) -> tuple[int, int, int]:
    """(transformer blocks L, block width D, summed causal-convolution input channels C)."""
    blocks = len(estimator.down_blocks[0][1]) + len(estimator.up_blocks[0][1])
    blocks += sum(len(stage[1]) for stage in estimator.mid_blocks)
    channels = sum(conv.in_channels for conv in _causal_convs(estimator))
    return blocks, estimator.config.channels[0], channels


class IncrementalEstimatorGraph(nn.Module):
    """Contract ``FLOW_ESTIMATOR_INCREMENTAL``: one chunk-attention Euler step on new frames only.

    Args:
        estimator: the loaded ``CausalConditionalDecoder`` (weights shared, not copied).
        cache_dtype: how ``new_blocks`` is returned (float32: float16 drifts the tiny golden model's
            mel by 3e-4 over the 10 Euler steps, above the golden 2e-4).
    """

    def __init__(self, estimator: CausalConditionalDecoder, cache_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.estimator = estimator
        self.cache_dtype = cache_dtype
        self.chunk = estimator.config.static_chunk_size
        self._convs = _causal_convs(estimator)

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
        past_tails: [2, C, 2] -> (estimator_out [2, 80, T], new_blocks [T, L, 2, D], new_tails [2, C, 2])."""
        est = self.estimator
        run = _Run(self, past_blocks, past_tails)
        temb = est.time_mlp(sinusoidal_embedding(t, est.config.in_channels).to(t.dtype))  # [2, 4W]
        frames = x.shape[-1]
        speaker = spks.unsqueeze(-1).expand(spks.shape[0], spks.shape[1], frames)  # [2, 80, T]
        h = torch.cat((x, mu, speaker, cond), dim=1)  # [2, in_channels, T]

        resnet, blocks, conv = est.down_blocks[0]
        h = run.transformers(run.resnet(resnet, h, temb), blocks)  # [2, W, T]
        skip = h
        h = run.conv(conv, h)  # [2, W, T]
        for resnet, blocks in est.mid_blocks:
            h = run.transformers(run.resnet(resnet, h, temb), blocks)  # [2, W, T]
        resnet, blocks, conv = est.up_blocks[0]
        h = torch.cat((h, skip), dim=1)  # [2, 2W, T]
        h = run.transformers(run.resnet(resnet, h, temb), blocks)  # [2, W, T]
        h = run.conv(conv, h)  # [2, W, T]
        h = run.causal_block(est.final_block, h)  # [2, W, T]
        out = est.final_proj(h)  # [2, 80, T]
        new_blocks = torch.stack(run.blocks_out, dim=0).permute(2, 0, 1, 3)  # [T, L, 2, D]
        new_tails = torch.cat(run.tails_out, dim=1)  # [2, C, 2]
        return out, new_blocks.to(self.cache_dtype), new_tails


class _Run:
    """The state of one forward: cursors into the caches and the pieces of the new ones."""

    def __init__(self, graph: IncrementalEstimatorGraph, past_blocks: torch.Tensor, past_tails: torch.Tensor):
        self.graph = graph
        self.past_blocks = past_blocks  # [P, L, 2, D], cache dtype
        self.past_tails = past_tails  # [2, C, 2]
        self.blocks_out: list[torch.Tensor] = []  # per block [2, T, D]
        self.tails_out: list[torch.Tensor] = []  # per conv [2, Ci, 2]
        self._conv_index = 0
        self._channel = 0

    def conv(self, conv: nn.Conv1d, h: torch.Tensor) -> torch.Tensor:
        """A causal convolution whose left context is the stored tail: [2, Ci, T] -> [2, Co, T]."""
        expected = self.graph._convs[self._conv_index]
        assert conv is expected, "causal convolutions must run in the order of _causal_convs"
        self._conv_index += 1
        channels = conv.in_channels
        tail = self.past_tails[:, self._channel : self._channel + channels, :]  # [2, Ci, 2]
        self._channel += channels
        full = torch.cat((tail, h), dim=2)  # [2, Ci, 2 + T]
        self.tails_out.append(full[:, :, -_TAIL:])
        return F.conv1d(full, conv.weight, conv.bias)  # [2, Co, T]

    def causal_block(self, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """``CausalBlock1D`` with an all-ones mask: conv (with tail) -> LayerNorm -> Mish."""
        return block.block[1:](self.conv(block.block[0], h))

    def resnet(self, block: CausalResnetBlock1D, h: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        a = self.causal_block(block.block1, h) + block.mlp(temb).unsqueeze(-1)  # [2, W, T]
        a = self.causal_block(block.block2, a)  # [2, W, T]
        return a + block.res_conv(h)  # [2, W, T]

    def transformers(self, h: torch.Tensor, blocks: nn.ModuleList) -> torch.Tensor:
        h = h.transpose(1, 2)  # [2, T, W]
        for block in blocks:
            h = self._transformer(block, h)
        return h.transpose(1, 2)  # [2, W, T]

    def _transformer(self, block: TransformerBlock, h: torch.Tensor) -> torch.Tensor:
        layer = len(self.blocks_out)
        normed = block.norm1(h)  # [2, T, D]
        self.blocks_out.append(normed)
        past = self.past_blocks[:, layer].transpose(0, 1).to(normed.dtype)  # [2, P, D]
        keys_in = torch.cat((past, normed), dim=1)  # [2, P + T, D]
        attn = block.attn1
        q = attn._split(attn.to_q(normed))  # [2, H, T, Dh]
        k, v = attn._split(attn.to_k(keys_in)), attn._split(attn.to_v(keys_in))  # [2, H, P + T, Dh]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._bias(past.shape[1], h.shape[1]))
        out = out.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1)  # [2, T, H·Dh]
        h = h + attn.to_out[0](out)  # [2, T, D]
        return h + block.ff(block.norm3(h))  # [2, T, D]

    def _bias(self, past: int, new: int) -> torch.Tensor:
        return chunk_attention_bias(past, new, self.graph.chunk)


def chunk_attention_bias(past: int, new: int, chunk: int) -> torch.Tensor:
    """Chunk attention of new frame i (absolute P + i, P a chunk multiple): keys < P + (i // c + 1)·c.

    Additive bias [1, 1, T, P + T] (0 or the estimators' mask bias); also the CosyVoice3 DiT's.
    """
    query = torch.arange(new)  # [T]
    limit = past + (torch.div(query, chunk, rounding_mode="floor") + 1) * chunk  # [T]
    keys = torch.arange(past + new)  # [P + T]
    allowed = keys.unsqueeze(0) < limit.unsqueeze(1)  # [T, P + T]
    return ((1.0 - allowed.to(torch.float32)) * _MASK_BIAS)[None, None]  # [1, 1, T, P + T]
