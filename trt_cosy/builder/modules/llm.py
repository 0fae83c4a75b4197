"""CosyVoice2 speech LLM (official ``Qwen2LM``): Qwen2 backbone + speech embedding and head.

``CosyVoice2LM`` holds the weights under the official key names. ``LLMGraph`` is the exported
graph (contract ``trt_cosy.runtime.graphs.LLM``): embeddings in, speech logits + final hidden
states + KV cache out. Embedding lookups are done on the host from ``embedding_tables``, so the
text embedding table never enters the graph and the tied text ``lm_head`` is never computed.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TypeVar

import numpy as np
from torch import Tensor, nn

from ...config import LLMConfig
from ..checkpoint import load_checkpoint
from .qwen2 import Qwen2Encoder, decode_layers

__all__ = ["CosyVoice2LM", "LLMGraph", "load_llm", "load_speech_lm", "embedding_tables"]

_LOGGER = logging.getLogger(__name__)
_UNUSED_KEYS = ("llm.model.lm_head.weight",)  # tied to embed_tokens; the text head is never used
_LLM_FILE = "llm.pt"

LM = TypeVar("LM", bound=nn.Module)


class CosyVoice2LM(nn.Module):
    """Weights of the official ``Qwen2LM`` (``llm.pt`` loads strictly, minus ``lm_head``)."""

    def __init__(self, config: LLMConfig):
        super().__init__()
        self.config = config
        width = config.llm_input_size
        self.llm_embedding = nn.Embedding(2, width)  # row 0 = sos, row 1 = task_id
        self.llm = Qwen2Encoder(config.qwen)
        self.speech_embedding = nn.Embedding(config.speech_vocab_size, width)
        self.llm_decoder = nn.Linear(config.qwen.hidden_size, config.speech_vocab_size, bias=True)


class LLMGraph(nn.Module):
    """The LLM graph: ``(inputs_embeds, past_keys, past_values) -> (logits, hidden, present_*)``.

    Holds only the decoder layers, the final norm and ``llm_decoder`` (no embedding tables).
    New positions are P..P+T-1 with P = ``past_keys.shape[3]``; they attend causally among
    themselves and fully to the past. P = 0 (zero-length past tensors) is the prefill.
    """

    def __init__(self, model: CosyVoice2LM):
        super().__init__()
        decoder = model.llm.decoder
        self.layers = decoder.layers
        self.norm = decoder.norm
        self.rotary = decoder.rotary
        self.llm_decoder = model.llm_decoder

    def forward(
        self, inputs_embeds: Tensor, past_keys: Tensor, past_values: Tensor
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        hidden, present_keys, present_values = decode_layers(
            self.layers, self.norm, self.rotary, inputs_embeds, past_keys, past_values
        )  # hidden: [1, T, D], present_*: [L, 1, H, P+T, Dh]
        logits = self.llm_decoder(hidden)  # logits: [1, T, V]
        return logits, hidden, present_keys, present_values


def load_speech_lm(model_dir: Path, model: LM) -> LM:
    """``model`` (a speech LLM on the Qwen2 backbone: CosyVoice2 or CosyVoice3) with
    ``<model_dir>/llm.pt`` loaded strictly, minus the tied text head."""
    path = Path(model_dir) / _LLM_FILE

    def drop_unused(state: dict[str, Tensor]) -> dict[str, Tensor]:
        for key in _UNUSED_KEYS:
            if state.pop(key, None) is not None:
                _LOGGER.debug("dropped %s from %s (tied text head, never used)", key, path)
        return state

    return load_checkpoint(model, path, drop_unused)


def load_llm(model_dir: Path, config: LLMConfig) -> CosyVoice2LM:
    """Build ``CosyVoice2LM`` from ``config`` and load ``<model_dir>/llm.pt`` strictly."""
    return load_speech_lm(model_dir, CosyVoice2LM(config))


def embedding_tables(model: CosyVoice2LM) -> dict[str, np.ndarray]:
    """The host-side lookup tables, float32: text (vocab, D), speech (V, D), sos/task (2, D)."""
    tables = {
        "text_embedding": model.llm.decoder.embed_tokens.weight,
        "speech_embedding": model.speech_embedding.weight,
        "llm_embedding": model.llm_embedding.weight,
    }
    return {name: weight.detach().cpu().float().numpy().copy() for name, weight in tables.items()}
