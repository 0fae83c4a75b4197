"""CosyVoice 1 host logic (numpy only): LLM input layout and decode loop, the length regulator's
interpolation indices, the CFM with its flow cache, and the overlap/cross-fade streaming of the
official ``CosyVoiceModel`` (docs/cosyvoice-spec §3.6, §4.5, §6.2).

Every random draw goes through a ``V1Draws`` object (``RandomDraws`` for synthesis, recorded
official draws in the golden tests). Per-request streaming state lives in ``V1StreamState``,
so the stages themselves are stateless and can serve concurrent requests.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Protocol

import numpy as np

from ...errors import InputError, ModelDirError
from ...runtime.backends.base import Runner
from ...stages.flow import solve_euler
from ...stages.sampling import Sampler, log_softmax
from ...stages.speed import stretch_mel
from ...stages.vocoder import fade_in_out
from .config import V1FlowConfig, V1LLMConfig, V1ModelConfig

__all__ = [
    "interpolation_indices",
    "regulator_indices",
    "V1LLMStage",
    "V1Draws",
    "RandomDraws",
    "V1FlowOutput",
    "V1FlowStage",
    "V1StreamState",
    "V1Synthesizer",
    "stream_token_chunks",
    "load_speakers",
]

_LOGGER = logging.getLogger(__name__)
_SOS_ROW: Final = 0
_TASK_ROW: Final = 1
_OVERLAP_TOKENS: Final = 20  # the regulator's head/tail pieces (= the official token_overlap_len)


def interpolation_indices(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``F.interpolate(size=out_size, mode='linear', align_corners=False)`` as gather indices.

    Returns (index0, index1, weight1) over ``out_size`` frames, computed as torch's CPU
    kernel does: ``src = max(in/out · (dst + 0.5) - 0.5, 0)``; equal sizes copy.
    """
    if in_size <= 0 or out_size <= 0:
        raise InputError(f"cannot interpolate {in_size} frames to {out_size}; pass at least one token.")
    dst = np.arange(out_size)
    if in_size == out_size:
        return dst.astype(np.int64), dst.astype(np.int64), np.zeros(out_size, np.float32)
    scale = np.float32(in_size) / np.float32(out_size)
    # torch's kernel computes scale · (dst + 0.5) - 0.5 as one fused multiply-add: exact in float64
    # (24-bit × short integer), rounded once to float32.
    src = (np.float64(scale) * (dst + 0.5) - 0.5).astype(np.float32)  # [F]
    src = np.maximum(src, np.float32(0))
    index0 = np.minimum(np.floor(src).astype(np.int64), in_size - 1)  # [F]
    weight1 = np.clip(src - index0.astype(np.float32), 0, 1).astype(np.float32)  # [F]
    index1 = index0 + (index0 < in_size - 1)  # [F]
    return index0, index1.astype(np.int64), weight1


def regulator_indices(
    n_prompt: int, n_tokens: int, prompt_frames: int, config: V1FlowConfig
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gather indices into ``h`` [P + N rows] for ``InterpolateRegulator.inference`` (spec §4.5).

    The prompt rows go to ``prompt_frames``; the N new tokens to ``int(N / 50 · 22050 / 256)``
    frames, in three separately interpolated pieces (first 20, middle, last 20) when N > 40.
    """
    mel_len2 = config.mel_frames(n_tokens)
    edge = config.mel_frames(_OVERLAP_TOKENS)
    if n_tokens > 2 * _OVERLAP_TOKENS:
        pieces = [
            (0, _OVERLAP_TOKENS, edge),
            (_OVERLAP_TOKENS, n_tokens - 2 * _OVERLAP_TOKENS, mel_len2 - 2 * edge),
        ]
        pieces.append((n_tokens - _OVERLAP_TOKENS, _OVERLAP_TOKENS, edge))
    else:
        pieces = [(0, n_tokens, mel_len2)]
    pieces = [(n_prompt + start, size, frames) for start, size, frames in pieces]
    if n_prompt > 0:
        pieces.insert(0, (0, n_prompt, prompt_frames))
    parts = []
    for start, size, frames in pieces:
        index0, index1, weight1 = interpolation_indices(size, frames)
        parts.append((index0 + start, index1 + start, weight1))
    index0, index1, weight1 = (np.concatenate(column) for column in zip(*parts, strict=True))
    return index0, index1, weight1


class V1LLMStage:
    """Text ids in, speech tokens out, for ``TransformerLM`` (text encoder graph + LM graph).

    Args:
        text_encoder: ``V1_TEXT_ENCODER`` runner. llm: ``LLM`` runner (v1 TransformerLM).
        tables: float32 ``text_embedding``, ``speech_embedding``, ``llm_embedding`` (host lookups).
        config: the release's ``V1LLMConfig``.
    """

    def __init__(
        self, text_encoder: Runner, llm: Runner, tables: Mapping[str, np.ndarray], config: V1LLMConfig
    ):
        missing = [
            name for name in ("text_embedding", "speech_embedding", "llm_embedding") if name not in tables
        ]
        if missing:
            raise ModelDirError(f"LLM embedding tables {missing} are missing; rebuild with `trt-cosy build`.")
        self.text_encoder = text_encoder
        self.llm = llm
        self.config = config
        self.text_embedding = np.asarray(tables["text_embedding"], np.float32)  # [vocab, E]
        self.speech_embedding = np.asarray(tables["speech_embedding"], np.float32)  # [4096, D]
        self.llm_embedding = np.asarray(tables["llm_embedding"], np.float32)  # [2, D]

    def length_limits(self, num_text_tokens: int) -> tuple[int, int]:
        config = self.config
        return int(num_text_tokens * config.min_token_text_ratio), int(
            num_text_tokens * config.max_token_text_ratio
        )

    def build_inputs(
        self,
        text_ids: np.ndarray,
        prompt_text_ids: np.ndarray,
        prompt_speech_ids: np.ndarray,
        embedding: np.ndarray | None,
    ) -> np.ndarray:
        """``[sos, spk?, text_enc(prompt_text ++ text), task, speech(prompt_speech)]``: [1, L, D].

        The ``spk`` row is present when ``embedding`` [1, 192] is given (SFT, zero-shot,
        cross-lingual) and absent when it is None (instruct: ``prompt_text`` = the instruction).
        """
        text = np.concatenate(
            [
                _as_ids(prompt_text_ids, "prompt_text_ids", len(self.text_embedding)),
                _as_ids(text_ids, "text_ids", len(self.text_embedding)),
            ]
        )  # [Nt]
        speech = _as_ids(prompt_speech_ids, "prompt_speech_ids", self.config.speech_token_size)  # [Ns]
        feed_embedding = (
            np.zeros((1, self.config.spk_embed_dim), np.float32) if embedding is None else embedding
        )
        out = self.text_encoder.infer(
            {
                "text_embeds": self.text_embedding[text][None],
                "embedding": np.asarray(feed_embedding, np.float32),
            }
        )
        rows = [self.llm_embedding[_SOS_ROW : _SOS_ROW + 1]]  # [1, D]
        if embedding is not None:
            rows.append(out["spk"])  # [1, D]
        rows += [
            out["text_enc"][0],
            self.llm_embedding[_TASK_ROW : _TASK_ROW + 1],
            self.speech_embedding[speech],
        ]
        return np.concatenate(rows)[None].astype(np.float32)  # [1, L, D]

    def generate(
        self,
        text_ids: np.ndarray,
        prompt_text_ids: np.ndarray,
        prompt_speech_ids: np.ndarray,
        embedding: np.ndarray | None,
        sampler: Sampler,
        max_new_tokens: int | None = None,
    ) -> Iterator[int]:
        """Speech tokens for ``text_ids`` (lazy: decoding runs as you iterate); stops on eos 4096.

        ``sampler`` is a per-request ``RASSampler`` or ``greedy_sample``; eos is masked for the
        first ``2 · len(text_ids)`` steps, at most ``20 · len(text_ids)`` steps run.
        """
        num_text = _as_ids(text_ids, "text_ids", len(self.text_embedding)).size
        if num_text == 0:
            raise InputError(
                "text_ids is empty: there is nothing to synthesise. Pass at least one text token."
            )
        lm_input = self.build_inputs(text_ids, prompt_text_ids, prompt_speech_ids, embedding)  # [1, L, D]
        min_len, max_len = self.length_limits(num_text)
        if max_new_tokens is not None:
            max_len = min(max_len, max_new_tokens)
        return self._decode(lm_input, sampler, min_len, max_len)

    def _decode(self, lm_input: np.ndarray, sampler: Sampler, min_len: int, max_len: int) -> Iterator[int]:
        eos = self.config.eos_token
        past_keys, past_values = self._empty_cache()
        inputs, decoded = lm_input, []  # inputs: [1, T, D]
        for step in range(max_len):
            outputs = self.llm.infer(
                {"inputs_embeds": inputs, "past_keys": past_keys, "past_values": past_values}
            )
            logp = log_softmax(outputs["logits"][0, -1])  # logp: [4097]
            if step < min_len:
                logp[eos] = -np.inf
            token = int(sampler(logp, decoded))
            if token == eos:
                break
            yield token
            decoded.append(token)
            inputs = self.speech_embedding[token][None, None]  # inputs: [1, 1, D]
            past_keys, past_values = outputs["present_keys"], outputs["present_values"]
        _LOGGER.debug("v1 llm: %d tokens (prefill %d positions)", len(decoded), lm_input.shape[1])

    def teacher_forced(self, lm_input: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One full causal pass: (logits [1, L, 4097], hidden [1, L, D])."""
        past_keys, past_values = self._empty_cache()
        out = self.llm.infer({"inputs_embeds": lm_input, "past_keys": past_keys, "past_values": past_values})
        return out["logits"], out["hidden"]

    def cached_steps(self, prefix: np.ndarray, forced_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """KV-cached pass: row 0 after the prefill of ``prefix`` [1, L, D], row j after feeding
        ``forced_tokens[j-1]``. Returns (log-probs [1 + N, 4097], last hidden [1 + N, D])."""
        forced = _as_ids(forced_tokens, "forced_tokens", self.config.speech_token_size)
        past_keys, past_values = self._empty_cache()
        inputs, logps, hiddens = np.asarray(prefix, np.float32), [], []
        for step in range(forced.size + 1):
            out = self.llm.infer(
                {"inputs_embeds": inputs, "past_keys": past_keys, "past_values": past_values}
            )
            logps.append(log_softmax(out["logits"][0, -1]))  # [4097]
            hiddens.append(out["hidden"][0, -1])  # [D]
            if step < forced.size:
                inputs = self.speech_embedding[forced[step]][None, None]  # [1, 1, D]
                past_keys, past_values = out["present_keys"], out["present_values"]
        return np.stack(logps), np.stack(hiddens)

    def _empty_cache(self) -> tuple[np.ndarray, np.ndarray]:
        lm = self.config.llm
        shape = (lm.num_blocks, 1, lm.attention_heads, 0, lm.output_size // lm.attention_heads)
        return np.zeros(shape, np.float32), np.zeros(shape, np.float32)


class V1Draws(Protocol):
    """Where the random numbers of one request come from (fresh CFM noise, SineGen phases/noise)."""

    def flow_noise(self, frames: int) -> np.ndarray: ...  # [1, 80, frames] standard normal

    def hift_phase(self) -> np.ndarray: ...  # [1, H + 1] uniform [0, 1)

    def hift_noise(self, samples: int) -> np.ndarray: ...  # [1, samples, H + 1] standard normal


@dataclass
class RandomDraws:
    """``V1Draws`` from a numpy Generator (one per request; a Generator is not thread-safe)."""

    rng: np.random.Generator
    mel_bins: int = 80
    sines: int = 9

    def flow_noise(self, frames: int) -> np.ndarray:
        return self.rng.standard_normal((1, self.mel_bins, frames), dtype=np.float32)

    def hift_phase(self) -> np.ndarray:
        return self.rng.random((1, self.sines), dtype=np.float32)

    def hift_noise(self, samples: int) -> np.ndarray:
        return self.rng.standard_normal((1, samples, self.sines), dtype=np.float32)


@dataclass(frozen=True)
class V1FlowOutput:
    mel: np.ndarray  # generated mel [1, 80, mel_len2]
    h: np.ndarray  # encoder_proj output [1, P + N, 80]
    mu: np.ndarray  # regulator output [1, 80, T] before cache pinning
    cache: np.ndarray  # flow cache for the next call [1, 80, C, 2]


class V1FlowStage:
    """``MaskedDiffWithXvec.inference`` + ``ConditionalCFM`` with the official flow cache."""

    def __init__(self, encoder: Runner, estimator: Runner, config: V1FlowConfig, overlap_frames: int = 34):
        self.encoder = encoder
        self.estimator = estimator
        self.config = config
        self.overlap_frames = overlap_frames

    def token2mel(
        self,
        tokens: np.ndarray,
        prompt_tokens: np.ndarray,
        prompt_feat: np.ndarray,
        embedding: np.ndarray,
        cache: np.ndarray,
        draws: V1Draws,
    ) -> V1FlowOutput:
        """tokens [1, N], prompt_tokens [1, P], prompt_feat [1, P_mel, 80], embedding [1, 192],
        cache [1, 80, C, 2] (C = 0 on the first call)."""
        tokens = np.asarray(tokens).reshape(1, -1).astype(np.int64)
        prompt_tokens = np.asarray(prompt_tokens).reshape(1, -1).astype(np.int64)
        prompt_feat = np.asarray(prompt_feat, np.float32)
        all_tokens = np.concatenate([prompt_tokens, tokens], axis=1)  # [1, P + N]
        if (
            tokens.shape[1] == 0
            or int(all_tokens.max()) >= self.config.vocab_size
            or int(all_tokens.min()) < 0
        ):
            raise InputError(
                f"flow tokens must be 1 or more ids in [0, {self.config.vocab_size}) (drop the LLM's eos first)."
            )
        prompt_frames = prompt_feat.shape[1]
        index0, index1, weight1 = regulator_indices(
            prompt_tokens.shape[1], tokens.shape[1], prompt_frames, self.config
        )
        out = self.encoder.infer(
            {
                "tokens": all_tokens,
                "embedding": np.asarray(embedding, np.float32),
                "index0": index0,
                "index1": index1,
                "weight1": weight1,
            }
        )
        mu = out["mu"]  # [1, 80, T]
        frames = mu.shape[2]
        z = np.asarray(draws.flow_noise(frames), np.float32).copy()  # [1, 80, T]
        pinned_mu = mu.copy()
        cached = cache.shape[2]
        if cached > frames:
            raise InputError(f"flow cache of {cached} frames is longer than this call's {frames} frames.")
        if cached:
            z[:, :, :cached] = cache[..., 0]
            pinned_mu[:, :, :cached] = cache[..., 1]
        tail = self.overlap_frames
        new_cache = np.stack(
            [
                np.concatenate([z[:, :, :prompt_frames], z[:, :, -tail:]], axis=2),
                np.concatenate([pinned_mu[:, :, :prompt_frames], pinned_mu[:, :, -tail:]], axis=2),
            ],
            axis=-1,
        )  # [1, 80, P_mel + 34, 2]
        cond = np.zeros_like(mu)  # [1, 80, T]
        cond[0, :, :prompt_frames] = prompt_feat[0].T
        cfm = self.config.cfm
        mel = solve_euler(
            self.estimator,
            pinned_mu,
            np.ones((1, 1, frames), np.float32),
            out["spks"],
            cond,
            z,
            cfm.n_timesteps,
            cfm.inference_cfg_rate,
        )  # [1, 80, T]
        return V1FlowOutput(mel=mel[:, :, prompt_frames:], h=out["h"], mu=mu, cache=new_cache)


@dataclass
class V1StreamState:
    """Per-request state carried between ``token2wav`` calls (official flow/mel/HiFT caches)."""

    flow_cache: np.ndarray = field(default_factory=lambda: np.zeros((1, 80, 0, 2), np.float32))
    mel_overlap: np.ndarray | None = None  # [1, 80, 34]
    hift_mel: np.ndarray | None = None  # [1, 80, 20]
    hift_source: np.ndarray | None = None  # [1, 1, 5120]
    hift_speech: np.ndarray | None = None  # [1, 5120]


class V1Synthesizer:
    """Official ``CosyVoiceModel.token2wav`` over a flow stage and a ``V1_HIFT`` runner."""

    def __init__(self, flow: V1FlowStage, hift: Runner, config: V1ModelConfig):
        stream = config.stream
        self.flow = flow
        self.hift = hift
        self.config = config
        self.mel_window = np.hamming(2 * stream.mel_overlap_len)  # float64 like the official
        self.speech_window = np.hamming(2 * stream.source_cache_len)

    def token2wav(
        self,
        tokens: np.ndarray,
        prompt_tokens: np.ndarray,
        prompt_feat: np.ndarray,
        embedding: np.ndarray,
        state: V1StreamState,
        draws: V1Draws,
        finalize: bool,
        speed: float = 1.0,
    ) -> np.ndarray:
        """One chunk of waveform [1, S] float32; ``state`` is read and updated in place. ``speed`` != 1
        (a whole segment, non-streaming): the mel is stretched in time before HiFT, as officially."""
        stream = self.config.stream
        out = self.flow.token2mel(tokens, prompt_tokens, prompt_feat, embedding, state.flow_cache, draws)
        state.flow_cache = out.cache
        mel = out.mel  # [1, 80, F]
        if state.mel_overlap is not None:
            mel = fade_in_out(mel, state.mel_overlap, self.mel_window)
        has_cache = state.hift_mel is not None
        cache_source = state.hift_source if has_cache else np.zeros((1, 1, 0), np.float32)
        if has_cache:
            mel = np.concatenate([state.hift_mel, mel], axis=2)  # [1, 80, 20 + F]
        if not finalize:
            state.mel_overlap = mel[:, :, -stream.mel_overlap_len :]
            mel = mel[:, :, : -stream.mel_overlap_len]
        elif speed != 1.0:
            mel = stretch_mel(mel, speed)  # [1, 80, int(F / speed)]
        speech, source = self._vocode(mel, cache_source, draws)  # [1, S], [1, 1, S]
        if has_cache:
            speech = fade_in_out(speech, state.hift_speech, self.speech_window)
        if finalize:
            return speech
        state.hift_mel = mel[:, :, -stream.mel_cache_len :]
        state.hift_source = source[:, :, -stream.source_cache_len :]
        state.hift_speech = speech[:, -stream.source_cache_len :]
        return speech[:, : -stream.source_cache_len]

    def _vocode(
        self, mel: np.ndarray, cache_source: np.ndarray, draws: V1Draws
    ) -> tuple[np.ndarray, np.ndarray]:
        samples = mel.shape[2] * self.config.hift.samples_per_frame
        feed = {
            "mel": np.ascontiguousarray(mel, np.float32),
            "sine_noise": np.asarray(draws.hift_noise(samples), np.float32),
            "rand_phase": np.asarray(draws.hift_phase(), np.float32),
            "cache_source": np.ascontiguousarray(cache_source, np.float32),
        }
        out = self.hift.infer(feed)
        return out["wav"], out["source"]


def stream_token_chunks(
    tokens: Iterable[int], hop: int = 100, overlap: int = 20
) -> Iterator[tuple[np.ndarray, bool]]:
    """The official v1 schedule: while ``hop + overlap`` tokens are pending, emit them (not final)
    and drop the first ``hop``; at the end emit the rest (final). Yields (tokens [1, n], finalize).

    Nothing is yielded for an empty token stream.
    """
    pending: list[int] = []
    emitted = False
    for token in tokens:
        pending.append(int(token))
        if len(pending) >= hop + overlap:
            yield np.asarray(pending[: hop + overlap], np.int64)[None], False
            pending = pending[hop:]
            emitted = True
    if pending or emitted:
        yield np.asarray(pending, np.int64)[None], True


def _as_ids(ids: np.ndarray, name: str, limit: int) -> np.ndarray:
    array = np.asarray(ids)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"{name} must hold integer token ids, got dtype {array.dtype}.")
    flat = array.reshape(-1).astype(np.int64)  # [N]
    if flat.size and (flat.min() < 0 or flat.max() >= limit):
        raise InputError(
            f"{name} has ids outside [0, {limit}) (min {flat.min()}, max {flat.max()}); "
            "the ids must come from this model's tokenizer."
        )
    return flat


def load_speakers(path: Path) -> dict[str, np.ndarray]:
    """Preset speakers written by ``trt_cosy.builder.spk2info.write_speakers``: name -> embedding [192]."""
    try:
        with np.load(Path(path), allow_pickle=False) as data:
            return {
                str(name): data["embeddings"][i].astype(np.float32) for i, name in enumerate(data["names"])
            }
    except (OSError, KeyError, ValueError) as exc:
        raise ModelDirError(
            f"{path} is not a preset-speaker file ({exc}); rebuild with `trt-cosy build`."
        ) from exc
