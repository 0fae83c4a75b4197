"""Model configuration read from an official release directory (yaml + Qwen config.json).

Only numbers live here; nothing is instantiated. These are the CosyVoice2 dataclasses and the yaml
helpers every family's reader shares; each family reads its own release (``trt_cosy.models.<name>.config``)
and ``trt_cosy.models.read_release_config`` picks the reader by the release's yaml. Every field
mirrors a value of the official yaml (see docs/cosyvoice-spec §1.3).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from .errors import ModelDirError
from .family_lookup import FAMILIES, FamilyTable
from .hyperyaml import Tagged, find_tagged, load_hyperyaml

__all__ = [
    "QwenConfig",
    "LLMConfig",
    "FlowEncoderConfig",
    "EstimatorConfig",
    "CFMConfig",
    "FlowConfig",
    "HiFTConfig",
    "MelConfig",
    "ModelConfig",
]

_LOGGER = logging.getLogger(__name__)

# The release yaml of each family (``Family.yaml_name``), by name.
YAML_BY_FAMILY: Final = FamilyTable(lambda name: FAMILIES[name].yaml_name)
QWEN_DIR: Final = "CosyVoice-BlankEN"


@dataclass(frozen=True)
class QwenConfig:
    """The Qwen2 backbone's shape, from ``CosyVoice-BlankEN/config.json``."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_json(cls, path: Path) -> QwenConfig:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            raise ModelDirError(
                f"{path} is missing: a CosyVoice2 or CosyVoice3 release has the Qwen2 config in {QWEN_DIR}/. "
                "Re-download the release."
            ) from exc
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelDirError(f"{path} is not readable JSON ({exc}). Re-download the release.") from exc
        try:
            return cls(
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=int(raw["num_attention_heads"]),
                num_kv_heads=int(raw.get("num_key_value_heads", raw["num_attention_heads"])),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                vocab_size=int(raw["vocab_size"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelDirError(
                f"{path} lacks or mistypes a Qwen2 field ({exc!r}); expected hidden_size, "
                "intermediate_size, num_hidden_layers, num_attention_heads, vocab_size."
            ) from exc


@dataclass(frozen=True, kw_only=True)
class SpeechSampling:
    """The official sampling settings of every family's speech LLM (RAS: top-p/top-k with a repetition
    window) and the speech-to-text token ratios that bound its length; eos is ``speech_token_size``."""

    speech_token_size: int
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0

    @property
    def eos_token(self) -> int:
        return self.speech_token_size


@dataclass(frozen=True, kw_only=True)
class LLMConfig(SpeechSampling):
    """Speech LLM around the Qwen2 backbone (CosyVoice2 ``Qwen2LM``)."""

    qwen: QwenConfig
    llm_input_size: int
    speech_token_size: int = 6561  # FSQ 3^8 speech tokens; ids >= this are specials
    num_speech_specials: int = 3  # v2: eos 6561, 6562, fill 6563
    mix_ratio: tuple[int, int] = (
        5,
        15,
    )  # text ids : prompt speech tokens per block of streamed text (bistream)

    @property
    def speech_vocab_size(self) -> int:
        """Rows of ``speech_embedding`` and outputs of ``llm_decoder`` (6564 for v2)."""
        return self.speech_token_size + self.num_speech_specials

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        return tuple(range(self.speech_token_size, self.speech_vocab_size))


@dataclass(frozen=True)
class FlowEncoderConfig:
    """UpsampleConformerEncoder (v2)."""

    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    num_up_blocks: int = 4  # hard-coded in the official class
    static_chunk_size: int = 25
    pre_lookahead_len: int = 3
    upsample_stride: int = 2


@dataclass(frozen=True)
class EstimatorConfig:
    """CausalConditionalDecoder (v2 CFM estimator)."""

    in_channels: int
    out_channels: int
    channels: tuple[int, ...]
    attention_head_dim: int
    n_blocks: int
    num_mid_blocks: int
    num_heads: int
    static_chunk_size: int = 50

    def cache_layout(self) -> tuple[int, int, int]:
        """The incremental estimator's cache: (transformer blocks L, width D, summed causal-convolution
        input channels C) of the U-Net."""
        width = self.channels[0]
        blocks = self.n_blocks * (self.num_mid_blocks + 2)
        # down: block1 (in_channels), block2, conv; mid: 2 each; up: block1 (2W), block2, conv; final block.
        channels = self.in_channels + 2 * width + 2 * width * self.num_mid_blocks + 2 * width + 3 * width
        return blocks, width, channels

    def cache_tail(self) -> int:
        """Input frames each causal convolution needs from before a chunk: kernel 3 - 1."""
        return 2


@dataclass(frozen=True)
class CFMConfig:
    """Conditional flow matching solver settings."""

    n_timesteps: int = 10
    inference_cfg_rate: float = 0.7
    t_scheduler: str = "cosine"
    noise_frames: int = 15000  # official fixed noise randn(1, 80, 15000) after seed 0


@dataclass(frozen=True)
class FlowConfig:
    vocab_size: int
    input_size: int
    output_size: int
    spk_embed_dim: int
    token_mel_ratio: int
    encoder: FlowEncoderConfig
    estimator: EstimatorConfig
    cfm: CFMConfig = field(default_factory=CFMConfig)


@dataclass(frozen=True)
class HiFTConfig:
    in_channels: int = 80
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = 24000
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop_len: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_in_channels: int = 80
    f0_cond_channels: int = 512

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per mel frame (480 for v2)."""
        total = self.istft_hop_len
        for rate in self.upsample_rates:
            total *= rate
        return total


@dataclass(frozen=True)
class MelConfig:
    """Matcha ``mel_spectrogram`` settings of the flow's prompt mel (``feat_extractor``)."""

    n_fft: int = 1920
    num_mels: int = 80
    sampling_rate: int = 24000
    hop_size: int = 480
    win_size: int = 1920
    fmin: float = 0.0
    fmax: float | None = 8000.0
    center: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """Everything inference needs from a release directory."""

    family: str  # "v2"; "v3" for models.v3.config.V3ModelConfig (v1 has its own V1ModelConfig)
    sample_rate: int
    token_frame_rate: int
    token_mel_ratio: int
    chunk_size: int
    llm: LLMConfig
    flow: FlowConfig
    hift: HiFTConfig
    mel: MelConfig

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


T = TypeVar("T")


def config_from_release_yaml(
    model_dir: Path,
    yaml_name: str,
    expected: str,
    parse: Callable[[dict[str, Any], Path], T],
    overrides: dict[str, Any] | None = None,
) -> T:
    """``parse(doc, yaml_path)`` of the release's ``yaml_name`` (HyperPyYAML with ``overrides``).

    ``ModelDirError`` when the yaml is missing (``expected``: the release directory it should be,
    with its files) or a value ``parse`` reads is missing or mistyped.
    """
    model_dir = Path(model_dir)
    yaml_path = model_dir / yaml_name
    if not yaml_path.is_file():
        raise ModelDirError(f"{model_dir} has no {yaml_name}; expected {expected}.")
    doc = load_hyperyaml(yaml_path, overrides or {})
    try:
        return parse(doc, yaml_path)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelDirError(
            f"{yaml_path}: a required value is missing or mistyped ({exc!r}). Re-download the release."
        ) from exc


def yaml_node(
    doc: dict[str, Any], key: str, class_name: str, source: Path, family: str = "CosyVoice2"
) -> Tagged:
    """The top-level ``!new:`` node ``key`` of class ``class_name``, or a ModelDirError naming the file."""
    node = doc.get(key)
    if not isinstance(node, Tagged) or node.class_name != class_name:
        found = node.class_name if isinstance(node, Tagged) else type(node).__name__
        raise ModelDirError(
            f"{source}: key '{key}' should be !new:...{class_name}, found {found}. "
            f"This is not a {family} yaml; re-download the release."
        )
    return node


def yaml_child(parent: Tagged, key: str, class_name: str, source: Path) -> Tagged:
    """The node of class ``class_name`` under ``parent.key``, or a ModelDirError naming the file."""
    node = find_tagged(parent.kwargs.get(key), class_name)
    if node is None:
        raise ModelDirError(f"{source}: {parent.class_name}.{key} should be a {class_name}.")
    return node


def hift_fields(hift: Tagged, f0: Tagged, default_rate: int) -> dict[str, Any]:
    """The ``HiFTConfig`` fields of a yaml ``hift`` node and its ``f0_predictor`` (every family)."""

    def ints(values: Any) -> tuple[int, ...]:
        return tuple(int(v) for v in values)

    istft = hift.get("istft_params", {}) or {}
    return dict(
        in_channels=int(hift.get("in_channels", 80)),
        base_channels=int(hift.get("base_channels", 512)),
        nb_harmonics=int(hift.get("nb_harmonics", 8)),
        sampling_rate=int(hift.get("sampling_rate", default_rate)),
        nsf_alpha=float(hift.get("nsf_alpha", 0.1)),
        nsf_sigma=float(hift.get("nsf_sigma", 0.003)),
        nsf_voiced_threshold=float(hift.get("nsf_voiced_threshold", 10)),
        upsample_rates=ints(hift["upsample_rates"]),
        upsample_kernel_sizes=ints(hift["upsample_kernel_sizes"]),
        istft_n_fft=int(istft.get("n_fft", 16)),
        istft_hop_len=int(istft.get("hop_len", 4)),
        resblock_kernel_sizes=ints(hift["resblock_kernel_sizes"]),
        resblock_dilation_sizes=tuple(ints(ds) for ds in hift["resblock_dilation_sizes"]),
        source_resblock_kernel_sizes=ints(hift["source_resblock_kernel_sizes"]),
        source_resblock_dilation_sizes=tuple(ints(ds) for ds in hift["source_resblock_dilation_sizes"]),
        lrelu_slope=float(hift.get("lrelu_slope", 0.1)),
        audio_limit=float(hift.get("audio_limit", 0.99)),
        f0_in_channels=int(f0.get("in_channels", 80)),
        f0_cond_channels=int(f0.get("cond_channels", 512)),
    )


def estimator_config(node: Tagged, static_chunk_size: int | None = None) -> EstimatorConfig:
    """The U-Net estimator (``ConditionalDecoder`` / ``CausalConditionalDecoder``) of a yaml node;
    ``static_chunk_size`` overrides the node's (CosyVoice 1's is not causal: 0)."""
    chunk = int(node.get("static_chunk_size", 50)) if static_chunk_size is None else static_chunk_size
    return EstimatorConfig(
        in_channels=int(node["in_channels"]),
        out_channels=int(node["out_channels"]),
        channels=tuple(int(c) for c in node["channels"]),
        attention_head_dim=int(node["attention_head_dim"]),
        n_blocks=int(node["n_blocks"]),
        num_mid_blocks=int(node["num_mid_blocks"]),
        num_heads=int(node["num_heads"]),
        static_chunk_size=chunk,
    )


def mel_config_from_yaml(
    doc: dict[str, Any], release: MelConfig | None = None, family: str = "CosyVoice2"
) -> MelConfig:
    """``feat_extractor`` partial; ``release`` (the CosyVoice2 release's settings by default) where the key
    is absent (trimmed yamls), and its ``fmax`` where the partial leaves it out."""
    release = release or MelConfig()
    node = doc.get("feat_extractor")
    if not isinstance(node, Tagged):
        _LOGGER.debug("yaml has no feat_extractor; using the %s release mel settings", family)
        return release
    fmax = node.get("fmax", release.fmax)
    return MelConfig(
        n_fft=int(node.get("n_fft", 1920)),
        num_mels=int(node.get("num_mels", 80)),
        sampling_rate=int(node.get("sampling_rate", 24000)),
        hop_size=int(node.get("hop_size", 480)),
        win_size=int(node.get("win_size", 1920)),
        fmin=float(node.get("fmin", 0)),
        fmax=None if fmax is None else float(fmax),
        center=bool(node.get("center", False)),
    )


def mix_ratio_from_yaml(values: Any) -> tuple[int, int]:
    """A Qwen2LM's ``mix_ratio`` from its yaml node (text ids, prompt speech tokens per block of
    streamed text; the official default is [5, 15])."""
    try:
        text, speech = (int(v) for v in values)
    except (TypeError, ValueError) as exc:
        raise ModelDirError(f"the llm's mix_ratio {values!r} is not two integers ({exc}).") from None
    if text < 1 or speech < 1:
        raise ModelDirError(f"the llm's mix_ratio {values!r} must be two positive integers.")
    return text, speech
