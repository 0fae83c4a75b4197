"""What a model family is to the rest of trt-cosy: the ``Family`` interface (numpy only).

One subclass per family, in ``trt_cosy/models/<name>/family.py``, holds everything that differs
between CosyVoice 1, 2 and 3 on the inference side; ``trt_cosy.family_lookup`` maps a release
directory, a model config or a manifest's ``family`` field to its instance. Shared code asks the
family object and never compares family names. The torch side (modules, export plans, reference
runner, test-model writer) is ``trt_cosy.builder.build_family.BuildFamily``.

A family object is stateless: one instance serves every model of the family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..errors import InputError
from ..frontend.voice import Voice, VoiceBuilder
from ..pipeline import Request
from ..runtime.backends.base import Runner
from ..runtime.graphs import GraphSpec
from ..runtime.model import LoadedModel
from ..stages.bistream import BistreamPrompt
from ..synthesis import LLMPrompt

__all__ = ["Family", "QualityFeeds"]


class QualityFeeds(ABC):
    """The quality guard's per-stage calls (``trt_cosy.verify.quality``) for one family.

    ``inputs`` is a ``bench.quality.QualityInputs``; every method runs the family's own host stages
    on ``model``'s runners, so the fp32 and the reduced-precision model see the same feeds.
    """

    @abstractmethod
    def random_vocab_and_prompt_frames(self, config: Any) -> tuple[int, int]:
        """(text vocabulary size, mel frames of a 50-token prompt) for seeded random inputs."""

    @abstractmethod
    def llm_logits(self, model: LoadedModel, inputs: Any) -> np.ndarray:
        """Teacher-forced next-token logits [L, V] of the quality sequence."""

    @abstractmethod
    def mel(self, model: LoadedModel, inputs: Any, seed: int) -> np.ndarray:
        """The flow's mel [1, 80, F] of the target tokens (seeded noise where the family draws it)."""

    @abstractmethod
    def vocoder_draws(self, model: LoadedModel, frames: int, seed: int) -> dict[str, np.ndarray]:
        """The vocoder's random inputs for ``frames`` mel frames, shared by both models."""

    @abstractmethod
    def wav(self, model: LoadedModel, mel: np.ndarray, draws: dict[str, np.ndarray]) -> np.ndarray:
        """One whole-utterance vocoder call on ``mel`` [1, 80, F]: the waveform [1, S]."""


class Family(ABC):
    """One CosyVoice model family: its files, config, graphs, stages, prompts and checks."""

    name: ClassVar[str]  # "v1", "v2", "v3": the ``family`` field of model_config.json and golden sets
    title: ClassVar[str]  # "CosyVoice2": how messages name it
    yaml_name: ClassVar[str]  # the release's yaml, which tells the family of a release directory
    speech_tokenizer_file: ClassVar[str]  # the frontend's speech tokenizer model in the release
    config_class: ClassVar[type]  # the dataclass ``read_config`` returns (rebuilt from model_config.json)
    request_class: ClassVar[type[Request]]  # per-request state and schedule (``pipeline.Request``)
    qwen_llm: ClassVar[bool] = True  # the LLM is Qwen2 (tokenizer from CosyVoice-BlankEN/, RMSNorm fusion)
    trt_step_graphs: ClassVar[bool] = True  # TensorRT flow step graphs (its flow runs ``stages.flow.FlowStage``)
    fixed_flow_noise: ClassVar[bool] = True  # the engines carry the official fixed CFM noise
    stream_schedules: ClassVar[tuple[str, ...]] = ("official", "fast")  # SynthesisConfig.stream_schedule values
    fixed_hift_noise: ClassVar[bool] = False
    # Instructions ("speak cheerfully") with any voice, cloned ones included (CosyVoice2/3's instruct2);
    # CosyVoice 1 instructs only its preset speakers (CosyVoice-300M-Instruct).
    instructs_any_voice: ClassVar[bool] = True  # the engines carry the causal HiFT's fixed NSF buffer
    # The incremental streaming estimator's kind ("unet": CosyVoice2's U-Net, "dit": CosyVoice3's DiT;
    # None: streaming recomputes), and whether OpenVINO/mixed engines carry it (built and tested for v2).
    incremental_estimator: ClassVar[str | None] = None
    # Its torch side (export, reference, test model): "module:Class" of a ``BuildFamily`` in
    # ``trt_cosy/models/<name>/export/``, imported lazily by ``builder.registry`` (the runtime stays torch-free).
    build_family: ClassVar[str]
    openvino_incremental: ClassVar[bool] = False
    quality: ClassVar[QualityFeeds]
    # The graphs int8/int4 engines reduce, by role ("llm", "estimator", "dit", "vocoder":
    # ``builder.quantize.engines.precision_plan`` picks each role's method); the others stay fp32.
    quantized_graphs: ClassVar[Mapping[str, str]]
    # ``profile_builder(config, limits)``: the family's TensorRT profiles (``models/<name>/profiles.py``).
    profile_builder: ClassVar[Callable[[Any, Any], list[Any]]]
    text_streaming: ClassVar[bool] = False  # text may arrive while it speaks (``bistream_prompt``)

    @property
    @abstractmethod
    def graphs(self) -> Mapping[str, GraphSpec]:
        """The graph contracts of the family's engines, keyed by graph name, in export order."""

    def trt_profiles(self, config: Any, limits: Any) -> list[Any]:
        """The TensorRT optimisation profiles (``runtime.profiles.GraphProfiles``) of the family's exported
        graphs under ``limits`` (``ProfileLimits``); ``runtime.profiles.default_profiles`` adds the step graphs'."""
        return type(self).profile_builder(config, limits)

    @property
    def frontend_files(self) -> tuple[str, ...]:
        """The release's frontend models the engines carry (speaker model, speech tokenizer)."""
        return ("campplus.onnx", self.speech_tokenizer_file)

    # --- reading ---------------------------------------------------------------------------------

    @abstractmethod
    def read_config(self, model_dir: Path) -> Any:
        """The model config of a release directory of this family (``ModelDirError`` when malformed)."""

    @abstractmethod
    def load_text_tokenizer(self, tokenizer_dir: Path) -> Any:
        """The text tokenizer the engines carry (``tokenizer/``)."""

    # --- building the engine --------------------------------------------------------------------

    def make_voice_builder(
        self, model: LoadedModel, lazy_runner: Callable[[str, str], Runner], model_id: str
    ) -> VoiceBuilder:
        """The voice builder; ``lazy_runner(file name, graph name)`` opens a frontend model."""
        config = model.config
        campplus = lazy_runner("campplus.onnx", "campplus")
        tokenizer = lazy_runner(self.speech_tokenizer_file, "speech_tokenizer")
        return VoiceBuilder(campplus, tokenizer, config.mel, config.token_mel_ratio, model_id=model_id)

    @abstractmethod
    def build_stages(
        self, model: LoadedModel, llm_slots: int | None = None, llm_slot_positions: int | None = None
    ) -> Any:
        """The stateless stages over the model's runners and tables, shared by its requests.

        ``llm_slots`` / ``llm_slot_positions``: the shared decode loop's KV slots and positions per
        slot (``EngineConfig``); families without a batched decode graph ignore them."""

    # --- one request ----------------------------------------------------------------------------

    def prompt_text_for_voice(self, transcript: str) -> str:
        """The prompt text of a zero-shot voice made from ``transcript``."""
        return transcript

    @abstractmethod
    def instruct_text(self, instruct: str, normalize: Callable[[str], str]) -> str:
        """The instruction as the LLM's prompt text, with the family's end-of-prompt marker."""

    @abstractmethod
    def llm_prompt(
        self, voice: Voice, instruct_ids: np.ndarray | None, encode: Callable[[str], list[int]]
    ) -> LLMPrompt:
        """What the LLM gets besides the text for ``voice`` (and an instruction), spec §2.4."""

    def bistream_prompt(
        self, config: Any, prompt: LLMPrompt, token_to_id: Callable[[str], int | None]
    ) -> BistreamPrompt:
        """The LLM prompt split for text that arrives while speaking (official ``inference_bistream``,
        ``stages.bistream``); ``InputError`` where the family has no such mode (``text_streaming``)."""
        raise InputError(
            f"{self.title} cannot take text while it speaks (the official code streams text into CosyVoice2 "
            "and CosyVoice3 only); pass the whole text as one str."
        )

    def voice_fits(self, config: Any, voice: Voice) -> bool:
        """Whether the voice's prompt arrays have the shapes this model's stages expect."""
        mels = config.mel.num_mels
        return voice.prompt_mel.shape == (voice.speech_tokens.shape[0] * config.token_mel_ratio, mels)

    def check_voice(self, model: LoadedModel, voice: Voice) -> None:
        """``InputError`` unless the voice's arrays fit the model (rate, embedding, prompt lengths)."""
        config = model.config
        embed_dim = config.flow.spk_embed_dim
        fits = self.voice_fits(config, voice)
        if voice.sample_rate != config.sample_rate or voice.speaker_embedding.shape != (embed_dim,) or not fits:
            raise InputError(
                f"the voice does not fit this model ({voice.sample_rate} Hz, embedding "
                f"{voice.speaker_embedding.shape}, prompt mel {voice.prompt_mel.shape}); make it again with "
                "this model (`trt-cosy voices save`)."
            )

    @abstractmethod
    def speech_budget(self, model: LoadedModel, voice: Voice) -> int:
        """The most speech tokens one segment may get for this voice."""

    # --- verify ---------------------------------------------------------------------------------

    @property
    @abstractmethod
    def verify_drivers(self) -> tuple[Callable[..., dict[str, Any]], ...]:
        """``trt-cosy verify``'s stage drivers: each ``(model, golden, skipped) -> outputs by golden key``."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ({self.title})>"

