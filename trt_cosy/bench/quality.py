"""Quality guard of a reduced-precision engines directory against the fp32 one (numpy only).

Per stage, on the same inputs:

* LLM: next-token KL(fp32 || reduced) in nats and top-1 agreement over every position of a
  teacher-forced sequence ``[sos, prompt text, text, task, prompt speech, target speech]``;
* flow: SNR in dB of the reduced mel against the fp32 mel (same tokens, prompt, noise);
* HiFT: SNR in dB of the reduced waveform against the fp32 one (same fp32 mel, same NSF noise).

Every family runs through its own host stages: CosyVoice 1 builds the LLM input through its text
encoder graph (``V1LLMStage``, speaker row included), runs ``V1FlowStage`` with seeded fresh CFM
noise and ``V1_HIFT`` with seeded SineGen draws; CosyVoice3 uses the v2 LLM and flow stages on its
graphs and ``V3VocoderStage`` with the engines' fixed NSF buffer.

Inputs come from a golden file when given (its teacher-forced sequence and flow/HiFT inputs), else
from a seeded generator. ``THRESHOLDS`` are the bars a precision must clear to be a default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Final

import numpy as np

from ..models.v1 import graphs as graphs_v1
from ..models.v1.stages import RandomDraws, V1FlowStage, V1LLMStage
from ..models.v3.stages import V3VocoderStage
from ..runtime.model import LoadedModel
from ..stages.flow import FlowStage
from ..stages.llm import LLMStage
from ..stages.sampling import log_softmax
from ..stages.vocoder import VocoderStage

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
        if config.family == "v1":
            vocab, prompt_frames = config.llm.text_token_size, config.flow.mel_frames(50)
        else:
            vocab, prompt_frames = config.llm.qwen.vocab_size, config.token_mel_ratio * 50
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


def _llm_logits(model: LoadedModel, inputs: QualityInputs) -> np.ndarray:
    runners, speech = model.runners, np.concatenate([inputs.prompt_speech, inputs.target_speech])
    if model.config.family == "v1":  # zero-shot layout: [sos, spk, text_enc(text), task, speech]
        v1 = V1LLMStage(
            runners[graphs_v1.V1_TEXT_ENCODER.name], runners["llm"], model.llm_tables, model.config.llm
        )
        lm_input = v1.build_inputs(inputs.text, inputs.prompt_text, speech, inputs.embedding)  # [1, L, D]
        logits, _ = v1.teacher_forced(lm_input)  # [1, L, V]
        return logits[0]
    stage = LLMStage(runners["llm"], model.llm_tables, model.config.llm)
    lm_input = stage.build_inputs(inputs.text, inputs.prompt_text, speech)  # [1, L, D]
    logits, _ = stage.teacher_forced(lm_input)  # [1, L, V]
    return logits[0]


def _mel(model: LoadedModel, inputs: QualityInputs, seed: int) -> np.ndarray:
    runners = model.runners
    if model.config.family == "v1":  # fresh CFM noise per call: the same seeded draw for both models
        flow_v1 = V1FlowStage(
            runners[graphs_v1.V1_FLOW_ENCODER.name],
            runners[graphs_v1.V1_FLOW_ESTIMATOR.name],
            model.config.flow,
        )
        draws = RandomDraws(np.random.default_rng(seed), mel_bins=model.config.flow.output_size)
        empty_cache = np.zeros((1, model.config.flow.output_size, 0, 2), np.float32)
        return flow_v1.token2mel(
            inputs.target_speech[None],
            inputs.prompt_speech[None],
            inputs.prompt_feat,
            inputs.embedding,
            empty_cache,
            draws,
        ).mel  # [1, 80, F]
    flow = FlowStage(
        runners["flow_encoder"],
        runners["flow_estimator"],
        runners["flow_estimator_stream"],
        model.flow_noise,
        model.config.flow,
    )
    return flow.token2mel(
        inputs.target_speech[None],
        inputs.prompt_speech[None],
        inputs.prompt_feat,
        inputs.embedding,
        streaming=False,
        finalize=True,
    ).mel  # [1, 80, 2N]


def _hift_draws(model: LoadedModel, frames: int, seed: int) -> dict[str, np.ndarray]:
    """The vocoder's random inputs for ``frames`` mel frames, shared by both models.

    v1: SineGen noise [1, S, H + 1] and phases [1, H + 1]; v2: NSF noise [1, S, H + 1]; v3: the
    fixed NSF buffer prefix (the engines' own, identical in an fp32 and a derived directory).
    """
    hift = model.config.hift
    if model.config.family == "v3":
        return {"sine_noise": np.asarray(model.hift_noise, np.float32)}
    samples = frames * hift.samples_per_frame
    rng = np.random.default_rng(seed)
    draws = {"sine_noise": rng.standard_normal((1, samples, hift.nb_harmonics + 1), dtype=np.float32)}
    if model.config.family == "v1":
        draws["rand_phase"] = rng.random((1, hift.nb_harmonics + 1), dtype=np.float32)
    return draws


def _wav(model: LoadedModel, mel: np.ndarray, draws: dict[str, np.ndarray]) -> np.ndarray:
    """One whole-utterance vocoder call on ``mel`` [1, 80, F]: the waveform [1, S]."""
    family, runners = model.config.family, model.runners
    if family == "v3":
        vocoder = V3VocoderStage(
            runners["hift"], runners["hift_stream"], draws["sine_noise"], model.config.hift
        )
        return vocoder.vocode(mel, final=True)["wav"]
    if family == "v1":
        feed = dict(
            draws, mel=np.ascontiguousarray(mel, np.float32), cache_source=np.zeros((1, 1, 0), np.float32)
        )
        return runners[graphs_v1.V1_HIFT.name].infer(feed)["wav"]
    return VocoderStage(runners["hift"], model.config.hift).render(mel, draws["sine_noise"])


def quality_guard(
    reference: LoadedModel, candidate: LoadedModel, inputs: QualityInputs | None = None, seed: int = 0
) -> list[QualityRow]:
    """Compare ``candidate`` (reduced precision) with ``reference`` (fp32) stage by stage."""
    inputs = inputs or QualityInputs.random(reference, seed=seed)
    kl_mean, kl_max, top1 = next_token_agreement(
        _llm_logits(reference, inputs), _llm_logits(candidate, inputs)
    )
    mel_ref = _mel(reference, inputs, seed)
    mel_snr = snr_db(mel_ref, _mel(candidate, inputs, seed))
    mel = inputs.hift_mel if inputs.hift_mel is not None else mel_ref
    noise = _hift_draws(reference, mel.shape[2], seed)
    values = {
        "llm_kl_mean": kl_mean,
        "flow_mel_snr_db": mel_snr,
        "hift_wav_snr_db": snr_db(_wav(reference, mel, noise), _wav(candidate, mel, noise)),
    }
    rows = [QualityRow(name, value, *THRESHOLDS[name]) for name, value in values.items()]
    # Reported, not bars: on random-weight models the next-token distributions are nearly flat, so
    # top-1 flips between near-ties at a KL of 1e-3; the KL is the bar (docs/precision.md).
    rows.append(QualityRow("llm_top1", top1, 0.0, "min"))
    rows.append(QualityRow("llm_kl_max", kl_max, float("inf"), "max"))
    return rows
