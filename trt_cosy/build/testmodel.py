"""``trt-cosy make-test-model``: a random-weight release directory in the official layout.

The directory has what an official CosyVoice2 release has for inference — ``cosyvoice2.yaml``,
``llm.pt``, ``flow.pt``, ``hift.pt`` (weight norm in the ``parametrizations`` key form the release
uses), ``CosyVoice-BlankEN/`` (Qwen2 config and a small real BPE tokenizer with the CosyVoice
special tokens) and stand-in ``campplus.onnx`` / ``speech_tokenizer_v2.onnx`` — so every later
stage can be tested end to end without downloading weights. ``size="full"`` has the released
dimensions (≈ 640 M parameters, 2.6 GB on disk) for benchmarks. The weights are random: the
audio is noise-like, never speech.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Final

import numpy as np
import torch
from torch import nn

from ..config import QWEN_DIR, ModelConfig
from ..errors import InputError
from .modules.flow import CosyVoice2Flow
from .modules.hift import HiFTGenerator
from .modules.llm import CosyVoice2LM
from .standin_onnx import write_standin_campplus, write_standin_speech_tokenizer
from .tokenizer_writer import write_test_tokenizer
from .yaml_template import FULL_SIZES, TINY_SIZES, render_cosyvoice2_yaml

__all__ = ["make_test_model", "SIZES"]

_LOGGER = logging.getLogger(__name__)

SIZES: Final = ("tiny", "full")

_QWEN_CONFIGS: Final = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=2048, max_window_layers=2),
    "full": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_window_layers=24),
}
_QWEN_COMMON: Final = dict(
    architectures=["Qwen2ForCausalLM"], attention_dropout=0.0, bos_token_id=151643, eos_token_id=151643,
    hidden_act="silu", initializer_range=0.02, max_position_embeddings=32768, model_type="qwen2",
    rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000.0, sliding_window=32768,
    tie_word_embeddings=True, torch_dtype="bfloat16", use_cache=True, use_sliding_window=False,
)
# Modules that the official HiFTGenerator wraps in weight norm (spec §5.4).
_WEIGHT_NORM_PREFIXES: Final = ("conv_pre.", "ups.", "resblocks.", "source_resblocks.", "conv_post.",
                                "f0_predictor.condnet.")
_TEST_TOKENIZER_VOCAB: Final = 2048


def make_test_model(out: Path, size: str = "tiny", seed: int = 0, overwrite: bool = False) -> Path:
    """Write a random-weight CosyVoice2 release directory to ``out`` (atomically) and return it."""
    if size not in SIZES:
        raise InputError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}.")
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InputError(f"{out} exists and is not empty; choose another --out or pass --overwrite.")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".make-test-model-", dir=out.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; a model directory is not
        _write_release(staging, size, seed)
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _LOGGER.info("wrote %s test model to %s", size, out)
    return out


def _write_release(root: Path, size: str, seed: int) -> None:
    sizes = TINY_SIZES if size == "tiny" else FULL_SIZES
    (root / "cosyvoice2.yaml").write_text(render_cosyvoice2_yaml(sizes, size), encoding="utf-8")
    qwen_dir = root / QWEN_DIR
    qwen_dir.mkdir()
    qwen = {**_QWEN_COMMON, **_QWEN_CONFIGS[size]}
    (qwen_dir / "config.json").write_text(json.dumps(qwen, indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": 151643, "eos_token_id": 151643, "max_new_tokens": 2048}
    (qwen_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    write_test_tokenizer(qwen_dir, min(_TEST_TOKENIZER_VOCAB, qwen["vocab_size"]))
    config = ModelConfig.from_release_dir(root)

    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        _save_llm(CosyVoice2LM(config.llm), root / "llm.pt")
        torch.manual_seed(seed + 1)
        _save(CosyVoice2Flow(config.flow).state_dict(), root / "flow.pt")
        torch.manual_seed(seed + 2)
        hift = HiFTGenerator(config.hift)
        _calibrate_f0(hift, seed)
        _save(_unfold_weight_norm(hift.state_dict()), root / "hift.pt")
    finally:
        torch.random.set_rng_state(generator_state)
    rng = np.random.default_rng(seed)
    write_standin_campplus(root / "campplus.onnx", rng)
    write_standin_speech_tokenizer(root / "speech_tokenizer_v2.onnx", rng)


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    torch.save({k: v.detach().clone().float().contiguous() for k, v in state.items()}, path)


def _save_llm(model: CosyVoice2LM, path: Path) -> None:
    # Qwen's text head is tied to embed_tokens in the release: one storage, saved under both keys.
    state = {k: v.detach().clone().float().contiguous() for k, v in model.state_dict().items()}
    state["llm.model.lm_head.weight"] = state["llm.model.model.embed_tokens.weight"]
    torch.save(state, path)


def _calibrate_f0(hift: nn.Module, seed: int) -> None:
    """Default init predicts f0 ≈ 0 Hz (always unvoiced); shift it to a voice-like 60–250 Hz range."""
    classifier = hift.f0_predictor.classifier
    generator = torch.Generator().manual_seed(seed + 3)
    with torch.no_grad():
        classifier.weight.copy_(torch.randn(classifier.weight.shape, generator=generator) * 2.0)
        classifier.bias.fill_(130.0)


def _unfold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
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
