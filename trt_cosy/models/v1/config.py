"""CosyVoice 1 (CosyVoice-300M / -SFT / -Instruct) configuration, read from ``cosyvoice.yaml``.

Numbers only; nothing is instantiated (docs/cosyvoice-spec §1.4). The flow estimator, CFM,
HiFT and mel settings reuse the CosyVoice2 dataclasses of ``trt_cosy.config``; the LLM (text
encoder + transformer LM) and the flow (full-attention Conformer + length regulator) get their
own. ``v1_config_from_release_dir`` is the one entry point.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ...config import (
    CFMConfig,
    EstimatorConfig,
    HiFTConfig,
    MelConfig,
    SpeechSampling,
    config_from_release_yaml,
    estimator_config,
    hift_fields,
)
from ...errors import ModelDirError
from ...hyperyaml import Tagged, find_tagged

__all__ = [
    "V1EncoderConfig",
    "V1LLMConfig",
    "V1FlowConfig",
    "V1StreamConfig",
    "V1ModelConfig",
    "v1_config_from_release_dir",
]

_LOGGER = logging.getLogger(__name__)

V1_YAML: Final = "cosyvoice.yaml"  # the release yaml that marks a CosyVoice 1 directory
_MEL_FRAME_RATE: Final = 22050 / 256  # hard-coded in the official length regulator and model


@dataclass(frozen=True)
class V1EncoderConfig:
    """A WeNet-style encoder (``ConformerEncoder`` or ``TransformerEncoder``) without conv modules."""

    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    static_chunk_size: int = 0  # 1 = causal (LLM parts), 0 = full attention (flow)


@dataclass(frozen=True, kw_only=True)
class V1LLMConfig(SpeechSampling):
    """``TransformerLM``: text embedding + Conformer text encoder + transformer LM + speech head."""

    text_token_size: int
    text_encoder_input_size: int
    llm_input_size: int
    llm_output_size: int
    spk_embed_dim: int
    text_encoder: V1EncoderConfig
    llm: V1EncoderConfig
    speech_token_size: int = 4096

    @property
    def speech_vocab_size(self) -> int:
        """Outputs of ``llm_decoder`` (4097: the tokens + eos). ``speech_embedding`` has 4096 rows."""
        return self.speech_token_size + 1

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        return (self.speech_token_size,)


@dataclass(frozen=True)
class V1FlowConfig:
    """``MaskedDiffWithXvec``: token embedding, Conformer encoder, length regulator, CFM."""

    vocab_size: int
    input_size: int
    output_size: int
    spk_embed_dim: int
    input_frame_rate: int
    encoder: V1EncoderConfig
    estimator: EstimatorConfig
    regulator_channels: int = 80
    regulator_stages: int = 4  # len(sampling_ratios): Conv k3 + GroupNorm + Mish each
    cfm: CFMConfig = field(default_factory=CFMConfig)

    def mel_frames(self, tokens: int) -> int:
        """Official ``int(n / input_frame_rate * 22050 / 256)`` (float64, truncated)."""
        return int(tokens / self.input_frame_rate * _MEL_FRAME_RATE)


@dataclass(frozen=True)
class V1StreamConfig:
    """Constants hard-coded in the official ``CosyVoiceModel`` (spec §6.2)."""

    token_hop_len: int = 100
    token_overlap_len: int = 20
    mel_overlap_len: int = 34  # int(20 / 50 * 22050 / 256)
    mel_cache_len: int = 20
    source_cache_len: int = 5120  # 20 frames * 256 samples


@dataclass(frozen=True)
class V1ModelConfig:
    """Everything CosyVoice 1 inference needs from a release directory."""

    family: str  # "v1"
    sample_rate: int
    token_frame_rate: int
    llm: V1LLMConfig
    flow: V1FlowConfig
    hift: HiFTConfig
    mel: MelConfig
    stream: V1StreamConfig = field(default_factory=V1StreamConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def v1_config_from_release_dir(model_dir: Path) -> V1ModelConfig:
    """Parse ``<model_dir>/cosyvoice.yaml`` (no overrides, as ``CosyVoice.__init__`` loads it)."""
    expected = "an official CosyVoice-300M(-SFT/-Instruct) release directory (cosyvoice.yaml, llm.pt, flow.pt, hift.pt)"
    return config_from_release_yaml(model_dir, V1_YAML, expected, _v1_from_yaml)


def _node(parent: dict[str, Any] | Tagged, key: str, class_name: str, source: Path) -> Tagged:
    value = parent.get(key)
    node = find_tagged(value, class_name) if value is not None else None
    if node is None:
        found = value.class_name if isinstance(value, Tagged) else type(value).__name__
        raise ModelDirError(
            f"{source}: '{key}' should be !new:...{class_name}, found {found}. "
            "This is not a CosyVoice 1 yaml; re-download the release."
        )
    return node


def _encoder(node: Tagged, input_size: int | None = None) -> V1EncoderConfig:
    return V1EncoderConfig(
        input_size=int(node.get("input_size", input_size)),
        output_size=int(node.get("output_size", 256)),
        attention_heads=int(node.get("attention_heads", 4)),
        linear_units=int(node.get("linear_units", 2048)),
        num_blocks=int(node.get("num_blocks", 6)),
        static_chunk_size=int(node.get("static_chunk_size", 0)),
    )


def _v1_from_yaml(doc: dict[str, Any], source: Path) -> V1ModelConfig:
    llm = _node(doc, "llm", "TransformerLM", source)
    flow = _node(doc, "flow", "MaskedDiffWithXvec", source)
    hift = _node(doc, "hift", "HiFTGenerator", source)
    sampling = llm.get("sampling")
    sampling_kwargs = sampling.kwargs if isinstance(sampling, Tagged) else {}
    llm_config = V1LLMConfig(
        text_token_size=int(llm["text_token_size"]),
        text_encoder_input_size=int(llm["text_encoder_input_size"]),
        llm_input_size=int(llm["llm_input_size"]),
        llm_output_size=int(llm["llm_output_size"]),
        spk_embed_dim=int(llm.get("spk_embed_dim", 192)),
        text_encoder=_encoder(_node(llm, "text_encoder", "ConformerEncoder", source)),
        llm=_encoder(_node(llm, "llm", "TransformerEncoder", source)),
        speech_token_size=int(llm.get("speech_token_size", 4096)),
        top_p=float(sampling_kwargs.get("top_p", 0.8)),
        top_k=int(sampling_kwargs.get("top_k", 25)),
        win_size=int(sampling_kwargs.get("win_size", 10)),
        tau_r=float(sampling_kwargs.get("tau_r", 0.1)),
    )
    cfm = _node(flow, "decoder", "ConditionalCFM", source)
    estimator = _node(cfm, "estimator", "ConditionalDecoder", source)
    regulator = _node(flow, "length_regulator", "InterpolateRegulator", source)
    cfm_params = cfm.get("cfm_params")
    cfm_values = cfm_params.kwargs.get("content", {}) if isinstance(cfm_params, Tagged) else {}
    flow_config = V1FlowConfig(
        vocab_size=int(flow["vocab_size"]),
        input_size=int(flow["input_size"]),
        output_size=int(flow["output_size"]),
        spk_embed_dim=int(flow.get("spk_embed_dim", 192)),
        input_frame_rate=int(flow.get("input_frame_rate", 50)),
        encoder=_encoder(_node(flow, "encoder", "ConformerEncoder", source), int(flow["input_size"])),
        estimator=estimator_config(estimator, static_chunk_size=0),
        regulator_channels=int(regulator["channels"]),
        regulator_stages=len(regulator.get("sampling_ratios", [1, 1, 1, 1])),
        cfm=CFMConfig(
            inference_cfg_rate=float(cfm_values.get("inference_cfg_rate", 0.7)),
            t_scheduler=str(cfm_values.get("t_scheduler", "cosine")),
        ),
    )
    return V1ModelConfig(
        family="v1",
        sample_rate=int(doc.get("sample_rate", 22050)),
        token_frame_rate=flow_config.input_frame_rate,
        llm=llm_config,
        flow=flow_config,
        hift=_hift_config(hift, source),
        mel=_mel_config(doc),
    )


def _hift_config(hift: Tagged, source: Path) -> HiFTConfig:
    f0 = _node(hift, "f0_predictor", "ConvRNNF0Predictor", source)
    return HiFTConfig(**hift_fields(hift, f0, default_rate=22050))


def _mel_config(doc: dict[str, Any]) -> MelConfig:
    """``feat_extractor``; the v1 release values (22.05 kHz, n_fft 1024, hop 256) when absent."""
    node = doc.get("feat_extractor")
    defaults = MelConfig(n_fft=1024, sampling_rate=22050, hop_size=256, win_size=1024)
    if not isinstance(node, Tagged):
        _LOGGER.debug("yaml has no feat_extractor; using the CosyVoice-300M release mel settings")
        return defaults
    fmax = node.get("fmax", 8000)
    return MelConfig(
        n_fft=int(node.get("n_fft", defaults.n_fft)),
        num_mels=int(node.get("num_mels", 80)),
        sampling_rate=int(node.get("sampling_rate", defaults.sampling_rate)),
        hop_size=int(node.get("hop_size", defaults.hop_size)),
        win_size=int(node.get("win_size", defaults.win_size)),
        fmin=float(node.get("fmin", 0)),
        fmax=None if fmax is None else float(fmax),
        center=bool(node.get("center", False)),
    )
