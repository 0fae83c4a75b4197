"""CosyVoice 1 (``cosyvoice.yaml``: CosyVoice-300M, -SFT, -Instruct).

Its own LLM (text encoder + transformer LM with a speaker row), flow (length regulator, fresh
CFM noise per call), HiFT (SineGen draws on the host) and request schedule (``V1Request``).

* Instructions (CosyVoice-300M-Instruct) end with ``<endofprompt>`` (no bars), the form that model
  was trained with (the official frontend appended it until 2025-12; since then callers write
  ``<|endofprompt|>``, which the whisper tokenizer splits into ordinary BPE pieces). An instruction
  that already ends with either marker is used as given; otherwise it is normalised (as the old
  frontend did) and ``<endofprompt>`` is appended. An instruction goes with a preset speaker.
* Prompt mels are computed from the reference resampled to 22.05 kHz, the model's rate (official
  releases before 2025-12 did so too); the current official frontend loads the prompt at 24 kHz for
  every family, which for v1 feeds 24 kHz samples into 22.05 kHz mel settings (golden README §8.5
  quirk 5). Prompts are not trimmed (the length regulator interpolates).
* Longest segment: fresh noise, one flow call on the whole segment when not streaming, so at most
  ``V1_MAX_SEGMENT_SECONDS`` (as the official TensorRT flow profiles allow).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from ...errors import InputError
from ...frontend.tokenizer import ENDOFPROMPT
from ...frontend.voice import Voice, VoiceBuilder
from ...pipeline import Request
from ...runtime.backends.base import Runner
from ...runtime.graphs import GraphSpec
from ...runtime.model import LoadedModel
from ...synthesis import LLMPrompt
from ..family import Family, QualityFeeds
from .config import V1ModelConfig, v1_config_from_release_dir
from .graphs import V1_FLOW_ENCODER, V1_FLOW_ESTIMATOR, V1_GRAPHS, V1_HIFT, V1_LLM, V1_TEXT_ENCODER
from .profiles import v1_profiles
from .request import V1Request, V1Stages
from .stages import RandomDraws, V1FlowStage, V1LLMStage, V1Synthesizer
from .tokenizer import WhisperTextTokenizer
from .verify import run_flow_v1, run_hift_v1, run_llm_v1

__all__ = ["V1_INSTRUCT_MARKER", "V1_MAX_SEGMENT_SECONDS", "V1TextTokenizer", "V1VoiceBuilder", "V1Family"]

V1_INSTRUCT_MARKER: Final = "<endofprompt>"
V1_MAX_SEGMENT_SECONDS: Final = 60  # speech per segment, as the official TensorRT flow profiles allow


class V1TextTokenizer(WhisperTextTokenizer):
    """``WhisperTextTokenizer`` with the ``count_tokens`` the text normaliser needs."""

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))


class V1VoiceBuilder(VoiceBuilder):
    """CosyVoice 1 voices: 50 Hz speech tokens and a 22.05 kHz prompt mel, not trimmed to each other."""

    def _pair_prompt(self, tokens: np.ndarray, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return tokens, mel  # [1, n], [1, T, 80]: the official v1 frontend keeps both whole


class V1QualityFeeds(QualityFeeds):
    """The quality guard on the v1 host stages: ``V1LLMStage`` (speaker row included), ``V1FlowStage``
    with seeded fresh CFM noise and ``V1_HIFT`` with seeded SineGen draws."""

    def random_vocab_and_prompt_frames(self, config: Any) -> tuple[int, int]:
        return config.llm.text_token_size, config.flow.mel_frames(50)

    def llm_logits(self, model: LoadedModel, inputs: Any) -> np.ndarray:
        runners, speech = model.runners, np.concatenate([inputs.prompt_speech, inputs.target_speech])
        # zero-shot layout: [sos, spk, text_enc(text), task, speech]
        stage = V1LLMStage(runners[V1_TEXT_ENCODER.name], runners["llm"], model.llm_tables, model.config.llm)
        lm_input = stage.build_inputs(inputs.text, inputs.prompt_text, speech, inputs.embedding)  # [1, L, D]
        logits, _ = stage.teacher_forced(lm_input)  # [1, L, V]
        return logits[0]

    def mel(self, model: LoadedModel, inputs: Any, seed: int) -> np.ndarray:
        runners = model.runners  # fresh CFM noise per call: the same seeded draw for both models
        flow = V1FlowStage(runners[V1_FLOW_ENCODER.name], runners[V1_FLOW_ESTIMATOR.name], model.config.flow)
        draws = RandomDraws(np.random.default_rng(seed), mel_bins=model.config.flow.output_size)
        empty_cache = np.zeros((1, model.config.flow.output_size, 0, 2), np.float32)
        return flow.token2mel(
            inputs.target_speech[None],
            inputs.prompt_speech[None],
            inputs.prompt_feat,
            inputs.embedding,
            empty_cache,
            draws,
        ).mel  # [1, 80, F]

    def vocoder_draws(self, model: LoadedModel, frames: int, seed: int) -> dict[str, np.ndarray]:
        """SineGen noise [1, S, H + 1] and phases [1, H + 1]."""
        hift = model.config.hift
        samples = frames * hift.samples_per_frame
        rng = np.random.default_rng(seed)
        draws = {"sine_noise": rng.standard_normal((1, samples, hift.nb_harmonics + 1), dtype=np.float32)}
        draws["rand_phase"] = rng.random((1, hift.nb_harmonics + 1), dtype=np.float32)
        return draws

    def wav(self, model: LoadedModel, mel: np.ndarray, draws: dict[str, np.ndarray]) -> np.ndarray:
        feed = dict(draws, mel=np.ascontiguousarray(mel, np.float32), cache_source=np.zeros((1, 1, 0), np.float32))
        return model.runners[V1_HIFT.name].infer(feed)["wav"]


class V1Family(Family):
    """CosyVoice-300M, -SFT and -Instruct."""

    name = "v1"
    build_family = "trt_cosy.models.v1.export.family:V1BuildFamily"
    title = "CosyVoice 1 (300M)"
    yaml_name = "cosyvoice.yaml"
    speech_tokenizer_file = "speech_tokenizer_v1.onnx"
    config_class = V1ModelConfig
    request_class: type[Request] = V1Request
    qwen_llm = False  # whisper ranks (multilingual.tiktoken) and its own transformer LM
    stream_schedules = ("official",)  # its own hop schedule; no cheaper option
    trt_step_graphs = False  # its own flow stage (V1FlowStage) runs the estimator plan per step
    fixed_flow_noise = False  # v1 draws fresh CFM noise per call
    quality = V1QualityFeeds()
    instructs_any_voice = False
    quantized_graphs = {V1_LLM.name: "llm", V1_FLOW_ESTIMATOR.name: "estimator", V1_HIFT.name: "vocoder"}
    profile_builder = staticmethod(v1_profiles)

    @property
    def graphs(self) -> Mapping[str, GraphSpec]:
        return V1_GRAPHS

    def read_config(self, model_dir: Path) -> V1ModelConfig:
        return v1_config_from_release_dir(model_dir)

    def load_text_tokenizer(self, tokenizer_dir: Path) -> V1TextTokenizer:
        """Whisper's ``multilingual.tiktoken`` ranks."""
        return V1TextTokenizer(Path(tokenizer_dir))

    def make_voice_builder(
        self, model: LoadedModel, lazy_runner: Callable[[str, str], Runner], model_id: str
    ) -> VoiceBuilder:
        campplus = lazy_runner("campplus.onnx", "campplus")
        tokenizer = lazy_runner(self.speech_tokenizer_file, "speech_tokenizer")
        return V1VoiceBuilder(campplus, tokenizer, model.config.mel, 1, model_id=model_id)

    def build_stages(
        self, model: LoadedModel, llm_slots: int | None = None, llm_slot_positions: int | None = None
    ) -> V1Stages:
        # No batched decode graph for the v1 LM (no GroupQueryAttention): each request decodes alone.
        config, runners = model.config, model.runners
        flow = V1FlowStage(
            runners[V1_FLOW_ENCODER.name],
            runners[V1_FLOW_ESTIMATOR.name],
            config.flow,
            overlap_frames=config.stream.mel_overlap_len,
        )
        llm = V1LLMStage(runners[V1_TEXT_ENCODER.name], runners[V1_LLM.name], model.llm_tables, config.llm)
        return V1Stages(llm=llm, synthesizer=V1Synthesizer(flow, runners[V1_HIFT.name], config))

    def instruct_text(self, instruct: str, normalize: Callable[[str], str]) -> str:
        instruct = instruct.strip()
        if instruct.endswith((V1_INSTRUCT_MARKER, ENDOFPROMPT)):
            return instruct
        return normalize(instruct) + V1_INSTRUCT_MARKER

    def llm_prompt(
        self, voice: Voice, instruct_ids: np.ndarray | None, encode: Callable[[str], list[int]]
    ) -> LLMPrompt:
        """A voice without speech tokens is a preset speaker (CosyVoice 1 SFT)."""
        empty = np.zeros(0, np.int64)
        if instruct_ids is not None:
            if voice.speech_tokens.size:
                raise InputError(
                    "CosyVoice-300M-Instruct takes an instruction with a preset speaker (voice='NAME', "
                    "`trt-cosy say --speaker NAME`), not with a reference voice."
                )
            return LLMPrompt(instruct_ids.astype(np.int64), empty, None)  # no spk row (official)
        has_text = voice.prompt_text_ids.size > 0
        text_ids = voice.prompt_text_ids.astype(np.int64) if has_text else empty
        speech_ids = voice.speech_tokens.astype(np.int64) if has_text else empty
        return LLMPrompt(text_ids, speech_ids, voice.speaker_embedding[None].astype(np.float32))

    def voice_fits(self, config: Any, voice: Voice) -> bool:
        tokens, frames = voice.speech_tokens.shape[0], voice.prompt_mel.shape[0]
        return voice.prompt_mel.shape[1] == config.mel.num_mels and (tokens == 0) == (frames == 0)

    def speech_budget(self, model: LoadedModel, voice: Voice) -> int:
        config = model.config
        return max(0, V1_MAX_SEGMENT_SECONDS * config.token_frame_rate - voice.speech_tokens.shape[0])

    @property
    def verify_drivers(self) -> tuple[Callable[..., dict[str, Any]], ...]:
        return (run_llm_v1, run_flow_v1, run_hift_v1)
