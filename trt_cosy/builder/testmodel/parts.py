"""Pieces shared by the ``make-test-model`` writers of every family (``builder/models/<name>/testmodel.py``).

Saving random-weight state dicts the way the releases store them (float32, weight norm in the
``parametrizations`` key form, Qwen's tied text head), the f0 calibration that makes a random HiFT
voiced, and the ``CosyVoice-BlankEN`` directory of the Qwen2 families.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn

from ...config import QWEN_DIR
from ...frontend.tokenizer import special_tokens_for
from .tokenizer_writer import write_test_tokenizer

__all__ = [
    "write_checkpoints",
    "save_state",
    "save_tied_llm",
    "calibrate_f0",
    "unfold_weight_norm",
    "write_qwen_dir",
    "QWEN_CONFIGS",
]

QWEN_CONFIGS: Final = {
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        max_window_layers=2,
    ),
    "full": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        max_window_layers=24,
    ),
}
_QWEN_COMMON: Final = dict(
    architectures=["Qwen2ForCausalLM"],
    attention_dropout=0.0,
    bos_token_id=151643,
    eos_token_id=151643,
    hidden_act="silu",
    initializer_range=0.02,
    max_position_embeddings=32768,
    model_type="qwen2",
    rms_norm_eps=1e-06,
    rope_scaling=None,
    rope_theta=1000000.0,
    sliding_window=32768,
    tie_word_embeddings=True,
    torch_dtype="bfloat16",
    use_cache=True,
    use_sliding_window=False,
)
# Modules that the official HiFT generators wrap in weight norm (spec §5.4; same in v1 and v3).
_WEIGHT_NORM_PREFIXES: Final = (
    "conv_pre.",
    "ups.",
    "resblocks.",
    "source_resblocks.",
    "conv_post.",
    "f0_predictor.condnet.",
)
_TEST_TOKENIZER_VOCAB: Final = 2048
_TIED_HEAD: Final = "llm.model.lm_head.weight"
_TIED_EMBEDDING: Final = "llm.model.model.embed_tokens.weight"


def write_qwen_dir(root: Path, size: str, family: str = "v2") -> None:
    """``CosyVoice-BlankEN/``: the Qwen2 config, generation config and a small real BPE tokenizer
    leaving room for the ``family``'s special tokens."""
    qwen_dir = root / QWEN_DIR
    qwen_dir.mkdir()
    qwen = {**_QWEN_COMMON, **QWEN_CONFIGS[size]}
    (qwen_dir / "config.json").write_text(json.dumps(qwen, indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": 151643, "eos_token_id": 151643, "max_new_tokens": 2048}
    (qwen_dir / "generation_config.json").write_text(
        json.dumps(generation, indent=2) + "\n", encoding="utf-8"
    )
    vocab_size = min(_TEST_TOKENIZER_VOCAB, qwen["vocab_size"])
    write_test_tokenizer(qwen_dir, vocab_size, special_tokens_for(family))


def write_checkpoints(
    root: Path,
    seed: int,
    config: Any,
    make_llm: Callable[[Any], nn.Module],
    make_flow: Callable[[Any], nn.Module],
    make_hift: Callable[[Any], nn.Module],
    *,
    tied_llm: bool,
) -> None:
    """``llm.pt``, ``flow.pt`` and ``hift.pt`` of fresh random modules (``make_llm(config.llm)``,
    ``make_flow(config.flow)``, ``make_hift(config.hift)``), each made right after seeding torch with
    ``seed``, ``seed + 1`` and ``seed + 2``; HiFT's f0 predictor is calibrated and its weight norm
    unfolded as the releases store it; the caller's torch RNG state is restored."""
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        llm = make_llm(config.llm)
        if tied_llm:  # the Qwen2-based LLMs (v2, v3)
            save_tied_llm(llm, root / "llm.pt")
        else:
            save_state(llm.state_dict(), root / "llm.pt")
        torch.manual_seed(seed + 1)
        save_state(make_flow(config.flow).state_dict(), root / "flow.pt")
        torch.manual_seed(seed + 2)
        hift = make_hift(config.hift)
        calibrate_f0(hift, seed)
        save_state(unfold_weight_norm(hift.state_dict()), root / "hift.pt")
    finally:
        torch.random.set_rng_state(generator_state)


def save_state(state: dict[str, torch.Tensor], path: Path) -> None:
    torch.save({k: v.detach().clone().float().contiguous() for k, v in state.items()}, path)


def save_tied_llm(model: nn.Module, path: Path) -> None:
    """A Qwen2-based LLM: the text head is tied to embed_tokens in the release (one storage, two keys)."""
    state = {k: v.detach().clone().float().contiguous() for k, v in model.state_dict().items()}
    state[_TIED_HEAD] = state[_TIED_EMBEDDING]
    torch.save(state, path)


def calibrate_f0(hift: nn.Module, seed: int) -> None:
    """Default init predicts f0 ≈ 0 Hz (always unvoiced); shift it to a voice-like 60–250 Hz range."""
    classifier = hift.f0_predictor.classifier
    generator = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        classifier.weight.copy_(torch.randn(classifier.weight.shape, generator=generator) * 2.0)
        classifier.bias.fill_(130.0)


def unfold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain ``<m>.weight`` → ``<m>.parametrizations.weight.original0/1`` (g = ‖w‖ over dims ≥ 1, v = w)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(".weight") and value.dim() == 3 and key.startswith(_WEIGHT_NORM_PREFIXES):
            prefix = key[: -len(".weight")]
            out[prefix + ".parametrizations.weight.original0"] = value.norm(dim=(1, 2), keepdim=True)
            out[prefix + ".parametrizations.weight.original1"] = value
        else:
            out[key] = value
    return out
