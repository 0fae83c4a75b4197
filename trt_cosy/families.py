"""What ``CosyVoice`` (``trt_cosy.tts``) does differently per model family: CosyVoice 1, 2 and 3.

numpy only. For each family: the text tokenizer, the voice builder, the stages, the request class,
the LLM prompt of each official mode (spec §2.4), how a voice is checked and how long one segment
may speak.

Decisions (where the official code leaves a choice):

* CosyVoice3 prompts must hold ``<|endofprompt|>`` (the official LLM asserts it). Zero-shot prompt
  text is ``"You are a helpful assistant.<|endofprompt|>" + transcript`` (the layout of the official
  examples); cross-lingual voices give the LLM ``"You are a helpful assistant.<|endofprompt|>"`` alone
  (the official examples put it in front of the text to speak, which gives the same LLM sequence);
  instructions become ``"You are a helpful assistant. " + instruction + "<|endofprompt|>"``. Texts that
  already contain the marker are used as given.
* CosyVoice-300M-Instruct instructions end with ``<endofprompt>`` (no bars), the form that model was
  trained with (the official frontend appended it until 2025-12; since then callers write
  ``<|endofprompt|>``, which the whisper tokenizer splits into ordinary BPE pieces). An instruction
  that already ends with either marker is used as given; otherwise it is normalised (as the old
  frontend did) and ``<endofprompt>`` is appended.
* CosyVoice2 instructions (``instruct2``) are not normalised; ``<|endofprompt|>`` is appended when
  missing (the official frontend did this until 2025-12).
* CosyVoice 1 prompt mels are computed from the reference resampled to 22.05 kHz, the model's rate
  (official releases before 2025-12 did so too); the current official frontend loads the prompt at
  24 kHz for every family, which for v1 feeds 24 kHz samples into 22.05 kHz mel settings
  (golden README §8.5 quirk 5). v1 prompts are not trimmed (the length regulator interpolates).
* Longest segment: CosyVoice2 as far as the fixed CFM noise goes (300 s); CosyVoice3 also as far as
  the fixed HiFT noise the engines carry (60 s); CosyVoice 1 (fresh noise, one flow call on the
  whole segment when not streaming) at most ``V1_MAX_SEGMENT_SECONDS``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Final

import numpy as np

from .errors import InputError
from .frontend.tokenizer import ENDOFPROMPT, QwenTextTokenizer, special_tokens_for
from .frontend.tokenizer_v1 import WhisperTextTokenizer
from .frontend.voice import Voice, VoiceBuilder
from .pipeline import Request, Stages
from .pipeline_families import V1Request, V1Stages, V3Request, V3Stages
from .runtime.base import Runner
from .runtime.graphs_v1 import V1_FLOW_ENCODER, V1_FLOW_ESTIMATOR, V1_HIFT, V1_LLM, V1_TEXT_ENCODER
from .runtime.model import LoadedModel
from .stages.flow import FlowStage, device_euler_loops
from .stages.llm import LLMStage
from .stages.v1 import V1FlowStage, V1LLMStage, V1Synthesizer
from .stages.v3 import V3VocoderStage
from .stages.vocoder import VocoderStage
from .synthesis import LLMPrompt

__all__ = [
    "SPEECH_TOKENIZER_FILES",
    "V3_SYSTEM_PROMPT",
    "V1_INSTRUCT_MARKER",
    "V1_MAX_SEGMENT_SECONDS",
    "V1TextTokenizer",
    "V1VoiceBuilder",
    "load_text_tokenizer",
    "make_voice_builder",
    "build_stages",
    "request_class",
    "prompt_text_for_voice",
    "instruct_text",
    "llm_prompt_for",
    "check_voice",
    "speech_budget",
]

_LOGGER = logging.getLogger(__name__)

SPEECH_TOKENIZER_FILES: Final = {
    "v1": "speech_tokenizer_v1.onnx",
    "v2": "speech_tokenizer_v2.onnx",
    "v3": "speech_tokenizer_v3.onnx",
}
V3_SYSTEM_PROMPT: Final = "You are a helpful assistant."
V1_INSTRUCT_MARKER: Final = "<endofprompt>"
V1_MAX_SEGMENT_SECONDS: Final = 60  # speech per segment, as the official TensorRT flow profiles allow
_TOKENIZER_MEL_BINS: Final = 128


class V1TextTokenizer(WhisperTextTokenizer):
    """``WhisperTextTokenizer`` with the ``count_tokens`` the text normaliser needs."""

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))


def load_text_tokenizer(family: str, tokenizer_dir: Path) -> QwenTextTokenizer | V1TextTokenizer:
    """The text tokenizer carried by the engines (``tokenizer/``): whisper ranks (v1) or Qwen2 (v2/v3).

    v2 and v3 share the Qwen2 files but add different special tokens (``special_tokens_for``).
    """
    if family == "v1":
        return V1TextTokenizer(Path(tokenizer_dir))
    return QwenTextTokenizer.from_dir(tokenizer_dir, special_tokens_for(family))


class V1VoiceBuilder(VoiceBuilder):
    """CosyVoice 1 voices: 50 Hz speech tokens and a 22.05 kHz prompt mel, not trimmed to each other."""

    def _pair_prompt(self, tokens: np.ndarray, mel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return tokens, mel  # [1, n], [1, T, 80]: the official v1 frontend keeps both whole


def make_voice_builder(
    model: LoadedModel, lazy_runner: Callable[[str, str], Runner], model_id: str
) -> VoiceBuilder:
    """The voice builder of the model's family; ``lazy_runner(file name, graph name)`` opens a frontend model."""
    config = model.config
    campplus = lazy_runner("campplus.onnx", "campplus")
    tokenizer = lazy_runner(SPEECH_TOKENIZER_FILES[config.family], "speech_tokenizer")
    if config.family == "v1":
        return V1VoiceBuilder(campplus, tokenizer, config.mel, 1, model_id=model_id)
    return VoiceBuilder(campplus, tokenizer, config.mel, config.token_mel_ratio, model_id=model_id)


def _llm_stage(model: LoadedModel, slots: int | None, positions: int | None) -> LLMStage:
    """``BatchedLLMStage`` over the ``llm_batch`` graph when the engines have it and batching is on."""
    runners, config = model.runners, model.config
    from .runtime.ort import LazyOrtRunner, OrtRunner

    batch_runner = runners.get("llm_batch")
    if not isinstance(batch_runner, (OrtRunner, LazyOrtRunner)):
        batch_runner = None  # the batched decoder binds ONNX Runtime buffers; wrapped runners decode alone
    if batch_runner is None or slots == 0:
        if "llm_batch" not in runners and slots != 0 and model.backend == "onnxruntime":
            _LOGGER.info(
                "these engines have no llm_batch.onnx: concurrent requests decode one at a time; rebuild them "
                "(`trt-cosy build --force ...`) for continuous batching"
            )
        return LLMStage(runners["llm"], model.llm_tables, config.llm)
    from .stages.llm_batch import DEFAULT_POSITIONS, DEFAULT_SLOTS, BatchedLLMStage

    return BatchedLLMStage(
        runners["llm"],
        batch_runner,
        model.llm_tables,
        config.llm,
        slots=DEFAULT_SLOTS if slots is None else slots,
        positions=DEFAULT_POSITIONS if positions is None else positions,
    )


def build_stages(
    model: LoadedModel, llm_slots: int | None = None, llm_slot_positions: int | None = None
) -> Stages | V1Stages | V3Stages:
    """The stateless stages of the model's family over its runners and tables.

    CosyVoice2/3 engines with the batched decode graph get a ``BatchedLLMStage`` (one decode loop
    shared by all requests, ``llm_slots`` KV slots; ``EngineConfig.llm_slots``) unless
    ``llm_slots`` is 0; everything else decodes each request alone.
    """
    config, runners = model.config, model.runners
    if config.family == "v1":
        flow = V1FlowStage(
            runners[V1_FLOW_ENCODER.name],
            runners[V1_FLOW_ESTIMATOR.name],
            config.flow,
            overlap_frames=config.stream.mel_overlap_len,
        )
        llm = V1LLMStage(runners[V1_TEXT_ENCODER.name], runners[V1_LLM.name], model.llm_tables, config.llm)
        return V1Stages(llm=llm, synthesizer=V1Synthesizer(flow, runners[V1_HIFT.name], config))
    llm = _llm_stage(model, llm_slots, llm_slot_positions)
    flow = FlowStage(
        runners["flow_encoder"],
        runners["flow_estimator"],
        runners["flow_estimator_stream"],
        model.flow_noise,
        config.flow,
        step_loops=device_euler_loops(runners, config.flow),  # TensorRT step plans, when built
    )
    if config.family == "v3":
        vocoder = V3VocoderStage(runners["hift"], runners["hift_stream"], model.hift_noise, config.hift)
        return V3Stages(llm=llm, flow=flow, vocoder=vocoder)
    return Stages(llm=llm, flow=flow, vocoder=VocoderStage(runners["hift"], config.hift))


def request_class(family: str) -> type[Request]:
    return {"v1": V1Request, "v3": V3Request}.get(family, Request)


def prompt_text_for_voice(family: str, transcript: str) -> str:
    """The prompt text of a zero-shot voice: CosyVoice3 puts the system prompt and marker in front."""
    if family == "v3" and ENDOFPROMPT not in transcript:
        return f"{V3_SYSTEM_PROMPT}{ENDOFPROMPT}{transcript}"
    return transcript


def instruct_text(family: str, instruct: str, normalize: Callable[[str], str]) -> str:
    """The instruction as the LLM's prompt text, with the family's end-of-prompt marker (see above)."""
    instruct = instruct.strip()
    if family == "v1":
        if instruct.endswith((V1_INSTRUCT_MARKER, ENDOFPROMPT)):
            return instruct
        return normalize(instruct) + V1_INSTRUCT_MARKER
    if ENDOFPROMPT in instruct:
        return instruct
    if family == "v3" and not instruct.startswith(V3_SYSTEM_PROMPT):
        instruct = f"{V3_SYSTEM_PROMPT} {instruct}"
    return instruct + ENDOFPROMPT


def llm_prompt_for(
    family: str, voice: Voice, instruct_ids: np.ndarray | None, encode: Callable[[str], list[int]]
) -> LLMPrompt:
    """What the LLM gets besides the text for ``voice`` (and an instruction), spec §2.4.

    A voice without speech tokens is a preset speaker (CosyVoice 1 SFT). ``encode`` tokenizes the
    CosyVoice3 system prompt when the voice has no transcript.
    """
    empty = np.zeros(0, np.int64)
    has_text = voice.prompt_text_ids.size > 0
    text_ids = voice.prompt_text_ids.astype(np.int64) if has_text else empty
    speech_ids = voice.speech_tokens.astype(np.int64) if has_text else empty
    if family == "v1":
        if instruct_ids is not None:
            if voice.speech_tokens.size:
                raise InputError(
                    "CosyVoice-300M-Instruct takes an instruction with a preset speaker (voice='NAME', "
                    "`trt-cosy say --speaker NAME`), not with a reference voice."
                )
            return LLMPrompt(instruct_ids.astype(np.int64), empty, None)  # no spk row (official)
        return LLMPrompt(text_ids, speech_ids, voice.speaker_embedding[None].astype(np.float32))
    if instruct_ids is not None:  # instruct2: zero-shot with the instruction as prompt text, no prompt speech
        return LLMPrompt(instruct_ids.astype(np.int64), empty)
    if family == "v3" and not (has_text and ENDOFPROMPT in voice.prompt_text):
        system = np.asarray(encode(V3_SYSTEM_PROMPT + ENDOFPROMPT), np.int64)  # [Ns]
        return LLMPrompt(np.concatenate([system, text_ids]), speech_ids)
    return LLMPrompt(text_ids, speech_ids)


def check_voice(model: LoadedModel, voice: Voice) -> None:
    """``InputError`` unless the voice's arrays fit the model (rate, embedding, prompt lengths)."""
    config = model.config
    embed_dim = config.flow.spk_embed_dim
    mels = config.mel.num_mels
    if config.family == "v1":
        tokens, frames = voice.speech_tokens.shape[0], voice.prompt_mel.shape[0]
        fits = voice.prompt_mel.shape[1] == mels and (tokens == 0) == (frames == 0)
    else:
        fits = voice.prompt_mel.shape == (voice.speech_tokens.shape[0] * config.token_mel_ratio, mels)
    if voice.sample_rate != config.sample_rate or voice.speaker_embedding.shape != (embed_dim,) or not fits:
        raise InputError(
            f"the voice does not fit this model ({voice.sample_rate} Hz, embedding "
            f"{voice.speaker_embedding.shape}, prompt mel {voice.prompt_mel.shape}); make it again with "
            "this model (`trt-cosy voices save`)."
        )


def speech_budget(model: LoadedModel, voice: Voice) -> int:
    """The most speech tokens one segment may get for this voice (the engines' fixed noise, or v1's cap)."""
    config = model.config
    prompt_tokens = voice.speech_tokens.shape[0]
    if config.family == "v1":
        return max(0, V1_MAX_SEGMENT_SECONDS * config.token_frame_rate - prompt_tokens)
    budget = model.flow_noise.shape[2] // config.token_mel_ratio - prompt_tokens
    if config.family == "v3":
        hift_frames = model.hift_noise.shape[1] // config.hift.samples_per_frame
        budget = min(budget, hift_frames // config.token_mel_ratio)
    return max(0, budget)
