"""CosyVoice 1 speech LLM (official ``TransformerLM``) as torch modules, and its exportable graphs.

Structure (docs/cosyvoice-spec §3.6): ``text_embedding`` → causal Conformer text encoder (chunk 1)
→ ``text_encoder_affine_layer``; ``spk_embed_affine_layer`` on the L2-normalised speaker embedding;
a transformer LM (``linear_legacy`` input: Linear + LayerNorm + ReLU, ·√d; ESPnet relative-position
self-attention; ReLU FFN; pre-norm) with ``llm_decoder`` over 4096 tokens + eos. Attribute names
are the ``llm.pt`` keys.

* ``TextEncoderGraph`` follows ``graphs_v1.V1_TEXT_ENCODER``.
* ``TransformerLMGraph`` follows ``graphs.LLM``: new positions P..P+T-1 attend causally among
  themselves and fully to the cached keys/values of the first P. The relative positional term is
  computed for exactly the needed distances (P+T-1 down to -(T-1)) and re-associated as
  ``((q + pos_bias_v) · W_pos) · tableᵀ`` per head, so a one-token decode step costs O(D·(P+T))
  per head instead of the official O((P+T)·D²) projection of the whole positional table.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ....builder.checkpoint import load_checkpoint
from ....builder.modules.flow_encoder import (
    ConformerLayer,
    LinearEmbed,
    PositionwiseFeedForward,
    RelPositionAttention,
    rel_position_table,
)
from ....builder.modules.qwen2 import causal_mask
from ..config import V1EncoderConfig, V1LLMConfig

__all__ = [
    "ConformerEncoder",
    "LegacyLinearEmbed",
    "CachedRelAttention",
    "TransformerLayer",
    "TransformerEncoder",
    "TransformerLMV1",
    "TextEncoderGraph",
    "TransformerLMGraph",
    "load_llm_v1",
    "embedding_tables_v1",
]

_LOGGER = logging.getLogger(__name__)
_LLM_FILE = "llm.pt"
_EMBED_LN_EPS = 1e-5  # LegacyLinearNoSubsampling LayerNorm and after_norm
_LAYER_LN_EPS = 1e-12  # TransformerEncoderLayer norm1 / norm2


class ConformerEncoder(nn.Module):
    """WeNet ``ConformerEncoder`` without conv module or macaron FFN (``LinearEmbed`` input).

    ``causal=True`` is the official ``static_chunk_size: 1`` (every position sees itself and the
    past: the LLM text encoder); ``causal=False`` is full attention (the v1 flow encoder).
    """

    def __init__(self, config: V1EncoderConfig, causal: bool):
        super().__init__()
        dim = config.output_size
        self.causal = causal
        self.dim = dim
        self.embed = LinearEmbed(config.input_size, dim)
        self.encoders = nn.ModuleList(
            ConformerLayer(dim, config.attention_heads, config.linear_units) for _ in range(config.num_blocks)
        )
        self.after_norm = nn.LayerNorm(dim, eps=_EMBED_LN_EPS)

    def forward(self, x: Tensor) -> Tensor:
        """x: [B, T, input_size] -> [B, T, D]."""
        length = x.shape[1]
        h = self.embed(x)  # h: [B, T, D]
        pos_table = rel_position_table(length, self.dim)  # [1, 2T-1, D]
        if self.causal:
            mask = causal_mask(0, length, x.device).unsqueeze(0)  # [1, T, T]
        else:
            mask = torch.ones(1, length, length, dtype=torch.bool, device=x.device)  # [1, T, T]
        for layer in self.encoders:
            h = layer(h, mask, pos_table)  # h: [B, T, D]
        return self.after_norm(h)  # [B, T, D]


class LegacyLinearEmbed(nn.Module):
    """``LegacyLinearNoSubsampling`` + the rel-pos ·√d scaling: ``ReLU(LN(Wx + b)) · √d``.

    Keys ``out.0`` (Linear), ``out.1`` (LayerNorm); slots 2 (dropout) and 3 (ReLU) have no weights.
    """

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.out = nn.Sequential(
            nn.Linear(in_dim, out_dim), nn.LayerNorm(out_dim, eps=_EMBED_LN_EPS), nn.Identity(), nn.ReLU()
        )
        self.scale = math.sqrt(out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x) * self.scale  # x: [B, T, D]


def _shift_relative(scores: Tensor, keys: int | torch.SymInt) -> Tensor:
    """[B, H, T, K+T-1] scores against distances K-1 .. -(T-1) -> [B, H, T, K].

    ``out[i, j] = scores[i, T-1-i+j]`` (query i sits at position K-T+i, key j at distance K-T+i-j):
    the pad-and-reshape trick of ``rel_shift`` generalised to a KV cache (T = K is the square case,
    T = 1 keeps the first K columns, which is what the official shift does for one query).
    """
    batch, heads, length, width = scores.shape
    zeros = scores.new_zeros(batch, heads, length, 1)  # [B, H, T, 1]
    padded = torch.cat((zeros, scores), dim=-1).reshape(batch, heads, width + 1, length)  # [B, H, W+1, T]
    shifted = padded[:, :, 1:].reshape(batch, heads, length, width)  # [B, H, T, W]
    return shifted[:, :, :, :keys]  # [B, H, T, K]


class CachedRelAttention(RelPositionAttention):
    """``RelPositionMultiHeadedAttention`` with an explicit KV cache (same keys as the base class)."""

    def forward_cached(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, pos_table: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x: [B, T, D]; past_k/v: [B, H, P, Dh]; pos_table: [1, P+2T-1, D] (distances P+T-1 ..
        -(T-1)); mask: [T, P+T] bool -> (out [B, T, D], keys, values [B, H, P+T, Dh])."""
        batch, length, _ = x.shape
        q = self._split(self.linear_q(x))  # q: [B, T, H, Dh]
        keys = torch.cat((past_k, self._split(self.linear_k(x)).transpose(1, 2)), dim=2)  # [B, H, K, Dh]
        values = torch.cat((past_v, self._split(self.linear_v(x)).transpose(1, 2)), dim=2)  # [B, H, K, Dh]
        q_u = (q + self.pos_bias_u).transpose(1, 2)  # [B, H, T, Dh]
        q_v = (q + self.pos_bias_v).transpose(1, 2)  # [B, H, T, Dh]
        content = torch.matmul(q_u, keys.transpose(-2, -1))  # [B, H, T, K]
        w_pos = self.linear_pos.weight.reshape(self.heads, self.head_dim, -1)  # [H, Dh, D]
        q_pos = torch.matmul(q_v, w_pos)  # [B, H, T, D]
        position = torch.matmul(q_pos, pos_table.transpose(1, 2).unsqueeze(1))  # [B, H, T, K+T-1]
        position = _shift_relative(position, keys.shape[2])  # [B, H, T, K]
        scores = (content + position) / math.sqrt(self.head_dim)  # [B, H, T, K]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)  # every row keeps its diagonal
        weights = torch.softmax(scores, dim=-1)  # [B, H, T, K]
        out = torch.matmul(weights, values).transpose(1, 2)  # [B, T, H, Dh]
        return self.linear_out(out.reshape(batch, length, -1)), keys, values  # [B, T, D]


class TransformerLayer(nn.Module):
    """Pre-norm ``TransformerEncoderLayer`` (rel-pos attention, ReLU FFN): keys norm1, norm2."""

    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.self_attn = CachedRelAttention(dim, heads)
        self.feed_forward = PositionwiseFeedForward(dim, hidden, F.relu)
        self.norm1 = nn.LayerNorm(dim, eps=_LAYER_LN_EPS)
        self.norm2 = nn.LayerNorm(dim, eps=_LAYER_LN_EPS)

    def forward(
        self, x: Tensor, past_k: Tensor, past_v: Tensor, pos_table: Tensor, mask: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        attn, keys, values = self.self_attn.forward_cached(self.norm1(x), past_k, past_v, pos_table, mask)
        x = x + attn  # x: [B, T, D]
        return x + self.feed_forward(self.norm2(x)), keys, values


class TransformerEncoder(nn.Module):
    """The LM body (official ``TransformerEncoder`` with ``linear_legacy`` input), KV-cached."""

    def __init__(self, config: V1EncoderConfig):
        super().__init__()
        dim = config.output_size
        self.dim = dim
        self.embed = LegacyLinearEmbed(config.input_size, dim)
        self.encoders = nn.ModuleList(
            TransformerLayer(dim, config.attention_heads, config.linear_units)
            for _ in range(config.num_blocks)
        )
        self.after_norm = nn.LayerNorm(dim, eps=_EMBED_LN_EPS)

    def forward(self, x: Tensor, past_keys: Tensor, past_values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [B, T, D_in]; past_*: [L, B, H, P, Dh] -> (hidden [B, T, D], present_* [L, B, H, P+T, Dh])."""
        past_len = past_keys.shape[3]
        length = x.shape[1]
        keys_len = past_len + length
        # Distances K-1 .. -(T-1): the first K+T-1 rows of the table for K positions.
        pos_table = rel_position_table(keys_len, self.dim)[:, : keys_len + length - 1]  # [1, K+T-1, D]
        mask = causal_mask(past_len, length, x.device)  # [T, K]
        h = self.embed(x)  # h: [B, T, D]
        present_keys, present_values = [], []
        for index, layer in enumerate(self.encoders):
            h, keys, values = layer(h, past_keys[index], past_values[index], pos_table, mask)
            present_keys.append(keys)  # keys: [B, H, K, Dh]
            present_values.append(values)
        return self.after_norm(h), torch.stack(present_keys), torch.stack(present_values)


class TransformerLMV1(nn.Module):
    """Weights of the official ``TransformerLM`` (``llm.pt`` loads strictly)."""

    def __init__(self, config: V1LLMConfig):
        super().__init__()
        self.config = config
        width = config.llm_input_size
        self.text_embedding = nn.Embedding(config.text_token_size, config.text_encoder_input_size)
        self.text_encoder = ConformerEncoder(
            config.text_encoder, causal=config.text_encoder.static_chunk_size > 0
        )
        self.text_encoder_affine_layer = nn.Linear(config.text_encoder.output_size, width)
        self.llm_embedding = nn.Embedding(2, width)  # row 0 = sos, row 1 = task_id
        self.llm = TransformerEncoder(config.llm)
        self.llm_decoder = nn.Linear(config.llm_output_size, config.speech_vocab_size)
        self.speech_embedding = nn.Embedding(config.speech_token_size, width)
        self.spk_embed_affine_layer = nn.Linear(config.spk_embed_dim, width)


class TextEncoderGraph(nn.Module):
    """Contract ``V1_TEXT_ENCODER``: (text_embeds, embedding) -> (text_enc, spk)."""

    def __init__(self, model: TransformerLMV1):
        super().__init__()
        self.text_encoder = model.text_encoder
        self.text_encoder_affine_layer = model.text_encoder_affine_layer
        self.spk_embed_affine_layer = model.spk_embed_affine_layer

    def forward(self, text_embeds: Tensor, embedding: Tensor) -> tuple[Tensor, Tensor]:
        text_enc = self.text_encoder_affine_layer(self.text_encoder(text_embeds))  # [1, N, D]
        spk = self.spk_embed_affine_layer(F.normalize(embedding, dim=1))  # [1, D]
        return text_enc, spk


class TransformerLMGraph(nn.Module):
    """Contract ``LLM``: (inputs_embeds, past_keys, past_values) -> (logits, hidden, present_*)."""

    def __init__(self, model: TransformerLMV1):
        super().__init__()
        self.llm = model.llm
        self.llm_decoder = model.llm_decoder

    def forward(
        self, inputs_embeds: Tensor, past_keys: Tensor, past_values: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        hidden, present_keys, present_values = self.llm(inputs_embeds, past_keys, past_values)  # [1, T, D]
        return self.llm_decoder(hidden), hidden, present_keys, present_values  # logits: [1, T, 4097]


def load_llm_v1(model_dir: Path, config: V1LLMConfig) -> TransformerLMV1:
    """Build ``TransformerLMV1`` from ``config`` and load ``<model_dir>/llm.pt`` strictly."""
    path = Path(model_dir) / _LLM_FILE
    model = load_checkpoint(TransformerLMV1(config), path)
    _LOGGER.debug("v1 LLM loaded from %s", path)
    return model


def embedding_tables_v1(model: TransformerLMV1) -> dict[str, np.ndarray]:
    """Host lookup tables, float32: text (vocab, E), speech (4096, D), sos/task (2, D)."""
    tables = {
        "text_embedding": model.text_embedding.weight,
        "speech_embedding": model.speech_embedding.weight,
        "llm_embedding": model.llm_embedding.weight,
    }
    return {name: weight.detach().cpu().float().numpy().copy() for name, weight in tables.items()}
