"""The ``cosyvoice.yaml`` (CosyVoice-300M family) that ``trt-cosy make-test-model --family v1`` writes.

Same tags, keys and nesting as the released file, so HyperPyYAML and ``models.v1.config`` both read it;
the widths are parameters so tiny and full-size test models share one template. Only the sections
inference reads are written (model classes, tokenizer, ``feat_extractor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from ....builder.testmodel import yaml_parts as parts

__all__ = ["V1YamlSizes", "V1_TINY_SIZES", "V1_FULL_SIZES", "render_cosyvoice_yaml"]


@dataclass(frozen=True)
class V1YamlSizes:
    text_vocab: int
    text_embed: int
    llm_size: int
    text_encoder_heads: int
    text_encoder_ff: int
    text_encoder_blocks: int
    lm_heads: int
    lm_ff: int
    lm_blocks: int
    flow_input: int
    flow_width: int
    flow_heads: int
    flow_ff: int
    flow_blocks: int
    estimator_channels: int
    estimator_head_dim: int
    estimator_blocks: int
    estimator_mid_blocks: int
    estimator_heads: int
    hift_channels: int
    f0_channels: int


# The golden tiny set's sizes (../shared/golden/README.md §7.2).
V1_TINY_SIZES: Final = V1YamlSizes(
    2048, 32, 64, 4, 128, 2, 4, 128, 2, 32, 64, 2, 128, 2, 32, 32, 1, 2, 2, 64, 64
)
# The released CosyVoice-300M sizes (51866 = whisper's 50257 ranks + 1609 specials).
V1_FULL_SIZES: Final = V1YamlSizes(
    51866, 512, 1024, 16, 4096, 6, 16, 4096, 14, 512, 512, 8, 2048, 6, 256, 64, 4, 12, 8, 512, 512
)

_TEMPLATE: Final = (
    parts.header(" --family v1", "CosyVoice-300M", "cosyvoice.yaml")
    + """
sample_rate: 22050
text_encoder_input_size: {s.text_embed}
llm_input_size: {s.llm_size}
llm_output_size: {s.llm_size}
spk_embed_dim: 192

llm: !new:cosyvoice.llm.llm.TransformerLM
    text_encoder_input_size: !ref <text_encoder_input_size>
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    text_token_size: {s.text_vocab}
    speech_token_size: 4096
    length_normalized_loss: True
    lsm_weight: 0
    spk_embed_dim: !ref <spk_embed_dim>
    text_encoder: !new:cosyvoice.transformer.encoder.ConformerEncoder
        input_size: !ref <text_encoder_input_size>
        output_size: {s.llm_size}
        attention_heads: {s.text_encoder_heads}
        linear_units: {s.text_encoder_ff}
        num_blocks: {s.text_encoder_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.0
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        use_cnn_module: False
        macaron_style: False
        use_dynamic_chunk: False
        use_dynamic_left_chunk: False
        static_chunk_size: 1
    llm: !new:cosyvoice.transformer.encoder.TransformerEncoder
        input_size: !ref <llm_input_size>
        output_size: !ref <llm_output_size>
        attention_heads: {s.lm_heads}
        linear_units: {s.lm_ff}
        num_blocks: {s.lm_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.0
        input_layer: 'linear_legacy'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        static_chunk_size: 1
"""
    + parts.RAS_SAMPLING
    + """
flow: !new:cosyvoice.flow.flow.MaskedDiffWithXvec
    input_size: {s.flow_input}
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 4096
    input_frame_rate: 50
    only_mask_loss: True
    encoder: !new:cosyvoice.transformer.encoder.ConformerEncoder
        output_size: {s.flow_width}
        attention_heads: {s.flow_heads}
        linear_units: {s.flow_ff}
        num_blocks: {s.flow_blocks}
        dropout_rate: 0.1
        positional_dropout_rate: 0.1
        attention_dropout_rate: 0.1
        normalize_before: True
        input_layer: 'linear'
        pos_enc_layer_type: 'rel_pos_espnet'
        selfattention_layer_type: 'rel_selfattn'
        input_size: {s.flow_input}
        use_cnn_module: False
        macaron_style: False
    length_regulator: !new:cosyvoice.flow.length_regulator.InterpolateRegulator
        channels: 80
        sampling_ratios: [1, 1, 1, 1]
    decoder: !new:cosyvoice.flow.flow_matching.ConditionalCFM
"""
    + parts.CFM_PARAMS
    + """\
        estimator: !new:cosyvoice.flow.decoder.ConditionalDecoder
            in_channels: 320
            out_channels: 80
            channels: [{s.estimator_channels}, {s.estimator_channels}]
            dropout: 0.0
            attention_head_dim: {s.estimator_head_dim}
            n_blocks: {s.estimator_blocks}
            num_mid_blocks: {s.estimator_mid_blocks}
            num_heads: {s.estimator_heads}
            act_fn: 'gelu'

hift: !new:cosyvoice.hifigan.generator.HiFTGenerator
"""
    + parts.HIFT_SOURCE
    + """\
    upsample_rates: [8, 8]
    upsample_kernel_sizes: [16, 16]
"""
    + parts.HIFT_ISTFT
    + """\
    source_resblock_kernel_sizes: [7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.ConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {s.f0_channels}

# The text tokenizer: whisper's multilingual.tiktoken ranks (a small stand-in file in test models).
get_tokenizer: !name:whisper.tokenizer.get_tokenizer
    multilingual: True
    num_languages: 100
    language: 'en'
    task: 'transcribe'
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1024
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 256
    win_size: 1024
    fmin: 0
    fmax: 8000
    center: False
"""
)


def render_cosyvoice_yaml(sizes: V1YamlSizes, size_name: str) -> str:
    return _TEMPLATE.format(s=sizes, size_name=size_name)
