"""Fun-CosyVoice3 (``cosyvoice3.yaml``): CosyVoice2's LLM and flow stages on the v3 graphs.

What differs from CosyVoice2 (``models.v2.family``): the LLM vocabulary (200 speech specials),
the DiT flow (no attention before the estimator), the causal HiFT with the engines' fixed NSF
buffer (``V3VocoderStage``), silent-token filtering (``V3Request``) and the prompts:

* prompts must hold ``<|endofprompt|>`` (the official LLM asserts it). Zero-shot prompt text is
  ``"You are a helpful assistant.<|endofprompt|>" + transcript`` (the layout of the official
  examples); cross-lingual voices give the LLM ``"You are a helpful assistant.<|endofprompt|>"``
  alone (the official examples put it in front of the text to speak, which gives the same LLM
  sequence); instructions become ``"You are a helpful assistant. " + instruction + "<|endofprompt|>"``.
  Texts that already contain the marker are used as given.
* Longest segment: as far as the fixed CFM noise and the fixed HiFT noise (60 s) both go.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from ...errors import InputError
from ...frontend.tokenizer import COSYVOICE3_SPECIAL_TOKENS, ENDOFPROMPT
from ...frontend.voice import Voice
from ...pipeline import Request
from ...runtime.graphs import GraphSpec
from ...runtime.model import LoadedModel
from ...stages.bistream import BistreamPrompt, BistreamSpecials
from ...stages.flow import FlowStage
from ...stages.llm import LLMStage
from ...synthesis import LLMPrompt
from ..v2.family import V2Family, V2QualityFeeds
from . import graphs as graphs_v3
from .config import V3_YAML, V3ModelConfig, v3_config_from_release_dir
from .graphs import GRAPHS_V3
from .profiles import v3_profiles
from .request import V3Request, V3Stages
from .stages import V3VocoderStage
from .verify import run_flow_v3, run_hift_v3, run_llm_v3

__all__ = ["V3_SYSTEM_PROMPT", "V3Family"]

V3_SYSTEM_PROMPT: Final = "You are a helpful assistant."


class V3QualityFeeds(V2QualityFeeds):
    """CosyVoice2's LLM and flow feeds; the vocoder runs ``V3VocoderStage`` on the fixed NSF buffer."""

    def vocoder_draws(self, model: LoadedModel, frames: int, seed: int) -> dict[str, np.ndarray]:
        # the fixed NSF buffer prefix: the engines' own, identical in an fp32 and a derived directory
        return {"sine_noise": np.asarray(model.hift_noise, np.float32)}

    def wav(self, model: LoadedModel, mel: np.ndarray, draws: dict[str, np.ndarray]) -> np.ndarray:
        runners = model.runners
        vocoder = V3VocoderStage(runners["hift"], runners["hift_stream"], draws["sine_noise"], model.config.hift)
        return vocoder.vocode(mel, final=True)["wav"]


class V3Family(V2Family):
    """Fun-CosyVoice3-0.5B."""

    name = "v3"
    build_family = "trt_cosy.models.v3.export.family:V3BuildFamily"
    title = "CosyVoice3"
    release_name = "Fun-CosyVoice3"
    yaml_name = V3_YAML
    speech_tokenizer_file = "speech_tokenizer_v3.onnx"
    config_class = V3ModelConfig
    request_class: type[Request] = V3Request
    fixed_hift_noise = True
    incremental_estimator = "dit"
    openvino_incremental = False  # its DiT's incremental graph runs on ONNX Runtime only
    quality = V3QualityFeeds()
    # The DiT's estimators: int8 MatMuls plus 8-bit weight-only modulation weights; both causal HiFTs.
    quantized_graphs = (
        V2Family.quantized_graphs
        | dict.fromkeys((graphs_v3.FLOW_ESTIMATOR.name, graphs_v3.FLOW_ESTIMATOR_STREAM.name), "dit")
        | dict.fromkeys((graphs_v3.HIFT_V3.name, graphs_v3.HIFT_V3_STREAM.name), "vocoder")
    )
    profile_builder = staticmethod(v3_profiles)
    int8_estimator_graphs: Mapping[str, str] = {}  # the DiT has no middle blocks
    # Both causal HiFTs, calibrated by the whole-utterance graph's feeds (the streaming one takes the same inputs).
    int8_vocoder_graphs = {graphs_v3.HIFT_V3.name: graphs_v3.HIFT_V3.name, graphs_v3.HIFT_V3_STREAM.name: graphs_v3.HIFT_V3.name}
    text_special_tokens = COSYVOICE3_SPECIAL_TOKENS

    text_streaming = True

    def bistream_prompt(
        self, config: V3ModelConfig, prompt: LLMPrompt, token_to_id: Callable[[str], int | None]
    ) -> BistreamPrompt:
        """CosyVoice3LM: the prompt text through ``<|endofprompt|>`` follows sos, the rest starts the text
        cache (the official code asserts the marker); fill is ``speech_token_size + 3``, eos ``+ 1``."""
        text_ids = np.asarray(prompt.text_ids, np.int64).reshape(-1)
        marker = token_to_id(ENDOFPROMPT)
        hits = np.flatnonzero(text_ids == marker) if marker is not None else np.zeros(0, np.int64)
        if hits.size == 0:
            raise InputError(
                f"streamed text needs {ENDOFPROMPT} in a CosyVoice3 prompt (the official LLM asserts it); "
                "make the voice with a transcript or pass an instruction."
            )
        cut = int(hits[0]) + 1
        size = config.llm.speech_token_size
        return BistreamPrompt(
            head_ids=text_ids[:cut],
            text_ids=text_ids[cut:],
            speech_ids=np.asarray(prompt.speech_ids, np.int64).reshape(-1),
            specials=BistreamSpecials(fill=size + 3, eos=config.real_eos_token, masked=size),
            mix=config.llm.mix_ratio,
        )

    @property
    def graphs(self) -> Mapping[str, GraphSpec]:
        return GRAPHS_V3

    def read_config(self, model_dir: Path) -> V3ModelConfig:
        return v3_config_from_release_dir(model_dir)

    def _stages(self, model: LoadedModel, llm: LLMStage, flow: FlowStage) -> Any:
        runners = model.runners
        vocoder = V3VocoderStage(runners["hift"], runners["hift_stream"], model.hift_noise, model.config.hift)
        return V3Stages(llm=llm, flow=flow, vocoder=vocoder)

    def prompt_text_for_voice(self, transcript: str) -> str:
        """The system prompt and marker go in front of a transcript that has no marker."""
        if ENDOFPROMPT not in transcript:
            return f"{V3_SYSTEM_PROMPT}{ENDOFPROMPT}{transcript}"
        return transcript

    def _instruct_prefix(self, instruct: str) -> str:
        if not instruct.startswith(V3_SYSTEM_PROMPT):
            return f"{V3_SYSTEM_PROMPT} {instruct}"
        return instruct

    def _system_ids(self, voice: Voice, has_text: bool, encode: Callable[[str], list[int]]) -> np.ndarray:
        if not (has_text and ENDOFPROMPT in voice.prompt_text):
            return np.asarray(encode(V3_SYSTEM_PROMPT + ENDOFPROMPT), np.int64)  # [Ns]
        return np.zeros(0, np.int64)

    def speech_budget(self, model: LoadedModel, voice: Voice) -> int:
        """CosyVoice2's budget, capped by the engines' fixed HiFT noise."""
        config = model.config
        budget = model.flow_noise.shape[2] // config.token_mel_ratio - voice.speech_tokens.shape[0]
        hift_frames = model.hift_noise.shape[1] // config.hift.samples_per_frame
        return max(0, min(budget, hift_frames // config.token_mel_ratio))

    @property
    def verify_drivers(self) -> tuple[Callable[..., dict[str, Any]], ...]:
        return (run_llm_v3, run_flow_v3, run_hift_v3)
