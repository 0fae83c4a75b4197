"""Write a small but real Qwen2-style tokenizer in the ``CosyVoice-BlankEN`` file layout (for test models).

The files are those of the release (``vocab.json``, ``merges.txt``, ``tokenizer_config.json`` with
``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` as added tokens), so the real loading code
(`trt_cosy.frontend.tokenizer.QwenTextTokenizer.from_dir`) is what reads them. The byte-level BPE is
trained with the `tokenizers` trainer on a small built-in Chinese + English corpus; the output is
deterministic. Needs no torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from tokenizers import Tokenizer, pre_tokenizers, trainers

from ...errors import InputError
from ...frontend.tokenizer import COSYVOICE2_SPECIAL_TOKENS, ENDOFTEXT, build_qwen2_tokenizer

__all__ = ["write_test_tokenizer"]

_LOGGER = logging.getLogger(__name__)

_BYTE_ALPHABET_SIZE: Final = 256
_CONFIG_TOKENS: Final = (ENDOFTEXT, "<|im_start|>", "<|im_end|>")
_CORPUS: Final = (
    "希望你以后能够做的比我还好呦。",
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐，笑容如花儿般绽放。",
    "八百标兵奔北坡，北坡炮兵并排跑，炮兵怕把标兵碰，标兵怕碰炮兵炮。",
    "今天天气很好，我们一起去公园散步吧。明天可能会下雨，记得带伞。",
    "在他讲述那个荒诞故事的过程中，他突然停下来，因为他自己也被逗笑了。",
    "我们走的每一步，都是我们策略的一部分；你看到的所有一切，包括我此刻与你交谈，所做的一切，所说的每一句话，都有深远的意义。",
    "语音合成技术可以把文字转换成自然流畅的声音，广泛用于导航、客服和有声读物。",
    "The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.",
    "Hello, world! This is a small tokenizer for tests; it is trained on a tiny corpus.",
    "Text to speech systems turn written words into natural sounding speech, one sentence at a time.",
    "I have three apples and twenty-five oranges. The meeting is at ten thirty on Monday.",
    "You're welcome, it's fine, they'll come, we've seen it, I'm here and I'd say so.",
    "Numbers such as 1, 2, 3, 10, 25, 100 and 2024 appear in text too.",
    "Mixed text: 我喜欢用 iPhone 拍照, also 喜欢 MacBook. 你好 world!",
)


def _train(vocab_limit: int) -> Tokenizer:
    """Train the byte-level BPE (Qwen2 pre-tokenizer) on the built-in corpus, at most ``vocab_limit`` ids."""
    tokenizer = build_qwen2_tokenizer({}, [])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_limit,
        min_frequency=1,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return tokenizer


def _vocab_and_merges(tokenizer: Tokenizer) -> tuple[dict[str, int], list[tuple[str, str]]]:
    model = json.loads(tokenizer.to_str())["model"]
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ")) for pair in model["merges"]]
    vocab = dict(sorted(model["vocab"].items(), key=lambda item: item[1]))
    return vocab, merges


def _tokenizer_config(first_added_id: int) -> dict:
    """tokenizer_config.json as the released CosyVoice-BlankEN has it (chat template left out)."""
    added = {
        str(first_added_id + offset): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for offset, content in enumerate(_CONFIG_TOKENS)
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(_CONFIG_TOKENS[1:]),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": ENDOFTEXT,
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_test_tokenizer(
    qwen_dir: Path, vocab_size: int, special_tokens: Sequence[str] = COSYVOICE2_SPECIAL_TOKENS
) -> None:
    """Write ``vocab.json``, ``merges.txt`` and ``tokenizer_config.json`` of a small Qwen2-style tokenizer.

    The BPE ids stay below ``vocab_size - 1 - len(special_tokens)`` so that ``<|endoftext|>`` and the
    family's special tokens (ids right after the BPE vocabulary: 19 for CosyVoice2, 280 for
    CosyVoice3) also fit into a text embedding of ``vocab_size`` rows.

    Args:
        qwen_dir: the ``CosyVoice-BlankEN`` directory (created if needed).
        vocab_size: rows of the model's text embedding (Qwen2 ``config.json`` ``vocab_size``).
        special_tokens: the special tokens the runtime adds (``frontend.tokenizer.special_tokens_for``).

    Raises:
        InputError: ``vocab_size`` leaves no room for the 256 byte tokens and the special tokens.
    """
    reserved = 1 + len(special_tokens)  # <|endoftext|> and the special tokens
    vocab_limit = vocab_size - reserved
    if vocab_limit < _BYTE_ALPHABET_SIZE:
        raise InputError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer: it needs at least "
            f"{_BYTE_ALPHABET_SIZE + reserved} ids."
        )
    vocab, merges = _vocab_and_merges(_train(vocab_limit))
    qwen_dir = Path(qwen_dir)
    qwen_dir.mkdir(parents=True, exist_ok=True)
    (qwen_dir / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    merge_lines = "".join(f"{left} {right}\n" for left, right in merges)
    (qwen_dir / "merges.txt").write_text("#version: 0.2\n" + merge_lines, encoding="utf-8")
    config = _tokenizer_config(len(vocab))
    (qwen_dir / "tokenizer_config.json").write_text(
        json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )
    _LOGGER.info("Wrote a %d-token test tokenizer (%d merges) to %s", len(vocab), len(merges), qwen_dir)
