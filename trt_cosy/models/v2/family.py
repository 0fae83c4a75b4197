"""CosyVoice2 (``cosyvoice2.yaml``): the Qwen2 LLM, the causal conformer flow and HiFT.

The reference family: CosyVoice3 (``models.v3.family``) derives from it and changes the LLM
vocabulary, the flow encoder, the vocoder and the prompts. Spec §2.4 for the prompt layout.

* Instructions (``instruct2``) are not normalised; ``<|endofprompt|>`` is appended when missing
  (the official frontend did this until 2025-12).
* Longest segment: as far as the engines' fixed CFM noise goes (300 s).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from ...config import ModelConfig
from ...frontend.tokenizer import COSYVOICE2_SPECIAL_TOKENS, ENDOFPROMPT, QwenTextTokenizer
from ...frontend.voice import Voice
from ...pipeline import Request, Stages
from ...runtime import graphs
from ...runtime.graphs import GraphSpec
from ...runtime.model import LoadedModel
from ...stages.bistream import BistreamPrompt, BistreamSpecials
from ...stages.flow import FlowStage, device_euler_loops, device_incremental_loop
from ...stages.llm import LLMStage
from ...stages.vocoder import VocoderStage
from ...synthesis import LLMPrompt
from ...verify.stages import run_flow, run_hift, run_llm
from ..family import Family, QualityFeeds
from .config import V2_YAML, v2_config_from_release_dir
from .profiles import v2_profiles

_LOGGER = logging.getLogger(__name__)

__all__ = ["V2Family", "V2QualityFeeds"]

# Text positions of the LLM input besides the speech tokens: the segment (at most ~375 text tokens
# when the speech budget is 7500 tokens at 20 per text token), the voice's transcript, the specials.
_TEXT_POSITIONS: Final = 512


def _slot_positions(model: LoadedModel) -> int:
    """KV positions per slot that cover the longest segment the engines accept: the speech tokens the
    flow noise covers (prompt + new) plus ``_TEXT_POSITIONS``. The slots reserve them as address space
    only; pages are committed as a row fills and given back when it leaves (``KVSlots.release``), so
    long segments decode in the batch instead of alone (docs/benchmarks.md, "Memory at full size")."""
    from ...stages.llm_batch import DEFAULT_POSITIONS

    frames = model.flow_noise.shape[2] if model.flow_noise is not None else 0
    return max(DEFAULT_POSITIONS, frames // model.config.flow.token_mel_ratio + _TEXT_POSITIONS)


class V2QualityFeeds(QualityFeeds):
    """The quality guard on the CosyVoice2 stages (``LLMStage``, ``FlowStage``, ``VocoderStage``)."""

    def random_vocab_and_prompt_frames(self, config: Any) -> tuple[int, int]:
        return config.llm.qwen.vocab_size, config.token_mel_ratio * 50

    def llm_logits(self, model: LoadedModel, inputs: Any) -> np.ndarray:
        speech = np.concatenate([inputs.prompt_speech, inputs.target_speech])
        stage = LLMStage(model.runners["llm"], model.llm_tables, model.config.llm)
        lm_input = stage.build_inputs(inputs.text, inputs.prompt_text, speech)  # [1, L, D]
        logits, _ = stage.teacher_forced(lm_input)  # [1, L, V]
        return logits[0]

    def mel(self, model: LoadedModel, inputs: Any, seed: int) -> np.ndarray:
        runners = model.runners
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

    def vocoder_draws(self, model: LoadedModel, frames: int, seed: int) -> dict[str, np.ndarray]:
        hift = model.config.hift
        samples = frames * hift.samples_per_frame
        rng = np.random.default_rng(seed)
        return {"sine_noise": rng.standard_normal((1, samples, hift.nb_harmonics + 1), dtype=np.float32)}

    def wav(self, model: LoadedModel, mel: np.ndarray, draws: dict[str, np.ndarray]) -> np.ndarray:
        return VocoderStage(model.runners["hift"], model.config.hift).render(mel, draws["sine_noise"])


class V2Family(Family):
    """CosyVoice2-0.5B."""

    name = "v2"
    build_family = "trt_cosy.models.v2.export.family:V2BuildFamily"
    title = "CosyVoice2"
    release_name = "CosyVoice2"
    yaml_name = V2_YAML
    speech_tokenizer_file = "speech_tokenizer_v2.onnx"
    config_class = ModelConfig
    request_class: type[Request] = Request
    incremental_estimator = "unet"
    openvino_incremental = True
    quality = V2QualityFeeds()
    quantized_graphs = {graphs.LLM.name: "llm", graphs.HIFT.name: "vocoder"} | dict.fromkeys(
        (graphs.FLOW_ESTIMATOR.name, graphs.FLOW_ESTIMATOR_STREAM.name), "estimator"
    )
    profile_builder = staticmethod(v2_profiles)
    int8_estimator_graphs = {graphs.FLOW_ESTIMATOR.name: graphs.FLOW_ESTIMATOR.name}
    int8_vocoder_graphs = {graphs.HIFT.name: graphs.HIFT.name}
    text_special_tokens = COSYVOICE2_SPECIAL_TOKENS

    text_streaming = True

    def bistream_prompt(
        self, config: ModelConfig, prompt: LLMPrompt, token_to_id: Callable[[str], int | None]
    ) -> BistreamPrompt:
        """Qwen2LM: sos alone heads the sequence, the whole prompt text starts the text cache; fill is
        ``speech_token_size + 2``, eos ``speech_token_size``."""
        del token_to_id
        size = config.llm.speech_token_size
        return BistreamPrompt(
            head_ids=np.zeros(0, np.int64),
            text_ids=np.asarray(prompt.text_ids, np.int64).reshape(-1),
            speech_ids=np.asarray(prompt.speech_ids, np.int64).reshape(-1),
            specials=BistreamSpecials(fill=size + 2, eos=size, masked=size),
            mix=config.llm.mix_ratio,
        )

    @property
    def graphs(self) -> Mapping[str, GraphSpec]:
        return graphs.GRAPHS

    def read_config(self, model_dir: Path) -> ModelConfig:
        return v2_config_from_release_dir(model_dir)

    def load_text_tokenizer(self, tokenizer_dir: Path) -> QwenTextTokenizer:
        """The Qwen2 tokenizer files with the family's special tokens (``text_special_tokens``)."""
        return QwenTextTokenizer.from_dir(tokenizer_dir, self.text_special_tokens)

    def build_stages(
        self, model: LoadedModel, llm_slots: int | None = None, llm_slot_positions: int | None = None
    ) -> Any:
        config, runners = model.config, model.runners
        llm = self._llm_stage(model, llm_slots, llm_slot_positions)
        flow = FlowStage(
            runners["flow_encoder"],
            runners["flow_estimator"],
            runners["flow_estimator_stream"],
            model.flow_noise,
            config.flow,
            step_loops=device_euler_loops(runners, config.flow),  # TensorRT step plans, when built
            incremental_runner=runners.get(graphs.FLOW_ESTIMATOR_INCREMENTAL.name),
            incremental_loop=device_incremental_loop(runners, config.flow),  # TensorRT step plan
        )
        if flow.incremental_runner is None and model.backend in ("onnxruntime", "openvino", "mixed"):
            _LOGGER.info(
                "these engines have no %s graph: streaming chunks recompute the flow from the start; rebuild "
                "them (or add it with trt_cosy.builder.flow_incremental.add_incremental_estimator) for "
                "incremental chunks",
                graphs.FLOW_ESTIMATOR_INCREMENTAL.name,
            )
        return self._stages(model, llm, flow)

    @staticmethod
    def _llm_stage(model: LoadedModel, slots: int | None, positions: int | None) -> LLMStage:
        """``BatchedLLMStage`` over the ``llm_batch`` graph when the engines have it and batching is on."""
        from ...runtime.backends.onnxruntime.runner import LazyOrtRunner, OrtRunner
        from ...runtime.backends.tensorrt.runner import TrtRunner

        runners, config = model.runners, model.config
        decode_runner = runners.get("llm_decode")  # TensorRT engines: the plain-ONNX batched decode plan
        if decode_runner is not None and slots != 0 and isinstance(decode_runner, TrtRunner):
            from ...stages.llm_batch import DEFAULT_POSITIONS
            from ...stages.trt_llm_batch import TrtBatchedLLMStage

            stage, batched = TrtBatchedLLMStage, decode_runner
            positions = DEFAULT_POSITIONS if positions is None else positions
        else:
            from ...stages.llm_batch import BatchedLLMStage

            batched = runners.get("llm_batch")
            if not isinstance(batched, (OrtRunner, LazyOrtRunner)):
                batched = None  # the batched decoder binds ONNX Runtime buffers; wrapped runners decode alone
            if batched is None or slots == 0:
                if "llm_batch" not in runners and slots != 0 and model.backend == "onnxruntime":
                    _LOGGER.info(
                        "these engines have no llm_batch.onnx: concurrent requests decode one at a time; rebuild "
                        "them (`trt-cosy build --force ...`) for continuous batching"
                    )
                return LLMStage(runners["llm"], model.llm_tables, config.llm)
            stage = BatchedLLMStage
            positions = _slot_positions(model) if positions is None else positions
        from ...stages.llm_batch import DEFAULT_SLOTS

        return stage(
            runners["llm"],
            batched,
            model.llm_tables,
            config.llm,
            slots=DEFAULT_SLOTS if slots is None else slots,
            positions=positions,
        )

    def _stages(self, model: LoadedModel, llm: LLMStage, flow: FlowStage) -> Any:
        return Stages(llm=llm, flow=flow, vocoder=VocoderStage(model.runners["hift"], model.config.hift))

    def instruct_text(self, instruct: str, normalize: Callable[[str], str]) -> str:
        instruct = instruct.strip()
        if ENDOFPROMPT in instruct:
            return instruct
        return self._instruct_prefix(instruct) + ENDOFPROMPT

    def _instruct_prefix(self, instruct: str) -> str:
        return instruct

    def llm_prompt(
        self, voice: Voice, instruct_ids: np.ndarray | None, encode: Callable[[str], list[int]]
    ) -> LLMPrompt:
        empty = np.zeros(0, np.int64)
        if instruct_ids is not None:  # instruct2: zero-shot with the instruction as prompt text, no prompt speech
            return LLMPrompt(instruct_ids.astype(np.int64), empty)
        has_text = voice.prompt_text_ids.size > 0
        text_ids = voice.prompt_text_ids.astype(np.int64) if has_text else empty
        speech_ids = voice.speech_tokens.astype(np.int64) if has_text else empty
        system = self._system_ids(voice, has_text, encode)
        if system.size:
            text_ids = np.concatenate([system, text_ids])
        return LLMPrompt(text_ids, speech_ids)

    def _system_ids(self, voice: Voice, has_text: bool, encode: Callable[[str], list[int]]) -> np.ndarray:
        """Token ids in front of a zero-shot prompt text: none here (CosyVoice3 puts its system prompt)."""
        return np.zeros(0, np.int64)

    def speech_budget(self, model: LoadedModel, voice: Voice) -> int:
        """As far as the engines' fixed CFM noise goes, less the voice's prompt tokens."""
        budget = model.flow_noise.shape[2] // model.config.token_mel_ratio - voice.speech_tokens.shape[0]
        return max(0, budget)

    @property
    def verify_drivers(self) -> tuple[Callable[..., dict[str, Any]], ...]:
        return (run_llm, run_flow, run_hift)
