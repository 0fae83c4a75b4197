"""Qwen2 decoder, the CosyVoice2 LLM backbone, with the KV cache as explicit inputs and outputs.

Numerics follow transformers' ``Qwen2Model`` (4.51): RMSNorm with ``rms_norm_eps``, rotary
embeddings with ``rope_theta`` in the ``rotate_half`` convention (the two halves of each head
are the pair), grouped-query attention (``num_kv_heads`` < ``num_heads``), q/k/v projections
with bias, o_proj without, SiLU-gated MLP, final RMSNorm. Keys are cached *after* RoPE.

Module nesting mirrors the official ``Qwen2Encoder -> Qwen2ForCausalLM -> Qwen2Model`` so the
official state_dict keys (``llm.model.model.layers.N...``) load unchanged.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from ...config import QwenConfig

__all__ = [
    "RMSNorm",
    "RotaryEmbedding",
    "Qwen2Attention",
    "Qwen2MLP",
    "Qwen2DecoderLayer",
    "Qwen2Model",
    "Qwen2Encoder",
    "decode_layers",
]

_LOGGER = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        variance = x.pow(2).mean(dim=-1, keepdim=True)  # variance: [B, T, 1]
        return self.weight * (x * torch.rsqrt(variance + self.eps))  # [B, T, D]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions ``start .. start+length-1``."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [Dh/2]
        inv_freq = 1.0 / (theta**exponent)  # inv_freq: [Dh/2]
        # Not in the checkpoint: recomputed from the config, as transformers does.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, start: int | torch.SymInt, length: int | torch.SymInt) -> tuple[Tensor, Tensor]:
        positions = torch.arange(length, device=self.inv_freq.device).float() + start  # [T]
        freqs = positions[:, None] * self.inv_freq[None, :]  # freqs: [T, Dh/2]
        angles = torch.cat([freqs, freqs], dim=-1)  # angles: [T, Dh]
        return angles.cos(), angles.sin()


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # [..., Dh]


def _apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + _rotate_half(x) * sin  # x: [B, H, T, Dh], cos/sin: [T, Dh]


def causal_mask(past_len: int | torch.SymInt, new_len: int | torch.SymInt, device: torch.device) -> Tensor:
    """True where new query i (position past_len+i) may attend key j: ``j <= past_len + i``."""
    query_pos = torch.arange(new_len, device=device) + past_len  # [T]
    key_pos = torch.arange(past_len + new_len, device=device)  # [P+T]
    return key_pos[None, :] <= query_pos[:, None]  # mask: [T, P+T]


class Qwen2Attention(nn.Module):
    def __init__(self, config: QwenConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past_k: Tensor, past_v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        batch, new_len, _ = x.shape
        kv_heads, head_dim = self.num_kv_heads, self.head_dim
        group = self.num_heads // kv_heads
        q = self.q_proj(x).view(batch, new_len, self.num_heads, head_dim).transpose(1, 2)  # q: [B, Hq, T, Dh]
        k = self.k_proj(x).view(batch, new_len, kv_heads, head_dim).transpose(1, 2)  # k: [B, H, T, Dh]
        v = self.v_proj(x).view(batch, new_len, kv_heads, head_dim).transpose(1, 2)  # v: [B, H, T, Dh]
        q = _apply_rope(q, cos, sin)
        k = _apply_rope(k, cos, sin)
        keys = torch.cat([past_k, k], dim=2)  # keys: [B, H, P+T, Dh]
        values = torch.cat([past_v, v], dim=2)  # values: [B, H, P+T, Dh]
        # GQA without repeating the cache: query head h uses kv head h // group (HF repeat_kv order).
        q = q.reshape(batch, kv_heads, group, new_len, head_dim)  # q: [B, H, G, T, Dh]
        scores = torch.matmul(q, keys[:, :, None].transpose(-1, -2)) * (head_dim**-0.5)  # [B, H, G, T, P+T]
        scores = scores.masked_fill(~mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # weights: [B, H, G, T, P+T]
        out = torch.matmul(weights, values[:, :, None])  # out: [B, H, G, T, Dh]
        out = out.reshape(batch, self.num_heads, new_len, head_dim).transpose(1, 2)  # out: [B, T, Hq, Dh]
        out = self.o_proj(out.reshape(batch, new_len, self.num_heads * head_dim))  # out: [B, T, D]
        return out, keys, values


class Qwen2MLP(nn.Module):
    def __init__(self, config: QwenConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gated = nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)  # gated: [B, T, F]
        return self.down_proj(gated)  # [B, T, D]


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: QwenConfig):
        super().__init__()
        self.self_attn = Qwen2Attention(config)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, past_k: Tensor, past_v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        attn, keys, values = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        x = x + attn  # x: [B, T, D]
        x = x + self.mlp(self.post_attention_layernorm(x))  # x: [B, T, D]
        return x, keys, values


def decode_layers(
    layers: nn.ModuleList,
    norm: RMSNorm,
    rotary: RotaryEmbedding,
    inputs_embeds: Tensor,
    past_keys: Tensor,
    past_values: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Run the decoder stack on new positions P..P+T-1 given the cache of the first P.

    Args:
        inputs_embeds: [B, T, D] embeddings of the new positions.
        past_keys, past_values: [L, B, H, P, Dh] (P may be 0).

    Returns:
        (final-RMSNorm hidden [B, T, D], present_keys [L, B, H, P+T, Dh], present_values).
    """
    past_len = past_keys.shape[3]
    new_len = inputs_embeds.shape[1]
    cos, sin = rotary(past_len, new_len)  # cos, sin: [T, Dh]
    mask = causal_mask(past_len, new_len, inputs_embeds.device)  # mask: [T, P+T]
    hidden = inputs_embeds  # hidden: [B, T, D]
    present_keys, present_values = [], []
    for index, layer in enumerate(layers):
        hidden, keys, values = layer(hidden, cos, sin, mask, past_keys[index], past_values[index])
        present_keys.append(keys)  # keys: [B, H, P+T, Dh]
        present_values.append(values)
    return norm(hidden), torch.stack(present_keys), torch.stack(present_values)


class Qwen2Model(nn.Module):
    """``embed_tokens`` + decoder layers + final ``norm`` (HF ``Qwen2Model`` key names)."""

    def __init__(self, config: QwenConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta)

    def forward(
        self, inputs_embeds: Tensor, past_keys: Tensor, past_values: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        return decode_layers(self.layers, self.norm, self.rotary, inputs_embeds, past_keys, past_values)


class _CausalLMShell(nn.Module):
    """Stands for HF ``Qwen2ForCausalLM``: only its ``.model``; the tied text ``lm_head`` is unused."""

    def __init__(self, config: QwenConfig):
        super().__init__()
        self.model = Qwen2Model(config)


class Qwen2Encoder(nn.Module):
    """Stands for the official ``Qwen2Encoder``: ``self.model.model`` is the decoder."""

    def __init__(self, config: QwenConfig):
        super().__init__()
        self.model = _CausalLMShell(config)

    @property
    def decoder(self) -> Qwen2Model:
        return self.model.model

    def forward(
        self, inputs_embeds: Tensor, past_keys: Tensor, past_values: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        return self.decoder(inputs_embeds, past_keys, past_values)
