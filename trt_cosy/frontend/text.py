"""Text normalisation and sentence splitting, as the official CosyVoice frontend does it (spec §2.2).

`TextNormalizer.normalize` is the official ``text_normalize(text, split=False)`` and
`TextNormalizer.split` is ``text_normalize(text, split=True)``: the list of segments that are
synthesised one after another. Two engines:

* ``"wetext"``: the wetext number/date/money verbaliser runs first (the official code's choice when
  ``ttsfrd`` is missing), then the rule-based steps.
* ``"none"``: only the rule-based steps. This is what the official code does when no normaliser can be
  loaded (for example offline with wetext 0.0.4); the golden text set was made in this mode.

Official quirks are kept on purpose (``"2,000"`` → ``"two,zero"``, ``"3rd"`` → ``"threerd"``, repeated
sentence punctuation collapsing to one mark when splitting). Where the official code would crash
(whitespace-only English text, a number too large for ``inflect``, a wetext failure) we carry on, as
each helper's docstring says.
"""

from __future__ import annotations

import functools
import logging
import re
import unicodedata
from collections.abc import Callable
from typing import Final, Literal

from ..errors import InputError, MissingDependencyError, TrtCosyError

__all__ = ["TextNormalizer", "contains_chinese", "split_paragraph", "spell_out_numbers"]

_LOGGER = logging.getLogger(__name__)

Engine = Literal["wetext", "none"]

_CJK_PATTERN: Final = re.compile(r"[\u4e00-\u9fff]")
_TRAILING_COMMAS: Final = re.compile(r"[，,、]+$")
_ZH_SENTENCE_END: Final = frozenset("。？！；：、.?!;")
_EN_SENTENCE_END: Final = frozenset(".?!;:")
_CLOSING_QUOTES: Final = frozenset('"”')
_WHITESPACE_RUN: Final = re.compile(r"(\s{2,})")
# split_paragraph limits used by the official text_normalize for both languages.
_MAX_LEN: Final = 80
_MIN_LEN: Final = 60
_MERGE_LEN: Final = 20
# Literal replacements of the zh branch, applied in this order after replace_blank.
_ZH_REPLACEMENTS: Final = (
    ("²", "平方"),
    ("³", "立方"),
    (".", "。"),
    (" - ", "，"),
    ("（", ""),
    ("）", ""),
    ("【", ""),
    ("】", ""),
    ("`", ""),
    ("——", " "),
)


def contains_chinese(text: str) -> bool:
    """True when ``text`` has a CJK unified ideograph (U+4E00–U+9FFF): the official zh/en branch test."""
    return _CJK_PATTERN.search(text) is not None


def _is_only_punctuation(text: str) -> bool:
    """True for text made only of Unicode punctuation (P*) and symbols (S*), or empty."""
    return all(unicodedata.category(char)[0] in "PS" for char in text)


def _keep_blanks_between_ascii(text: str) -> str:
    """Drop every space unless both neighbours are ASCII and not spaces (official ``replace_blank``).

    As in the official code the left neighbour of position 0 is the last character (Python's
    ``text[-1]``); a trailing space, where the official code raises IndexError, is dropped.
    """
    kept = []
    last = len(text) - 1
    for index, char in enumerate(text):
        if char == " ":
            left = text[index - 1]
            right = text[index + 1] if index < last else " "
            if not (left.isascii() and left != " " and right.isascii() and right != " "):
                continue
        kept.append(char)
    return "".join(kept)


@functools.lru_cache(maxsize=1)
def _inflect_engine():
    try:
        import inflect
    except ImportError as exc:
        raise MissingDependencyError(
            f"'inflect' is not installed ({exc}); English text normalisation needs it. "
            "Install it with: pip install 'inflect>=7,<8'"
        ) from exc
    return inflect.engine()


def _number_to_words(digits: str) -> str:
    """``inflect.number_to_words`` on a digit run; digit by digit where inflect fails (huge numbers)."""
    engine = _inflect_engine()
    try:
        return engine.number_to_words(digits)
    except Exception as exc:  # inflect raises IndexError past its largest named power of ten
        _LOGGER.warning("inflect cannot spell %r (%s); spelling it digit by digit", digits, exc)
        return " ".join(engine.number_to_words(digit) for digit in digits)


def spell_out_numbers(text: str) -> str:
    """Replace every maximal run of ``str.isdigit`` characters by its English words (official quirks kept)."""
    pieces = []
    run_start = None
    for index, char in enumerate(text):
        if char.isdigit():
            if run_start is None:
                run_start = index
            continue
        if run_start is not None:
            pieces.append(_number_to_words(text[run_start:index]))
            run_start = None
        pieces.append(char)
    if run_start is not None:
        pieces.append(_number_to_words(text[run_start:]))
    return "".join(pieces)


def _cut_sentences(text: str, sentence_end: frozenset[str]) -> list[str]:
    """Cut after each sentence-final mark, attaching a following closing quote (official rules).

    A mark with nothing before it (a repeated mark such as ``...``) is dropped, as officially. A closing
    quote right after such a mark joins the previous sentence; with no previous sentence, where the
    official code raises IndexError, the quote starts the next sentence instead.
    """
    sentences: list[str] = []
    start = 0
    for index, char in enumerate(text):
        if char not in sentence_end:
            continue
        if index > start:
            sentences.append(text[start:index] + char)
        quote_follows = index + 1 < len(text) and text[index + 1] in _CLOSING_QUOTES
        if quote_follows and sentences:
            sentences[-1] += text[index + 1]
            start = index + 2
        else:
            start = index + 1
    return sentences


def split_paragraph(text: str, lang: str, length: Callable[[str], int]) -> list[str]:
    """The official ``split_paragraph(text, tokenize, lang, 80, 60, 20, comma_split=False)``.

    Args:
        text: normalised, non-empty text.
        lang: ``"zh"`` or ``"en"``; picks the sentence-final marks and the mark appended when the text
            does not end with one (``。`` / ``.``).
        length: the length measure: characters for zh, tokenizer tokens for en.

    Returns:
        Segments of at most about 80 units; a last segment under 20 units joins the previous one.
    """
    sentence_end = _ZH_SENTENCE_END if lang == "zh" else _EN_SENTENCE_END
    if text[-1] not in sentence_end:
        text += "。" if lang == "zh" else "."
    segments: list[str] = []
    current = ""
    for sentence in _cut_sentences(text, sentence_end):
        if length(current + sentence) > _MAX_LEN and length(current) > _MIN_LEN:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        if segments and length(current) < _MERGE_LEN:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


def _apply_zh_rules(text: str) -> str:
    """The zh branch after the TN model: newlines, blanks, corner marks, '.', brackets, trailing commas."""
    text = _keep_blanks_between_ascii(text.replace("\n", ""))
    for old, new in _ZH_REPLACEMENTS:
        text = text.replace(old, new)
    return _TRAILING_COMMAS.sub("。", text)


class TextNormalizer:
    """Official CosyVoice text normalisation and splitting, without torch.

    Args:
        engine: ``"wetext"`` (wetext verbalises numbers, dates, money first) or ``"none"`` (rules only,
            the official fallback and the golden mode).
        count_tokens: text → number of text-tokenizer tokens (e.g. ``QwenTextTokenizer.count_tokens``).
            English splitting measures length with it; `split` raises without it on English text.
    """

    def __init__(self, engine: Engine = "wetext", count_tokens: Callable[[str], int] | None = None) -> None:
        if engine not in ("wetext", "none"):
            raise InputError(f"Unknown text normalisation engine {engine!r}; use 'wetext' or 'none'.")
        self.engine = engine
        self.count_tokens = count_tokens
        self._wetext = _load_wetext() if engine == "wetext" else None

    def normalize(self, text: str) -> str:
        """Normalised text without splitting (the official ``text_normalize(text, split=False)``)."""
        if _skips_frontend(text):
            return text
        text, _ = self._normalize_with_lang(text.strip())
        return text

    def split(self, text: str) -> list[str]:
        """Normalised segments to synthesise one by one (the official ``text_normalize(text, split=True)``).

        Segments that are only punctuation or symbols are dropped, so the list can be empty.
        """
        if _skips_frontend(text):
            return [text]
        text, lang = self._normalize_with_lang(text.strip())
        if not text:  # whitespace-only input: the official code raises IndexError here
            return []
        segments = split_paragraph(text, lang, len if lang == "zh" else self._token_length)
        return [segment for segment in segments if not _is_only_punctuation(segment)]

    def _normalize_with_lang(self, text: str) -> tuple[str, str]:
        if contains_chinese(text):
            return _apply_zh_rules(self._verbalise(text)), "zh"
        return spell_out_numbers(self._verbalise(text)), "en"

    def _verbalise(self, text: str) -> str:
        """Run wetext when it is the engine.

        wetext 0.1.x asserts on English text with a run of two or more whitespace characters (e.g. a
        blank line); the official code would then crash. We verbalise the pieces between such runs
        instead, and keep a piece as it is if wetext still fails on it.
        """
        if self._wetext is None or not text:
            return text
        try:
            return self._wetext.normalize(text)
        except Exception as exc:  # any wetext failure: fall back to piecewise
            _LOGGER.debug("wetext failed on %r (%r); verbalising piecewise", text, exc)
        pieces = _WHITESPACE_RUN.split(text)  # odd indices are the whitespace runs
        return "".join(
            piece if index % 2 else self._verbalise_piece(piece) for index, piece in enumerate(pieces)
        )

    def _verbalise_piece(self, piece: str) -> str:
        if not piece:
            return piece
        try:
            return self._wetext.normalize(piece)
        except Exception as exc:  # a piece wetext cannot handle stays as it is
            _LOGGER.warning("wetext failed on %r (%r); keeping it without verbalisation", piece, exc)
            return piece

    def _token_length(self, text: str) -> int:
        if self.count_tokens is None:
            raise TrtCosyError(
                "Splitting English text needs a token counter: build TextNormalizer(..., "
                "count_tokens=tokenizer.count_tokens)."
            )
        return self.count_tokens(text)


def _skips_frontend(text: str) -> bool:
    """Official rule: text with ``<|`` and ``|>`` (special tokens) and empty text are left untouched."""
    return text == "" or ("<|" in text and "|>" in text)


def _load_wetext():
    try:
        from wetext import Normalizer
    except ImportError as exc:
        raise MissingDependencyError(
            f"'wetext' is not installed ({exc}). Install it with: pip install 'trt-cosy[cpu]', "
            "or use the text normaliser engine 'none'."
        ) from exc
    # lang="auto": wetext 0.1.x asserts when lang="en" meets Chinese text; the official code uses the
    # defaults (auto, tn, remove_erhua=False) for both its zh and en models, so one instance serves both.
    return Normalizer(lang="auto")
