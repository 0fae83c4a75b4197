"""Read a CosyVoice2 release directory (``cosyvoice2.yaml`` + ``CosyVoice-BlankEN/config.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Final

from ...config import (
    QWEN_DIR,
    CFMConfig,
    FlowConfig,
    FlowEncoderConfig,
    HiFTConfig,
    LLMConfig,
    ModelConfig,
    QwenConfig,
    estimator_config,
    hift_fields,
    mel_config_from_yaml,
    mix_ratio_from_yaml,
    yaml_child,
    yaml_node,
)
from ...errors import ModelDirError
from ...hyperyaml import Tagged, load_hyperyaml

__all__ = ["V2_YAML", "qwen_llm_config", "release_fields", "v2_config_from_release_dir"]

V2_YAML: Final = "cosyvoice2.yaml"  # the release yaml that marks a CosyVoice2 directory


def v2_config_from_release_dir(model_dir: Path) -> ModelConfig:
    """Read ``cosyvoice2.yaml`` and ``CosyVoice-BlankEN/config.json`` of a CosyVoice2 release."""
    model_dir = Path(model_dir)
    yaml_path = model_dir / V2_YAML
    doc = load_hyperyaml(yaml_path, {"qwen_pretrain_path": str(model_dir / QWEN_DIR)})
    qwen = QwenConfig.from_json(model_dir / QWEN_DIR / "config.json")
    return _v2_from_yaml(doc, qwen, yaml_path)


def _v2_from_yaml(doc: dict[str, Any], qwen: QwenConfig, source: Path) -> ModelConfig:
    try:
        llm = yaml_node(doc, "llm", "Qwen2LM", source)
        flow = yaml_node(doc, "flow", "CausalMaskedDiffWithXvec", source)
        hift = yaml_node(doc, "hift", "HiFTGenerator", source)
        encoder = yaml_child(flow, "encoder", "UpsampleConformerEncoder", source)
        cfm = yaml_child(flow, "decoder", "CausalConditionalCFM", source)
        estimator = yaml_child(cfm, "estimator", "CausalConditionalDecoder", source)
        f0 = yaml_child(hift, "f0_predictor", "ConvRNNF0Predictor", source)
        cfm_params = cfm.get("cfm_params")
        cfm_values = cfm_params.kwargs.get("content", {}) if isinstance(cfm_params, Tagged) else {}
        shared = release_fields(doc, flow)
        llm_config = qwen_llm_config(llm, qwen, source)
        flow_config = FlowConfig(
            vocab_size=int(flow["vocab_size"]),
            input_size=int(flow["input_size"]),
            output_size=int(flow["output_size"]),
            spk_embed_dim=int(flow["spk_embed_dim"]),
            token_mel_ratio=shared["token_mel_ratio"],
            encoder=FlowEncoderConfig(
                input_size=int(encoder["input_size"]),
                output_size=int(encoder["output_size"]),
                attention_heads=int(encoder["attention_heads"]),
                linear_units=int(encoder["linear_units"]),
                num_blocks=int(encoder["num_blocks"]),
                static_chunk_size=int(encoder.get("static_chunk_size", 25)),
                pre_lookahead_len=int(flow.get("pre_lookahead_len", 3)),
            ),
            estimator=estimator_config(estimator),
            cfm=CFMConfig(
                inference_cfg_rate=float(cfm_values.get("inference_cfg_rate", 0.7)),
                t_scheduler=str(cfm_values.get("t_scheduler", "cosine")),
            ),
        )
        hift_config = HiFTConfig(**hift_fields(hift, f0, default_rate=24000))
        mel_config = mel_config_from_yaml(doc)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelDirError(
            f"{source}: a required value is missing or mistyped ({exc!r}). Re-download the release."
        ) from exc
    return ModelConfig(
        family="v2",
        **shared,
        llm=llm_config,
        flow=flow_config,
        hift=hift_config,
        mel=mel_config,
    )


def release_fields(doc: dict[str, Any], flow: Tagged) -> dict[str, int]:
    """The ``ModelConfig`` rates CosyVoice2 and 3 read alike: sample rate, token frame rate, token/mel
    ratio and chunk size, with the releases' values where a (trimmed) yaml leaves them out."""
    return {
        "sample_rate": int(doc.get("sample_rate", 24000)),
        "token_frame_rate": int(doc.get("token_frame_rate", 25)),
        "token_mel_ratio": int(doc.get("token_mel_ratio", flow.get("token_mel_ratio", 2))),
        "chunk_size": int(doc.get("chunk_size", 25)),
    }


def qwen_llm_config(llm: Tagged, qwen: QwenConfig, source: Path, num_speech_specials: int = 3) -> LLMConfig:
    """The Qwen2 LLM's config (CosyVoice2 and 3) with its RAS sampling settings; refuses a yaml whose
    ``llm_input_size`` is not the backbone's hidden size."""
    sampling = llm.get("sampling")
    values = sampling.kwargs if isinstance(sampling, Tagged) else {}
    config = LLMConfig(
        qwen=qwen,
        llm_input_size=int(llm["llm_input_size"]),
        speech_token_size=int(llm.get("speech_token_size", 6561)),
        num_speech_specials=num_speech_specials,
        top_p=float(values.get("top_p", 0.8)),
        top_k=int(values.get("top_k", 25)),
        win_size=int(values.get("win_size", 10)),
        mix_ratio=mix_ratio_from_yaml(llm.get("mix_ratio", (5, 15))),
        tau_r=float(values.get("tau_r", 0.1)),
    )
    if config.llm_input_size != qwen.hidden_size:
        raise ModelDirError(
            f"{source}: llm_input_size {config.llm_input_size} differs from the Qwen2 hidden_size "
            f"{qwen.hidden_size} in {QWEN_DIR}/config.json; the files do not belong together."
        )
    return config
