"""The batched decode step of the Qwen2 speech LLM in plain ONNX ops, for TensorRT (contract
``runtime.llm_decode.llm_decode_spec``).

One new position per row of a batch, each row at its own length. The KV cache comes in as the
slot buffers themselves, per layer ``past_key_<i>`` / ``past_value_<i>`` [B, H, C, Dh] (C = the slot
capacity; positions at or beyond a row's length hold anything: stale rows, NaN); the graph only
reads the first P positions, P = ``key_positions``' length (0 .. P-1), and masks every position
``j >= past_lengths[b]`` of row b out of its scores *and* zeroes its keys and values first, so not
even a NaN in the padding reaches a row's result. Row b's new position is ``past_lengths[b]``
(its rotary angle and its key). Outputs: ``logits`` [B, 1, V] and the new position's keys and
values of every layer, ``new_kv`` [B, 2L, H, Dh] (keys of layers 0..L-1, then values), which the
runtime writes into each row's slot at ``past_lengths[b]`` (``runtime.backends.tensorrt.batch``).

The layers are the ``llm`` graph's own modules (``Qwen2DecoderLayer``), called with a per-row
rotary table [B, 1, 1, Dh] and a per-row mask [B, 1, 1, 1, P+1]: the same arithmetic as ``llm``.
No ONNX Runtime contrib op (``GroupQueryAttention`` is not a TensorRT op).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from .llm import LLMGraph

__all__ = ["LLMDecodeGraph", "decode_graph"]

_LOGGER = logging.getLogger(__name__)


class LLMDecodeGraph(nn.Module):
    """``(inputs_embeds, past_lengths, key_positions, past_key_0, past_value_0, ...) -> (logits, new_kv)``."""

    def __init__(self, graph: LLMGraph):
        super().__init__()
        self.layers = graph.layers
        self.norm = graph.norm
        self.rotary = graph.rotary
        self.llm_decoder = graph.llm_decoder

    def step(
        self, inputs_embeds: Tensor, past_lengths: Tensor, key_positions: Tensor, cache: tuple[Tensor, ...]
    ) -> tuple[Tensor, Tensor]:
        """cache: past_key_0, past_value_0, past_key_1, ... (each [B, H, C, Dh])."""
        window = key_positions.shape[0]  # P: cache positions read (>= every row's length)
        # Row b's new token sits at position past_lengths[b]: its own rotary angle. Index math stays
        # int32 (no int64 tensors for TensorRT beyond shapes).
        freqs = past_lengths.float()[:, None] * self.rotary.inv_freq[None, :]  # freqs: [B, Dh/2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # angles: [B, 1, 1, Dh]
        cos, sin = angles.cos(), angles.sin()
        valid = key_positions[None, :] < past_lengths[:, None]  # valid: [B, P]
        new_ok = torch.ones_like(valid[:, :1])  # the new position: always attended, [B, 1]
        mask = torch.cat([valid, new_ok], dim=1)[:, None, None, None, :]  # mask: [B, 1, 1, 1, P+1]
        keep = valid[:, None, :, None]  # keep: [B, 1, P, 1]
        hidden = inputs_embeds  # hidden: [B, 1, D]
        new_keys, new_values = [], []
        for index, layer in enumerate(self.layers):
            past_k = cache[2 * index][:, :, :window]  # past_k: [B, H, P, Dh]
            past_v = cache[2 * index + 1][:, :, :window]
            past_k = torch.where(keep, past_k, torch.zeros_like(past_k))  # padding never enters a sum
            past_v = torch.where(keep, past_v, torch.zeros_like(past_v))
            hidden, keys, values = layer(hidden, cos, sin, mask, past_k, past_v)  # keys: [B, H, P+1, Dh]
            new_keys.append(keys[:, :, window])  # [B, H, Dh]
            new_values.append(values[:, :, window])
        logits = self.llm_decoder(self.norm(hidden))  # logits: [B, 1, V]
        new_kv = torch.stack([*new_keys, *new_values], dim=1)  # new_kv: [B, 2L, H, Dh]
        return logits, new_kv


def decode_graph(graph: LLMGraph) -> LLMDecodeGraph:
    """An ``LLMDecodeGraph`` whose ``forward`` names every cache input (``past_key_0, past_value_0, ...``).

    The exporter maps graph inputs to ``forward``'s parameters one by one (a ``*cache`` parameter
    would be one nested input), so the subclass gets a ``forward`` with one parameter per tensor.
    """
    names = [f"past_{kind}_{layer}" for layer in range(len(graph.layers)) for kind in ("key", "value")]
    params = ", ".join(names)
    source = (
        f"def forward(self, inputs_embeds, past_lengths, key_positions, {params}):\n"
        f"    return self.step(inputs_embeds, past_lengths, key_positions, ({params},))\n"
    )
    namespace: dict[str, object] = {}
    exec(source, namespace)  # noqa: S102 - a fixed template over generated parameter names
    cls = type(f"LLMDecodeGraph{len(graph.layers)}", (LLMDecodeGraph,), {"forward": namespace["forward"]})
    return cls(graph)
