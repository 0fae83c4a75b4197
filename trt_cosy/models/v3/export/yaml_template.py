"""The ``cosyvoice3.yaml`` that ``trt-cosy make-test-model --family v3`` writes.

Same tags, keys and nesting as the released Fun-CosyVoice3 file, so HyperPyYAML and ``models.v3.config``
both read it; the widths are parameters so tiny and full-size test models share one template.
Only the sections inference reads are written (model classes, tokenizer, ``feat_extractor``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

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

_TEMPLATE: Final = """\
# Random-weight test model written by `trt-cosy make-test-model --family v3` ({size_name}).
# Structure and tags follow the released Fun-CosyVoice3-0.5B cosyvoice3.yaml; weights are random.
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]

sample_rate: 24000
llm_input_size: {s.llm_size}
llm_output_size: {s.llm_size}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1

llm: !new:cosyvoice.llm.llm.CosyVoice3LM
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1

flow: !new:cosyvoice.flow.flow.CausalMaskedDiffWithDiT
    input_size: 80
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
    pre_lookahead_layer: !new:cosyvoice.transformer.upsample_encoder.PreLookaheadLayer
        in_channels: 80
        channels: {s.lookahead_channels}
        pre_lookahead_len: 3
    decoder: !new:cosyvoice.flow.flow_matching.CausalConditionalCFM
        in_channels: 240
        n_spks: 1
        spk_emb_dim: 80
        cfm_params: !new:omegaconf.DictConfig
            content:
                sigma_min: 1e-06
                solver: 'euler'
                t_scheduler: 'cosine'
                training_cfg_rate: 0.2
                inference_cfg_rate: 0.7
                reg_loss_type: 'l1'
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
    in_channels: 80
    base_channels: {s.hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
    conv_pre_look_right: 4
    f0_predictor: !new:cosyvoice.hifigan.f0_predictor.CausalConvRNNF0Predictor
        num_class: 1
        in_channels: 80
        cond_channels: {s.f0_channels}

get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
    version: cosyvoice3
allowed_special: 'all'
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
    fmax: null
    center: False
"""


def render_cosyvoice3_yaml(sizes: V3YamlSizes, size_name: str) -> str:
    return _TEMPLATE.format(s=sizes, size_name=size_name)
