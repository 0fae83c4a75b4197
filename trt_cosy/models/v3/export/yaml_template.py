"""The ``cosyvoice3.yaml`` that ``trt-cosy make-test-model --family v3`` writes.

Same tags, keys and nesting as the released Fun-CosyVoice3 file, so HyperPyYAML and ``models.v3.config``
both read it; the widths are parameters so tiny and full-size test models share one template.
Only the sections inference reads are written (model classes, tokenizer, ``feat_extractor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ....builder.testmodel import yaml_parts as parts

__all__ = ["V3YamlSizes", "V3_TINY_SIZES", "V3_FULL_SIZES", "render_cosyvoice3_yaml"]


@dataclass(frozen=True)
class V3YamlSizes:
    llm_size: int
    lookahead_channels: int
    dit_dim: int
    dit_depth: int
    dit_heads: int
    dit_head_dim: int
    hift_channels: int
    f0_channels: int


# The golden tiny set's sizes (../shared/golden/README.md §8.2).
V3_TINY_SIZES: Final = V3YamlSizes(64, 64, 64, 2, 4, 16, 64, 64)
# The released Fun-CosyVoice3-0.5B sizes.
V3_FULL_SIZES: Final = V3YamlSizes(896, 1024, 1024, 22, 16, 64, 512, 512)

_TEMPLATE: Final = (
    parts.header(" --family v3", "Fun-CosyVoice3-0.5B", "cosyvoice3.yaml")
    + parts.qwen_llm("CosyVoice3LM")
    + """
flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
"""
    + parts.FLOW_TOKENS
    + """\
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {s.lookahead_channels}
        pre_lookahead_len: 3
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
"""
    + parts.CFM_PARAMS
    + """\
        estimator: !new:cosyvoice.flow.DiT.dit.DiT
            dim: {s.dit_dim}
            depth: {s.dit_depth}
            heads: {s.dit_heads}
            dim_head: {s.dit_head_dim}
            ff_mult: 2
            mel_dim: 80
            mu_dim: 80
            spk_dim: 80
            out_channels: 80
            static_chunk_size: !ref <chunk_size> * <token_mel_ratio>
            num_decoding_left_chunks: !ref <num_decoding_left_chunks>

hift: !new:cosyvoice.hifigan.generator.CausalHiFTGenerator
"""
    + parts.HIFT_SOURCE
    + parts.HIFT_24K_UPSAMPLE
    + parts.HIFT_ISTFT
    + parts.HIFT_24K_SOURCE_RESBLOCKS
    + """\
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {s.f0_channels}

"""
    + parts.QWEN_TOKENIZER.replace("{version}", "    version: cosyvoice3\n")
    + parts.FEAT_24K
    + """\
    fmax: null
    center: False
"""
)


def render_cosyvoice3_yaml(sizes: V3YamlSizes, size_name: str) -> str:
    return _TEMPLATE.format(s=sizes, size_name=size_name)
