"""Quality guard of a reduced-precision engines directory against the fp32 one (numpy only).

Per stage, on the same inputs:

* LLM: next-token KL(fp32 || reduced) in nats and top-1 agreement over every position of a
  teacher-forced sequence ``[sos, prompt text, text, task, prompt speech, target speech]``;
* flow: SNR in dB of the reduced mel against the fp32 mel (same tokens, prompt, noise);
* HiFT: SNR in dB of the reduced waveform against the fp32 one (same fp32 mel, same NSF noise).

Every family runs through its own host stages (``Family.quality``, ``trt_cosy.models.family.QualityFeeds``):
CosyVoice 1 builds the LLM input through its text encoder graph (``V1LLMStage``, speaker row
included), runs ``V1FlowStage`` with seeded fresh CFM noise and ``V1_HIFT`` with seeded SineGen
draws; CosyVoice3 uses the v2 LLM and flow stages on its graphs and ``V3VocoderStage`` with the
engines' fixed NSF buffer.

Inputs come from a golden file when given (its teacher-forced sequence and flow/HiFT inputs), else
from a seeded generator. ``THRESHOLDS`` are the bars a precision must clear to be a default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import numpy as np

from ..family_lookup import family_of
from ..runtime.model import LoadedModel
from ..stages.sampling import log_softmax

__all__ = ["QualityInputs", "QualityRow", "THRESHOLDS", "snr_db", "next_token_agreement", "quality_guard"]

_LOGGER = logging.getLogger(__name__)

# metric -> (bound, "max" or "min"): what a reduced precision must meet on random and golden inputs.
THRESHOLDS: Final = {
    "llm_kl_mean": (0.05, "max"),
    "flow_mel_snr_db": (20.0, "min"),
    "hift_wav_snr_db": (20.0, "min"),
}


@dataclass(frozen=True)
class QualityInputs:
    """The shared inputs: ids are int64 1-D, ``prompt_feat`` [1, 2P, 80], ``embedding`` [1, 192],
    ``hift_mel`` [1, 80, F] (None: the fp32 flow output is vocoded)."""

    prompt_text: np.ndarray
    text: np.ndarray
    prompt_speech: np.ndarray
    target_speech: np.ndarray
    prompt_feat: np.ndarray
    embedding: np.ndarray
    hift_mel: np.ndarray | None = None

    @classmethod
    def random(cls, model: LoadedModel, targets: int = 100, seed: int = 0) -> QualityInputs:
        """16 + 24 text tokens, 50 prompt tokens (and their mel frames), ``targets`` target tokens; seeded."""
        rng = np.random.default_rng(seed)
        config = model.config
        vocab, prompt_frames = family_of(config).quality.random_vocab_and_prompt_frames(config)
        speech = config.llm.speech_token_size
        return cls(
            prompt_text=rng.integers(0, min(2048, vocab), 16),
            text=rng.integers(0, min(2048, vocab), 24),
            prompt_speech=rng.integers(0, speech, 50),
            target_speech=rng.integers(0, speech, targets),
            prompt_feat=rng.normal(-5.0, 2.0, (1, prompt_frames, config.flow.output_size)).astype(np.float32),
            embedding=rng.standard_normal((1, config.flow.spk_embed_dim)).astype(np.float32),
        )

    @classmethod
    def from_golden(cls, arrays: dict[str, np.ndarray]) -> QualityInputs:
        """From golden keys (``in_prompt_text``, ``in_text``, ``in_prompt_speech_token``, ...)."""

        def ids(key: str) -> np.ndarray:
            return np.asarray(arrays[key]).reshape(-1).astype(np.int64)

        return cls(
            prompt_text=ids("in_prompt_text"),
            text=ids("in_text"),
            prompt_speech=ids("in_prompt_speech_token"),
            target_speech=ids("in_target_speech_token"),
            prompt_feat=np.asarray(arrays["in_prompt_feat"], np.float32),
            embedding=np.asarray(arrays["in_spk_embedding"], np.float32),
            hift_mel=np.asarray(arrays["in_hift_synth_mel"], np.float32)
            if "in_hift_synth_mel" in arrays
            else None,
        )


@dataclass(frozen=True)
class QualityRow:
    metric: str
    value: float
    bound: float
    kind: str  # "max" or "min"

    @property
    def passed(self) -> bool:
        return self.value <= self.bound if self.kind == "max" else self.value >= self.bound


def snr_db(reference: np.ndarray, candidate: np.ndarray) -> float:
    """``10 log10(sum ref² / sum (ref - cand)²)`` in float64; inf when identical."""
    reference = np.asarray(reference, np.float64)
    noise = float(((reference - np.asarray(candidate, np.float64)) ** 2).sum())
    return float("inf") if noise == 0.0 else 10.0 * float(np.log10((reference**2).sum() / noise))


def next_token_agreement(reference: np.ndarray, candidate: np.ndarray) -> tuple[float, float, float]:
    """(mean KL, max KL, top-1 agreement) between logits [N, V] of the two models, row by row."""
    logp = np.stack([log_softmax(row.astype(np.float64)) for row in reference])  # [N, V]
    logq = np.stack([log_softmax(row.astype(np.float64)) for row in candidate])  # [N, V]
    kl = (np.exp(logp) * (logp - logq)).sum(axis=1)  # [N]
    top1 = float((reference.argmax(axis=1) == candidate.argmax(axis=1)).mean())
    return float(kl.mean()), float(kl.max()), top1


def quality_guard(
    reference: LoadedModel, candidate: LoadedModel, inputs: QualityInputs | None = None, seed: int = 0
) -> list[QualityRow]:
    """Compare ``candidate`` (reduced precision) with ``reference`` (fp32) stage by stage."""
    feeds = family_of(reference.config).quality  # the family's own host stages for each metric
    inputs = inputs or QualityInputs.random(reference, seed=seed)
    kl_mean, kl_max, top1 = next_token_agreement(
        feeds.llm_logits(reference, inputs), feeds.llm_logits(candidate, inputs)
    )
    mel_ref = feeds.mel(reference, inputs, seed)
    mel_snr = snr_db(mel_ref, feeds.mel(candidate, inputs, seed))
    mel = inputs.hift_mel if inputs.hift_mel is not None else mel_ref
    noise = feeds.vocoder_draws(reference, mel.shape[2], seed)
    values = {
        "llm_kl_mean": kl_mean,
        "flow_mel_snr_db": mel_snr,
        "hift_wav_snr_db": snr_db(feeds.wav(reference, mel, noise), feeds.wav(candidate, mel, noise)),
    }
    rows = [QualityRow(name, value, *THRESHOLDS[name]) for name, value in values.items()]
    # Reported, not bars: on random-weight models the next-token distributions are nearly flat, so
    # top-1 flips between near-ties at a KL of 1e-3; the KL is the bar (docs/precision.md).
    rows.append(QualityRow("llm_top1", top1, 0.0, "min"))
    rows.append(QualityRow("llm_kl_max", kl_max, float("inf"), "max"))
    return rows
