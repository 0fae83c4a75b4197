"""CosyVoice3 speech LLM (official ``CosyVoice3LM``): the CosyVoice2 Qwen2 backbone with v3 heads.

Differences from ``Qwen2LM`` (docs/cosyvoice-spec §3.7): no ``llm_embedding``; ``speech_embedding``
and ``llm_decoder`` have ``speech_token_size + 200`` rows (6761) and the decoder has no bias; sos
and task_id are the ``speech_embedding`` rows 6561 and 6563. The exported graph is the CosyVoice2
``LLMGraph`` unchanged (same ``LLM`` contract); only the host tables differ, and they are laid out
so that the CosyVoice2 ``LLMStage`` runs v3 as is (``llm_embedding`` = [sos row, task row]).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn

from ....builder.modules.llm import LLMGraph, load_speech_lm
from ....builder.modules.qwen2 import Qwen2Encoder
from ....config import LLMConfig
from ..config import V3_SOS_OFFSET, V3_TASK_OFFSET

__all__ = ["CosyVoice3LM", "load_llm_v3", "embedding_tables_v3", "LLMGraph"]


class CosyVoice3LM(nn.Module):
    """Weights of the official ``CosyVoice3LM`` (``llm.pt`` loads strictly, minus ``lm_head``).

    ``LLMGraph(CosyVoice3LM(...))`` is the exported graph: it only reads ``llm.decoder`` and
    ``llm_decoder``, which have the same roles as in CosyVoice2.
    """

    def __init__(self, config: LLMConfig):
        super().__init__()
        self.config = config
        width = config.llm_input_size
        self.llm = Qwen2Encoder(config.qwen)
        self.speech_embedding = nn.Embedding(config.speech_vocab_size, width)  # [6761, D]
        self.llm_decoder = nn.Linear(config.qwen.hidden_size, config.speech_vocab_size, bias=False)


def load_llm_v3(model_dir: Path, config: LLMConfig) -> CosyVoice3LM:
    """Build ``CosyVoice3LM`` from ``config`` and load ``<model_dir>/llm.pt`` strictly."""
    return load_speech_lm(model_dir, CosyVoice3LM(config))


def embedding_tables_v3(model: CosyVoice3LM) -> dict[str, np.ndarray]:
    """Host lookup tables in the CosyVoice2 layout, float32.

    ``text_embedding`` (vocab, D), ``speech_embedding`` (6761, D) and ``llm_embedding`` (2, D) =
    ``speech_embedding`` rows [sos 6561, task_id 6563], so ``LLMStage.build_inputs`` produces the
    official v3 sequence ``[sos, text, task, prompt_speech]``.
    """
    speech = model.speech_embedding.weight.detach().cpu().float().numpy().copy()  # [V, D]
    base = model.config.speech_token_size
    rows = [base + V3_SOS_OFFSET, base + V3_TASK_OFFSET]
    return {
        "text_embedding": model.llm.decoder.embed_tokens.weight.detach().cpu().float().numpy().copy(),
        "speech_embedding": speech,
        "llm_embedding": speech[rows].copy(),  # [2, D]
    }
