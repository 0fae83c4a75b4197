"""The ``cosyvoice2.yaml`` that ``trt-cosy make-test-model`` writes.

Same tags, keys and structure as the released file (so HyperPyYAML and our reader both load
it); the widths are parameters so tiny and full-size test models share one template. Only the
inference-relevant sections are written (like the golden tiny set).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ....builder.testmodel import yaml_parts as parts

__all__ = ["YamlSizes", "TINY_SIZES", "FULL_SIZES", "render_cosyvoice2_yaml"]


@dataclass(frozen=True)
class YamlSizes:
    llm_size: int
    flow_width: int
    encoder_heads: int
    encoder_ff: int
    encoder_blocks: int
    estimator_channels: int
    estimator_head_dim: int
    estimator_blocks: int
    estimator_mid_blocks: int
    estimator_heads: int
    hift_channels: int
    f0_channels: int


# The golden tiny set's sizes (../shared/golden/README.md §1.2).
TINY_SIZES: Final = YamlSizes(64, 64, 2, 128, 2, 64, 32, 1, 2, 2, 64, 64)
# The released CosyVoice2-0.5B sizes.
FULL_SIZES: Final = YamlSizes(896, 512, 8, 2048, 6, 256, 64, 4, 12, 8, 512, 512)

_TEMPLATE: Final = (
    parts.header("", "CosyVoice2-0.5B", "cosyvoice2.yaml")
    + parts.qwen_llm("Qwen2LM")
    + """
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithXvec
    input_size: {s.flow_width}
"""
    + parts.FLOW_TOKENS
    + """\
    encoder: !new:cosyvoice.transformer.upsample_encoder.UpsampleConformerEncoder
        output_size: {s.flow_width}
        attention_heads: {s.encoder_heads}
        linear_units: {s.encoder_ff}
        num_blocks: {s.encoder_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {s.flow_width}
        use_cnn_module: False
        macaron_style: False
        static_chunk_size: !ref <chunk_size>
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
"""
    + parts.CFM_PARAMS
    + """\
        estimator: !new:cosyvoice.flow.decoder.CausalConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{s.estimator_channels}]
            dropout: 0.0
            attention_head_dim: {s.estimator_head_dim}
            n_blocks: {s.estimator_blocks}
            num_mid_blocks: {s.estimator_mid_blocks}
            num_heads: {s.estimator_heads}
            act_fn: 'gelu'
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
"""
    + parts.HIFT_SOURCE
    + parts.HIFT_24K_UPSAMPLE
    + parts.HIFT_ISTFT
    + parts.HIFT_24K_SOURCE_RESBLOCKS
    + """\
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {s.f0_channels}

"""
    + parts.QWEN_TOKENIZER.replace("{version}", "")
    + parts.FEAT_24K
    + """\
    fmax: 8000
    center: False
"""
)


def render_cosyvoice2_yaml(sizes: YamlSizes, size_name: str) -> str:
    return _TEMPLATE.format(s=sizes, size_name=size_name)
