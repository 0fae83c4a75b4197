"""The speech-LLM stage (numpy only): embedding lookups on the host, KV-cached decode through a
runner that follows the ``LLM`` graph contract (``trt_cosy.runtime.graphs``).

Sequence layout (spec §3.2): ``[sos, text_emb(prompt_text ++ text), task, speech_emb(prompt_speech)]``.
Decode loop (spec §3.3): prefill, then one speech token per step; eos (and only eos) is masked
while fewer than ``min_len`` tokens were produced; a stop token ends the stream without being
yielded. All per-request state lives inside one ``generate`` call, so a single ``LLMStage`` can
serve many threads at once (as far as its runner allows).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from typing import Final, Protocol

import numpy as np

from ..config import LLMConfig
from ..errors import InputError, ModelDirError
from ..runtime.backends.base import Runner
from .bistream import BistreamPrompt, TextStream, bistream_program, decode_alone
from .sampling import Sampler, log_softmax

__all__ = ["LLMStage"]

_LOGGER = logging.getLogger(__name__)
_TABLES: Final = ("text_embedding", "speech_embedding", "llm_embedding")
_SOS_ROW: Final = 0
_TASK_ROW: Final = 1


class LLMStage:
    """Text ids in, speech token ids out.

    Args:
        runner: any Runner for the ``LLM`` graph (torch reference, ONNX Runtime, TensorRT).
        tables: float32 ``text_embedding`` (vocab, D), ``speech_embedding`` (V, D) and
            ``llm_embedding`` (2, D), as written by ``builder.modules.llm.embedding_tables``.
        config: the release's ``LLMConfig`` (vocab sizes, sampling and length ratios).
    """

    def __init__(self, runner: Runner, tables: Mapping[str, np.ndarray], config: LLMConfig):
        missing = [name for name in _TABLES if name not in tables]
        if missing:
            raise ModelDirError(f"LLM embedding tables {missing} are missing; rebuild with `trt-cosy build`.")
        self.runner = runner
        self.config = config
        self.text_embedding = np.asarray(tables["text_embedding"], dtype=np.float32)  # [vocab, D]
        self.speech_embedding = np.asarray(tables["speech_embedding"], dtype=np.float32)  # [V, D]
        self.llm_embedding = np.asarray(tables["llm_embedding"], dtype=np.float32)  # [2, D]
        width = config.llm_input_size
        shapes = {name: getattr(self, name).shape for name in _TABLES}
        if (
            any(len(shape) != 2 or shape[1] != width for shape in shapes.values())
            or shapes["speech_embedding"][0] != config.speech_vocab_size
            or shapes["llm_embedding"][0] != 2
        ):
            raise ModelDirError(
                f"LLM embedding tables {shapes} do not fit the model config (width {width}, "
                f"{config.speech_vocab_size} speech rows); rebuild the engines for this release."
            )

    def length_limits(self, num_text_tokens: int) -> tuple[int, int]:
        """(min_len, max_len) in speech tokens for a text of that many tokens (prompt excluded)."""
        config = self.config
        return int(num_text_tokens * config.min_token_text_ratio), int(
            num_text_tokens * config.max_token_text_ratio
        )

    def build_inputs(
        self, text_ids: np.ndarray, prompt_text_ids: np.ndarray, prompt_speech_ids: np.ndarray
    ) -> np.ndarray:
        """The prefill embeddings ``[sos, text(prompt_text ++ text), task, speech(prompt_speech)]``: [1, L, D]."""
        text = np.concatenate(
            [
                _as_ids(prompt_text_ids, "prompt_text_ids", len(self.text_embedding)),
                _as_ids(text_ids, "text_ids", len(self.text_embedding)),
            ]
        )  # text: [Nt]
        speech = _as_ids(prompt_speech_ids, "prompt_speech_ids", self.config.speech_token_size)  # [Ns]
        sequence = np.concatenate(
            [
                self.llm_embedding[_SOS_ROW : _SOS_ROW + 1],  # [1, D]
                self.text_embedding[text],  # [Nt, D]
                self.llm_embedding[_TASK_ROW : _TASK_ROW + 1],  # [1, D]
                self.speech_embedding[speech],  # [Ns, D]
            ]
        )  # sequence: [L, D]
        return sequence[None]  # [1, L, D]

    def generate(
        self,
        text_ids: np.ndarray,
        prompt_text_ids: np.ndarray,
        prompt_speech_ids: np.ndarray,
        sampler: Sampler,
        max_new_tokens: int | None = None,
    ) -> Iterator[int]:
        """Speech token ids for ``text_ids``, one at a time (lazy: decoding runs as you iterate).

        Inputs are validated at once. ``max_new_tokens`` further caps the official
        ``max_len = 20 * len(text_ids)``. ``sampler(logp, decoded) -> int`` picks each token;
        give each request its own sampler (a seeded ``RASSampler`` or ``greedy_sample``).
        """
        num_text = _as_ids(text_ids, "text_ids", len(self.text_embedding)).size
        if num_text == 0:
            raise InputError(
                "text_ids is empty: there is nothing to synthesise. Pass at least one text token."
            )
        if max_new_tokens is not None and max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0 or None, got {max_new_tokens}.")
        lm_input = self.build_inputs(text_ids, prompt_text_ids, prompt_speech_ids)  # [1, L, D]
        min_len, max_len = self.length_limits(num_text)
        if max_new_tokens is not None:
            max_len = min(max_len, max_new_tokens)
        return self._decode(lm_input, sampler, min_len, max_len)

    def generate_bistream(
        self, text: TextStream, prompt: BistreamPrompt, sampler: Sampler, max_new_tokens: int
    ) -> Iterator[int]:
        """Speech token ids while ``text`` is still arriving (official ``inference_bistream``;
        ``stages.bistream``): lazy, waits for text as the schedule needs it."""
        return decode_alone(
            self._bistream_program(text, prompt, sampler, max_new_tokens), text, self._decoder()
        )

    def _bistream_program(
        self,
        text: TextStream,
        prompt: BistreamPrompt,
        sampler: Sampler,
        max_new_tokens: int,
        max_positions: int | None = None,
    ):
        """The request's ``bistream_program`` over this stage's tables."""
        for name, ids, limit in (
            ("head_ids", prompt.head_ids, len(self.text_embedding)),
            ("prompt_text_ids", prompt.text_ids, len(self.text_embedding)),
            ("prompt_speech_ids", prompt.speech_ids, self.config.speech_token_size),
        ):
            _as_ids(ids, name, limit)
        return bistream_program(
            self.text_embedding,
            self.speech_embedding,
            self.llm_embedding[_SOS_ROW],
            self.llm_embedding[_TASK_ROW],
            prompt,
            text,
            sampler,
            max_new_tokens,
            self.config.max_token_text_ratio,
            max_positions,
        )

    def _decode(self, lm_input: np.ndarray, sampler: Sampler, min_len: int, max_len: int) -> Iterator[int]:
        eos, stop_tokens = self.config.eos_token, frozenset(self.config.stop_tokens)
        decoder = self._decoder()
        inputs = lm_input  # inputs: [1, T, D]
        decoded: list[int] = []
        started = time.perf_counter()
        try:
            for step in range(max_len):
                logp = log_softmax(decoder.step(inputs)[0, -1])  # logp: [V]
                if step < min_len:
                    logp[eos] = -np.inf
                token = int(sampler(logp, decoded))
                if token in stop_tokens:
                    break
                yield token
                decoded.append(token)
                inputs = self.speech_embedding[token][None, None]  # inputs: [1, 1, D]
        finally:
            elapsed = time.perf_counter() - started
            _LOGGER.debug(
                "llm: %d tokens in %.3f s (%.1f tokens/s, prefill %d positions)",
                len(decoded),
                elapsed,
                len(decoded) / elapsed if elapsed > 0 else 0.0,
                lm_input.shape[1],
            )

    def teacher_forced(self, lm_input: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One full causal pass: (logits [1, L, V], final-norm hidden [1, L, D])."""
        past_keys, past_values = self._empty_cache()
        outputs = self._infer(np.asarray(lm_input, dtype=np.float32), past_keys, past_values)
        return outputs["logits"], outputs["hidden"]

    def cached_logp(self, prefix_embeds: np.ndarray, forced_tokens: np.ndarray) -> np.ndarray:
        """Log-probs through the KV cache: row 0 after the prefill of ``prefix_embeds`` [1, L, D],
        row j >= 1 after feeding ``forced_tokens[j-1]``. Returns [1 + len(forced_tokens), V]."""
        forced = _as_ids(forced_tokens, "forced_tokens", self.config.speech_vocab_size)
        decoder = self._decoder()
        inputs = np.asarray(prefix_embeds, dtype=np.float32)  # inputs: [1, L, D]
        rows = []
        for step in range(forced.size + 1):
            rows.append(log_softmax(decoder.step(inputs)[0, -1]))  # [V]
            if step < forced.size:
                inputs = self.speech_embedding[forced[step]][None, None]  # inputs: [1, 1, D]
        return np.stack(rows)  # [1 + N, V]

    def _infer(
        self, inputs: np.ndarray, past_keys: np.ndarray, past_values: np.ndarray
    ) -> dict[str, np.ndarray]:
        return self.runner.infer(
            {"inputs_embeds": inputs, "past_keys": past_keys, "past_values": past_values}
        )

    def _cache_shape(self) -> tuple[int, ...]:
        qwen = self.config.qwen
        return (qwen.num_layers, 1, qwen.num_kv_heads, 0, qwen.head_dim)  # [L, 1, H, 0, Dh]

    def _empty_cache(self) -> tuple[np.ndarray, np.ndarray]:
        shape = self._cache_shape()
        return np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.float32)

    def _decoder(self) -> _Decoder:
        """The runner's own KV decoder when it has one (ORT: cache kept in ORT values), else the
        generic one that feeds each step's present cache back through ``infer``."""
        factory = getattr(self.runner, "kv_decoder", None)
        if factory is not None:
            return factory(self._cache_shape())
        return _FeedDecoder(self, self._cache_shape())


class _Decoder(Protocol):
    def step(self, inputs_embeds: np.ndarray) -> np.ndarray: ...


class _FeedDecoder:
    """Any Runner: the present cache of each step is fed back as the next past through ``infer``."""

    def __init__(self, stage: LLMStage, cache_shape: tuple[int, ...]):
        self._stage = stage
        self._keys = np.zeros(cache_shape, dtype=np.float32)  # [L, 1, H, P, Dh]
        self._values = np.zeros(cache_shape, dtype=np.float32)  # [L, 1, H, P, Dh]

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        outputs = self._stage._infer(inputs_embeds, self._keys, self._values)
        self._keys, self._values = outputs["present_keys"], outputs["present_values"]
        return outputs["logits"]  # [1, T, V]


def _as_ids(ids: np.ndarray, name: str, limit: int) -> np.ndarray:
    """Flatten to int64 ids and check ``0 <= id < limit``."""
    array = np.asarray(ids)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{name} must hold integer token ids, got dtype {array.dtype}.")
    flat = array.reshape(-1).astype(np.int64)  # flat: [N]
    if flat.size and (flat.min() < 0 or flat.max() >= limit):
        raise InputError(
            f"{name} has ids outside [0, {limit}) (min {flat.min()}, max {flat.max()}); "
            "the ids must come from this model's tokenizer."
        )
    return flat
