"""A small ``multilingual.tiktoken`` ranks file for CosyVoice 1 test models.

The real file is openai-whisper's (``whisper/assets/multilingual.tiktoken``, 50257 ranks); the
CosyVoice-300M releases do not ship it. This writes the same format — one ``<base64 token> <rank>``
line per token, the 256 single bytes first (ranks 0..255), then byte-pair merges in rank order —
learned by a plain byte-level BPE on a small built-in Chinese + English corpus, pre-split with
whisper's pattern. ``trt_cosy.models.v1.tokenizer.WhisperTextTokenizer`` reads it like the real
one and appends whisper's 1609 special tokens after the last rank. Deterministic; needs no torch.
"""

from __future__ import annotations

import base64
import logging
from collections import Counter
from pathlib import Path
from typing import Final

import regex

from ....errors import InputError
from ..tokenizer import WHISPER_SPLIT_PATTERN

__all__ = ["write_test_ranks", "train_byte_bpe"]

_LOGGER = logging.getLogger(__name__)

_BYTE_TOKENS: Final = 256
_MIN_PAIR_COUNT: Final = 2  # merges seen once would only spell out corpus words
_CORPUS: Final = (
    "收到好友从远方寄来的生日礼物，那份意外的惊喜与深深的祝福让我心中充满了甜蜜的快乐。",
    "希望你以后能够做的比我还好呦。今天天气很好，我们一起去公园散步吧。",
    "语音合成技术可以把文字转换成自然流畅的声音，用于导航、客服和有声读物。",
    "我们走的每一步，都是我们策略的一部分；你看到的所有一切都有深远的意义。",
    "Hello, this is a test of the text to speech system. It speaks one sentence at a time.",
    "The quick brown fox jumps over the lazy dog, and the dog does not mind at all.",
    "She said that the weather would be fine, so they went for a walk in the park.",
    "Numbers like 1, 2, 3, 10, 25 and 2024 appear in text too; so do names and places.",
    "There are three things I would like to say, and then I will let you speak.",
    "Mixed text: 我喜欢用 iPhone 拍照, and 你好 world!",
)


def _pieces(corpus: tuple[str, ...]) -> Counter[tuple[bytes, ...]]:
    """Whisper-pattern pieces of the corpus as tuples of single-byte tokens, with their counts."""
    counts: Counter[tuple[bytes, ...]] = Counter()
    for text in corpus:
        for piece in regex.findall(WHISPER_SPLIT_PATTERN, text):
            encoded = piece.encode("utf-8")
            counts[tuple(encoded[i : i + 1] for i in range(len(encoded)))] += 1
    return counts


def _merge(word: tuple[bytes, ...], pair: tuple[bytes, bytes]) -> tuple[bytes, ...]:
    out, index = [], 0
    while index < len(word):
        if index + 1 < len(word) and (word[index], word[index + 1]) == pair:
            out.append(pair[0] + pair[1])
            index += 2
        else:
            out.append(word[index])
            index += 1
    return tuple(out)


def train_byte_bpe(n_ranks: int, corpus: tuple[str, ...] = _CORPUS) -> list[bytes]:
    """The 256 byte tokens, then up to ``n_ranks - 256`` merged tokens in the order they were learned.

    Each step merges the most frequent adjacent pair (ties: the smallest bytes); it stops early when
    no pair occurs twice. A merged token's parts always have lower ranks, as tiktoken needs.
    """
    tokens = [bytes([value]) for value in range(_BYTE_TOKENS)]
    known = set(tokens)
    words = _pieces(corpus)
    while len(tokens) < n_ranks:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair[0] + pair[1], pair))
        if pairs[best] < _MIN_PAIR_COUNT:
            break
        merged = best[0] + best[1]
        if merged not in known:
            tokens.append(merged)
            known.add(merged)
        words = Counter({_merge(word, best): count for word, count in words.items()})
    return tokens


def write_test_ranks(path: Path, n_ranks: int) -> int:
    """Write a ranks file of at most ``n_ranks`` tokens (at least the 256 bytes); return its size.

    Raises:
        InputError: ``n_ranks`` is below 256 (the byte tokens must all be present).
    """
    if n_ranks < _BYTE_TOKENS:
        raise InputError(
            f"a tiktoken ranks file needs at least {_BYTE_TOKENS} ranks (one per byte), got {n_ranks}; "
            "the model's text_token_size is too small for whisper's 1609 special tokens."
        )
    tokens = train_byte_bpe(n_ranks)
    lines = "".join(
        f"{base64.b64encode(token).decode('ascii')} {rank}\n" for rank, token in enumerate(tokens)
    )
    Path(path).write_text(lines, encoding="ascii")
    _LOGGER.info("wrote %d tiktoken ranks (%d merges) to %s", len(tokens), len(tokens) - _BYTE_TOKENS, path)
    return len(tokens)
