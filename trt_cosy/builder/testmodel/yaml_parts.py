"""Sections shared by the test-model yaml templates of the families (``models/<name>/export/yaml_template.py``).

Each is text exactly as the released yaml files have it (same tags, keys and nesting); a template joins them
with its own sections and then fills the ``{s.<size>}`` fields with ``str.format``.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "header",
    "qwen_llm",
    "SEEDS",
    "RAS_SAMPLING",
    "CFM_PARAMS",
    "HIFT_SOURCE",
    "HIFT_ISTFT",
    "QWEN_HEADER",
    "QWEN_LLM",
    "FLOW_TOKENS",
    "FEAT_24K",
]

# the official files seed every RNG with 1986 first
SEEDS: Final = """\
__set_seed1: !apply:random.seed [1986]
__set_seed2: !apply:numpy.random.seed [1986]
__set_seed3: !apply:torch.manual_seed [1986]
__set_seed4: !apply:torch.cuda.manual_seed_all [1986]
"""

# the LLM's repetition-aware sampling (all families)
RAS_SAMPLING: Final = """\
    sampling: !name:cosyvoice.utils.common.ras_sampling
        top_p: 0.8
        top_k: 25
        win_size: 10
        tau_r: 0.1
"""

# the CFM decoder's settings (all families)
CFM_PARAMS: Final = """\
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
"""

# HiFT's input and NSF source settings (all families)
HIFT_SOURCE: Final = """\
    in_channels: 80
    base_channels: {s.hift_channels}
    nb_harmonics: 8
    sampling_rate: !ref <sample_rate>
    nsf_alpha: 0.1
    nsf_sigma: 0.003
    nsf_voiced_threshold: 10
"""

# HiFT's iSTFT head and residual blocks (all families)
HIFT_ISTFT: Final = """\
    istft_params:
        n_fft: 16
        hop_len: 4
    resblock_kernel_sizes: [3, 7, 11]
    resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
"""

# the top-level settings of the Qwen2 families (CosyVoice2/3)
QWEN_HEADER: Final = """\
sample_rate: 24000
llm_input_size: {s.llm_size}
llm_output_size: {s.llm_size}
spk_embed_dim: 192
qwen_pretrain_path: ''
token_frame_rate: 25
token_mel_ratio: 2
chunk_size: 25
num_decoding_left_chunks: -1
"""

# the Qwen2 speech LLM's settings (CosyVoice2/3)
QWEN_LLM: Final = """\
    llm_input_size: !ref <llm_input_size>
    llm_output_size: !ref <llm_output_size>
    speech_token_size: 6561
    length_normalized_loss: True
    lsm_weight: 0
    mix_ratio: [5, 15]
    llm: !new:cosyvoice.llm.llm.Qwen2Encoder
        pretrain_path: !ref <qwen_pretrain_path>
"""

# the token-to-mel flow's settings (CosyVoice2/3)
FLOW_TOKENS: Final = """\
    output_size: 80
    spk_embed_dim: !ref <spk_embed_dim>
    output_type: 'mel'
    vocab_size: 6561
    input_frame_rate: !ref <token_frame_rate>
    only_mask_loss: True
    token_mel_ratio: !ref <token_mel_ratio>
    pre_lookahead_len: 3
"""

# the 24 kHz mel extractor (CosyVoice2/3)
FEAT_24K: Final = """\
feat_extractor: !name:matcha.utils.audio.mel_spectrogram
    n_fft: 1920
    num_mels: 80
    sampling_rate: !ref <sample_rate>
    hop_size: 480
    win_size: 1920
    fmin: 0
"""

# The 24 kHz HiFT's upsampling and source resblocks (CosyVoice2 and 3): after HIFT_SOURCE and HIFT_ISTFT.
HIFT_24K_UPSAMPLE: Final = """\
    upsample_rates: [8, 5, 3]
    upsample_kernel_sizes: [16, 11, 7]
"""
HIFT_24K_SOURCE_RESBLOCKS: Final = """\
    source_resblock_kernel_sizes: [7, 7, 11]
    source_resblock_dilation_sizes: [[1, 3, 5], [1, 3, 5], [1, 3, 5]]
    lrelu_slope: 0.1
    audio_limit: 0.99
"""
# The Qwen tokenizer (CosyVoice2 and 3); ``{version}`` is "" or an indented ``version:`` line.
QWEN_TOKENIZER: Final = """\
get_tokenizer: !name:cosyvoice.tokenizer.tokenizer.get_qwen_tokenizer
    token_path: !ref <qwen_pretrain_path>
    skip_special_tokens: True
{version}allowed_special: 'all'
"""


def header(family_flag: str, release: str, yaml_name: str) -> str:
    """The comment that opens a test-model yaml (``family_flag``: the ``make-test-model`` option that
    picks the family, e.g. ``" --family v3"``), then the seeds; ``{size_name}`` is filled later."""
    return (
        f"# Random-weight test model written by `trt-cosy make-test-model{family_flag}` ({{size_name}}).\n"
        f"# Structure and tags follow the released {release} {yaml_name}; weights are random.\n"
        + SEEDS
    )


def qwen_llm(llm_class: str) -> str:
    """The Qwen2 pretrain path and the ``llm`` section of CosyVoice2/3 (``llm_class``: the official class)."""
    return "\n" + QWEN_HEADER + f"\nllm: !new:cosyvoice.llm.llm.{llm_class}\n" + QWEN_LLM + RAS_SAMPLING
