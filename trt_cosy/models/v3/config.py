"""CosyVoice3 (Fun-CosyVoice3-0.5B family) configuration read from ``cosyvoice3.yaml``.

The v3 release differs from CosyVoice2 in three places (docs/cosyvoice-spec §1.5): the LLM head
(``CosyVoice3LM``: 6561 speech tokens + 200 specials, sos/task taken from ``speech_embedding``),
the flow (``CausalMaskedDiffWithDiT``: a pre-lookahead conv instead of the conformer encoder, a DiT
estimator) and the vocoder (``CausalHiFTGenerator``: causal convs with right look-ahead). The Qwen2
backbone, the CFM solver settings, the HiFT sizes and the mel settings reuse the CosyVoice2
dataclasses of ``trt_cosy.config``; only the parts that differ get their own classes here.

``v3_config_from_release_dir(model_dir)`` is the entry point; ``ModelConfig.from_release_dir``
dispatches to it when the directory holds ``cosyvoice3.yaml``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ...config import (
    QWEN_DIR,
    CFMConfig,
    HiFTConfig,
    LLMConfig,
    MelConfig,
    ModelConfig,
    QwenConfig,
    config_from_release_yaml,
    hift_fields,
    mel_config_from_yaml,
    yaml_child,
    yaml_node,
)
from ...errors import ModelDirError
from ...hyperyaml import Tagged
from ..v2.config import qwen_llm_config, release_fields

__all__ = [
    "V3_YAML",
    "V3_SPEECH_SPECIALS",
    "V3_SOS_OFFSET",
    "V3_TASK_OFFSET",
    "V3_EOS_OFFSET",
    "SILENT_TOKENS",
    "MAX_SILENT_RUN",
    "PreLookaheadConfig",
    "DiTConfig",
    "V3FlowConfig",
    "CausalHiFTConfig",
    "V3ModelConfig",
    "v3_config_from_release_dir",
]

_LOGGER = logging.getLogger(__name__)

V3_SPEECH_SPECIALS: Final = 200  # CosyVoice3LM: speech_token_size + 200 rows / logits, stop ids 6561..6760
V3_SOS_OFFSET: Final = 0  # sos = speech_token_size + 0 (a speech_embedding row)
V3_EOS_OFFSET: Final = 1  # eos = speech_token_size + 1
V3_TASK_OFFSET: Final = 2  # task_id = speech_token_size + 2
# CosyVoice3Model.llm_job: FSQ silence/breath tokens; after 5 in a row further ones are dropped.
V3_YAML: Final = "cosyvoice3.yaml"  # the release yaml that marks a CosyVoice3 directory
SILENT_TOKENS: Final = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT_RUN: Final = 5


@dataclass(frozen=True)
class PreLookaheadConfig:
    """``PreLookaheadLayer(in_channels, channels, pre_lookahead_len)``: the whole v3 "encoder"."""

    in_channels: int
    channels: int
    pre_lookahead_len: int = 3


@dataclass(frozen=True)
class DiTConfig:
    """The v3 CFM estimator ``cosyvoice.flow.DiT.dit.DiT``."""

    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: float = 2
    mel_dim: int = 80
    mu_dim: int = 80
    spk_dim: int = 80
    out_channels: int = 80
    static_chunk_size: int = 50  # frames; chunk attention when streaming
    time_freq_dim: int = 256  # TimestepEmbedding's sinusoid width (hard-coded in the class)
    conv_pos_kernel: int = 31  # CausalConvPositionEmbedding (hard-coded)
    conv_pos_groups: int = 16

    @property
    def inner_dim(self) -> int:
        return self.heads * self.dim_head

    @property
    def in_channels(self) -> int:
        """Width of the concatenated input ``[x, cond, mu, spks]`` (320 for the release)."""
        return 2 * self.mel_dim + self.mu_dim + self.spk_dim

    def cache_layout(self) -> tuple[int, int, int]:
        """The incremental estimator's cache: (DiT blocks L, width D, causal-convolution input channels C:
        the two conv position embedding convolutions, 2·dim)."""
        return self.depth, self.dim, 2 * self.dim

    def cache_tail(self) -> int:
        """Input frames each causal convolution needs from before a chunk: kernel 31 - 1."""
        return self.conv_pos_kernel - 1


@dataclass(frozen=True)
class V3FlowConfig:
    """``CausalMaskedDiffWithDiT``; field names follow ``FlowConfig`` so ``FlowStage`` can use it."""

    vocab_size: int
    input_size: int
    output_size: int
    spk_embed_dim: int
    token_mel_ratio: int
    encoder: PreLookaheadConfig
    estimator: DiTConfig
    cfm: CFMConfig = field(default_factory=CFMConfig)


@dataclass(frozen=True)
class CausalHiFTConfig(HiFTConfig):
    """``CausalHiFTGenerator``: the HiFT sizes plus the right look-ahead of its causal convs."""

    conv_pre_look_right: int = 4  # conv_pre kernel = look_right + 1, padded on the right
    f0_look_right: int = 3  # CausalConvRNNF0Predictor: first conv k4 padded on the right
    noise_seconds: int = 300  # the fixed SineGen2 buffers hold 300 s at 24 kHz


@dataclass(frozen=True)
class V3ModelConfig(ModelConfig):
    """``ModelConfig`` of a CosyVoice3 release (its ``family`` is ``"v3"``)."""

    flow: V3FlowConfig  # type: ignore[assignment]
    hift: CausalHiFTConfig  # type: ignore[assignment]

    @property
    def sos_token(self) -> int:
        return self.llm.speech_token_size + V3_SOS_OFFSET

    @property
    def task_token(self) -> int:
        return self.llm.speech_token_size + V3_TASK_OFFSET

    @property
    def real_eos_token(self) -> int:
        """The id v3 was trained to stop with (6562). ``llm.eos_token`` (6561) is what the official
        ``sampling_ids`` masks before ``min_len``; see ``trt_cosy.models.v3.stages``."""
        return self.llm.speech_token_size + V3_EOS_OFFSET


_FAMILY: Final = "CosyVoice3"


def v3_config_from_release_dir(model_dir: Path) -> V3ModelConfig:
    """Read ``cosyvoice3.yaml`` and ``CosyVoice-BlankEN/config.json`` of a CosyVoice3 release."""
    model_dir = Path(model_dir)
    expected = f"a Fun-CosyVoice3 release directory (cosyvoice3.yaml, llm.pt, flow.pt, hift.pt, {QWEN_DIR}/)"

    def parse(doc: dict[str, Any], yaml_path: Path) -> V3ModelConfig:
        return _v3_from_yaml(doc, QwenConfig.from_json(model_dir / QWEN_DIR / "config.json"), yaml_path)

    overrides = {"qwen_pretrain_path": str(model_dir / QWEN_DIR)}
    return config_from_release_yaml(model_dir, V3_YAML, expected, parse, overrides)


def _v3_from_yaml(doc: dict[str, Any], qwen: QwenConfig, source: Path) -> V3ModelConfig:
    llm = yaml_node(doc, "llm", "CosyVoice3LM", source, _FAMILY)
    flow = yaml_node(doc, "flow", "CausalMaskedDiffWithDiT", source, _FAMILY)
    hift = yaml_node(doc, "hift", "CausalHiFTGenerator", source, _FAMILY)
    shared = release_fields(doc, flow)
    return V3ModelConfig(
        family="v3",
        **shared,
        llm=_llm_config(llm, qwen, source),
        flow=_flow_config(flow, shared["token_mel_ratio"], source),
        hift=_hift_config(hift, source),
        mel=_mel_config(doc),
    )


def _llm_config(llm: Tagged, qwen: QwenConfig, source: Path) -> LLMConfig:
    return qwen_llm_config(llm, qwen, source, num_speech_specials=V3_SPEECH_SPECIALS)


def _flow_config(flow: Tagged, token_mel_ratio: int, source: Path) -> V3FlowConfig:
    lookahead = yaml_child(flow, "pre_lookahead_layer", "PreLookaheadLayer", source)
    cfm = yaml_child(flow, "decoder", "CausalConditionalCFM", source)
    dit = yaml_child(cfm, "estimator", "DiT", source)
    cfm_params = cfm.get("cfm_params")
    cfm_values = cfm_params.kwargs.get("content", {}) if isinstance(cfm_params, Tagged) else {}
    input_size = int(flow["input_size"])
    mel_dim = int(dit.get("mel_dim", 80))
    config = V3FlowConfig(
        vocab_size=int(flow["vocab_size"]),
        input_size=input_size,
        output_size=int(flow["output_size"]),
        spk_embed_dim=int(flow["spk_embed_dim"]),
        token_mel_ratio=token_mel_ratio,
        encoder=PreLookaheadConfig(
            in_channels=int(lookahead["in_channels"]),
            channels=int(lookahead["channels"]),
            pre_lookahead_len=int(lookahead.get("pre_lookahead_len", flow.get("pre_lookahead_len", 3))),
        ),
        estimator=DiTConfig(
            dim=int(dit["dim"]),
            depth=int(dit["depth"]),
            heads=int(dit["heads"]),
            dim_head=int(dit["dim_head"]),
            ff_mult=float(dit.get("ff_mult", 4)),
            mel_dim=mel_dim,
            mu_dim=int(dit.get("mu_dim") or mel_dim),
            spk_dim=int(dit.get("spk_dim") or 0),
            out_channels=int(dit.get("out_channels") or mel_dim),
            static_chunk_size=int(dit.get("static_chunk_size", 50)),
        ),
        cfm=CFMConfig(
            inference_cfg_rate=float(cfm_values.get("inference_cfg_rate", 0.7)),
            t_scheduler=str(cfm_values.get("t_scheduler", "cosine")),
        ),
    )
    if not input_size == config.output_size == config.encoder.in_channels == mel_dim:
        raise ModelDirError(
            f"{source}: flow input_size {input_size}, output_size {config.output_size}, pre-lookahead "
            f"in_channels {config.encoder.in_channels} and DiT mel_dim {mel_dim} must be equal (the v3 "
            "token embedding is the mel-sized mu). Re-download the release."
        )
    return config


def _hift_config(hift: Tagged, source: Path) -> CausalHiFTConfig:
    f0 = yaml_child(hift, "f0_predictor", "CausalConvRNNF0Predictor", source)
    return CausalHiFTConfig(
        **hift_fields(hift, f0, default_rate=24000),
        conv_pre_look_right=int(hift.get("conv_pre_look_right", 4)),
    )


def _mel_config(doc: dict[str, Any]) -> MelConfig:
    """``feat_extractor``; absent (trimmed yamls) -> the v3 release settings (``fmax: null``)."""
    return mel_config_from_yaml(doc, release=MelConfig(fmax=None), family="CosyVoice3")
