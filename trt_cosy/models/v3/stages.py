"""CosyVoice3 host-side pieces (numpy only) that differ from CosyVoice2.

What is reused unchanged: ``LLMStage`` (the v3 tables put sos/task rows in ``llm_embedding``, see
``models.v3.export.llm.embedding_tables_v3``), ``FlowStage`` and ``solve_euler`` (the v3 encoder
graph and the DiT estimator keep the CosyVoice2 contracts). What is here:

* ``filter_silent_tokens``: ``CosyVoice3Model.llm_job`` drops silence/breath tokens after 5 in a row.
* ``V3VocoderStage``: v3 has no HiFT cache or cross-fade; every call re-vocodes the *whole* mel so far
  (``finalize=False`` graph while streaming) and emits the samples after the running ``speech_offset``.
* ``cached_step_outputs``: per-step log-probs and hidden states through the KV cache (verify keys
  ``llm_tf_cached_logp`` / ``llm_tf_cached_hidden``).
* ``LoadedModelV3``: ``LoadedModel`` plus the fixed NSF noise buffer of the causal HiFT.

End-of-speech decision (docs/cosyvoice-spec §3.7, golden README §8.3): the official ``sampling_ids``
masks index ``speech_token_size`` (6561) while fewer than ``min_len`` tokens were produced. In v3
that id is *sos*, not eos (6562), so the official model may stop early on 6562..6760. We keep the
official behaviour (``LLMConfig.eos_token`` = 6561 is what ``LLMStage`` masks, and any id in
6561..6760 stops decoding), because parity and the released model's tested behaviour matter more
than the evident intent; masking the real eos would need an ``LLMConfig`` option.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from ...errors import InputError
from ...runtime.backends.base import Runner
from ...runtime.model import LoadedModel
from ...stages.sampling import log_softmax
from .config import MAX_SILENT_RUN, SILENT_TOKENS, CausalHiFTConfig
from .graphs import HIFT_STREAM_MIN_FRAMES

__all__ = [
    "LoadedModelV3",
    "filter_silent_tokens",
    "V3VocoderCache",
    "V3VocoderStage",
    "cached_step_outputs",
]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModelV3(LoadedModel):
    """``LoadedModel`` of a CosyVoice3 release.

    ``hift_noise`` is the causal HiFT's fixed additive-noise buffer (``SineGen2.sine_waves``),
    float32 [1, S, nb_harmonics + 1], uniform [0, 1); every call uses its prefix.
    """

    hift_noise: np.ndarray = field(default_factory=lambda: np.zeros((1, 0, 9), np.float32))


def filter_silent_tokens(
    tokens: Iterable[int], silent: frozenset[int] = SILENT_TOKENS, max_run: int = MAX_SILENT_RUN
) -> Iterator[int]:
    """Official ``llm_job`` filter: of each run of silent tokens only the first ``max_run`` pass.

    Lazy: tokens are read as you iterate (the LLM keeps streaming through it).
    """
    run = 0
    for token in tokens:
        if token in silent:
            run += 1
            if run > max_run:
                continue
        else:
            run = 0
        yield token


@dataclass
class V3VocoderCache:
    """Per-request streaming state: the whole mel so far and how many samples were emitted."""

    mel: np.ndarray | None = None  # [1, 80, F]
    speech_offset: int = 0


class V3VocoderStage:
    """Mel chunks in, new waveform samples out, as ``CosyVoice3Model.token2wav`` does.

    Args:
        runner: ``HIFT_V3`` contract (finalize: the whole mel is final).
        stream_runner: ``HIFT_V3_STREAM`` contract (the last 7 frames are look-ahead only).
        noise: the fixed noise buffer [1, S, nb_harmonics + 1] (``LoadedModelV3.hift_noise``).
        config: the release's ``CausalHiFTConfig``.
    """

    def __init__(self, runner: Runner, stream_runner: Runner, noise: np.ndarray, config: CausalHiFTConfig):
        self.runner = runner
        self.stream_runner = stream_runner
        self.noise = np.asarray(noise, dtype=np.float32)
        self.config = config
        self.samples_per_frame = config.samples_per_frame

    def vocode(self, mel: np.ndarray, final: bool) -> dict[str, np.ndarray]:
        """One official ``hift.inference(mel, finalize=final)`` call: wav, source and f0."""
        mel = self._check_mel(mel, final)
        samples = mel.shape[2] * self.samples_per_frame
        if samples > self.noise.shape[1]:
            seconds = self.noise.shape[1] / self.config.sampling_rate
            raise InputError(
                f"{mel.shape[2]} mel frames need {samples} noise samples but the HiFT noise buffer holds "
                f"{self.noise.shape[1]} ({seconds:.0f} s); synthesise shorter text per call."
            )
        runner = self.runner if final else self.stream_runner
        return runner.infer({"mel": mel, "sine_noise": np.ascontiguousarray(self.noise[:, :samples])})

    def render(
        self, mel: np.ndarray, cache: V3VocoderCache | None = None, *, final: bool = True
    ) -> np.ndarray:
        """Append ``mel`` [1, 80, F] to the request's mel, re-vocode it all, return the new samples [1, N].

        Without a cache the call is one-shot (``final`` must be True).
        """
        if cache is None:
            if not final:
                raise InputError(
                    "a non-final vocoder call needs a V3VocoderCache to carry the streaming state."
                )
            cache = V3VocoderCache()
        mel = np.asarray(mel, dtype=np.float32)
        whole = mel if cache.mel is None else np.concatenate([cache.mel, mel], axis=2)  # [1, 80, F]
        speech = self.vocode(whole, final)["wav"]  # speech: [1, N]
        cache.mel = whole
        new = speech[:, cache.speech_offset :]  # [1, N - offset]
        cache.speech_offset += new.shape[1]
        return new

    def _check_mel(self, mel: np.ndarray, final: bool) -> np.ndarray:
        mel = np.asarray(mel)
        mels = self.config.in_channels
        least = 1 if final else HIFT_STREAM_MIN_FRAMES
        if mel.ndim != 3 or mel.shape[0] != 1 or mel.shape[1] != mels or mel.shape[2] < least:
            raise InputError(
                f"vocoder mel must have shape [1, {mels}, F>={least}] (a streaming call keeps 7 frames "
                f"of look-ahead), got {mel.shape}."
            )
        return np.ascontiguousarray(mel, dtype=np.float32)


def cached_step_outputs(
    runner: Runner,
    speech_embedding: np.ndarray,
    prefix_embeds: np.ndarray,
    forced_tokens: np.ndarray,
    cache_shape: tuple[int, ...],
) -> tuple[np.ndarray, np.ndarray]:
    """KV-cached teacher forcing: row 0 after the prefill, row j after feeding ``forced_tokens[j-1]``.

    Args:
        runner: ``LLM`` contract. speech_embedding: [V, D]. prefix_embeds: [1, L, D].
        forced_tokens: [N] speech ids. cache_shape: the empty cache ``[L, 1, H, 0, Dh]``.

    Returns:
        (log-probs [N + 1, V], last-position final-norm hidden [N + 1, D]).
    """
    past = {"past_keys": np.zeros(cache_shape, np.float32), "past_values": np.zeros(cache_shape, np.float32)}
    inputs = np.asarray(prefix_embeds, dtype=np.float32)  # inputs: [1, T, D]
    forced = np.asarray(forced_tokens, dtype=np.int64).reshape(-1)
    logps, hiddens = [], []
    for step in range(forced.size + 1):
        outputs: Mapping[str, np.ndarray] = runner.infer({"inputs_embeds": inputs, **past})
        logps.append(log_softmax(outputs["logits"][0, -1]))  # [V]
        hiddens.append(outputs["hidden"][0, -1])  # [D]
        if step < forced.size:
            inputs = speech_embedding[forced[step]][None, None]  # inputs: [1, 1, D]
            past = {"past_keys": outputs["present_keys"], "past_values": outputs["present_values"]}
    return np.stack(logps), np.stack(hiddens)
