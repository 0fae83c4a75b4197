"""CosyVoice2/3 text tokenizer: Qwen2 byte-level BPE plus the CosyVoice special tokens (spec §2.3).

Built with the `tokenizers` library only (no transformers). It reproduces what the official
``CosyVoice2Tokenizer`` / ``CosyVoice3Tokenizer`` get from ``AutoTokenizer.from_pretrained(CosyVoice-BlankEN)``
followed by ``add_special_tokens``: a listed token already in the vocabulary keeps its id, every other one
gets the next free id, in list order. On the released vocabulary ``<|endoftext|>`` = 151643,
``<|im_start|>`` = 151644, ``<|im_end|>`` = 151645, ``<|endofprompt|>`` = 151646 … ``[mn]`` = 151662 for
both families; v2 stops there (``len()`` = 151663), v3 goes on with ``<|endofsystem|>`` = 151663, the
ARPAbet phones ``[AA]`` = 151664 … ``[ZH]`` = 151747 and the pinyin units ``[a]`` = 151748 … ``[ǜ]`` =
151923 (``len()`` = 151924). Pick the list with `special_tokens_for`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from ..errors import ModelDirError
from ..family_lookup import FAMILIES, families_where

__all__ = [
    "COSYVOICE2_SPECIAL_TOKENS", "COSYVOICE3_SPECIAL_TOKENS", "ENDOFTEXT", "QWEN2_SPLIT_PATTERN",
    "QwenTextTokenizer", "build_qwen2_tokenizer", "special_tokens_for"
]

_LOGGER = logging.getLogger(__name__)

ENDOFTEXT: Final = "<|endoftext|>"
ENDOFPROMPT: Final = "<|endofprompt|>"
# Official CosyVoice2Tokenizer additional_special_tokens, in list order (ids follow this order).
COSYVOICE2_SPECIAL_TOKENS: Final = (
    "<|im_start|>",
    "<|im_end|>",
    ENDOFPROMPT,
    "[breath]",
    "<strong>",
    "</strong>",
    "[noise]",
    "[laughter]",
    "[cough]",
    "[clucking]",
    "[accent]",
    "[quick_breath]",
    "<laughter>",
    "</laughter>",
    "[hissing]",
    "[sigh]",
    "[vocalized-noise]",
    "[lipsmack]",
    "[mn]",
)
ENDOFSYSTEM: Final = "<|endofsystem|>"
# CosyVoice3's ARPAbet phones (the CMUdict set) in alphabetical order; a vowel is followed by its
# stressed forms 0, 1, 2 (``[AA]``, ``[AA0]``, ``[AA1]``, ``[AA2]``, ``[AE]`` …).
_ARPABET_PHONES: Final = (
    "AA AE AH AO AW AY B CH D DH EH ER EY F G HH IH IY JH K L M N NG OW OY P R S SH T TH UH UW V W Y Z ZH"
).split()
_ARPABET_VOWELS: Final = frozenset("AA AE AH AO AW AY EH ER EY IH IY OW OY UH UW".split())
# CosyVoice3's pinyin initials and tone-marked finals, in code-point order (the official list's order).
_PINYIN_UNITS: Final = """
    a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng
    ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u
    uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi
    uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í
    ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū
    ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ
""".split()


def _arpabet_tokens() -> tuple[str, ...]:
    tokens = []
    for phone in _ARPABET_PHONES:
        stresses = ("", "0", "1", "2") if phone in _ARPABET_VOWELS else ("",)
        tokens.extend(f"[{phone}{stress}]" for stress in stresses)
    return tuple(tokens)


# Official CosyVoice3Tokenizer additional_special_tokens, in list order: the v2 list, <|endofsystem|>,
# 84 ARPAbet tokens, 176 pinyin tokens (280 in all; 278 are new on the released vocabulary).
COSYVOICE3_SPECIAL_TOKENS: Final = (
    *COSYVOICE2_SPECIAL_TOKENS,
    ENDOFSYSTEM,
    *_arpabet_tokens(),
    *(f"[{unit}]" for unit in _PINYIN_UNITS),
)
# Qwen2's pre-tokenizer split pattern (contractions, letter runs, single digits, punctuation, spaces).
QWEN2_SPLIT_PATTERN: Final = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_MERGES_HEADER: Final = "#version:"


def special_tokens_for(family: str) -> tuple[str, ...]:
    """The special tokens the official tokenizer of ``family`` adds, in id order (``Family.text_special_tokens``).

    Raises:
        ValueError: ``family`` has no Qwen2 text tokenizer (CosyVoice 1 uses the whisper one).
    """
    known = FAMILIES.get(family)
    tokens = known.text_special_tokens if known is not None else None
    if tokens is None:
        qwen = families_where(lambda known: known.text_special_tokens is not None)
        raise ValueError(
            f"model family {family!r} has no Qwen2 text tokenizer; expected one of "
            f"{', '.join(qwen)} (CosyVoice 1 uses WhisperTextTokenizer)."
        )
    return tokens


def build_qwen2_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """A Qwen2 byte-level BPE tokenizer (NFC, Qwen2 split regex, byte-level) with no added tokens."""
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _special(content: str) -> AddedToken:
    # What transformers creates for special tokens: matched on the raw text, no stripping.
    return AddedToken(content, special=True, normalized=False, lstrip=False, rstrip=False, single_word=False)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirError(
            f"Cannot read {path} ({exc}); re-download the model's Qwen tokenizer files."
        ) from exc


def _read_vocab(path: Path) -> dict[str, int]:
    vocab = _read_json(path)
    if not isinstance(vocab, dict) or not all(
        isinstance(token, str) and isinstance(index, int) for token, index in vocab.items()
    ):
        raise ModelDirError(f"{path} is not a JSON object of token -> id; re-download the tokenizer files.")
    return vocab


def _read_merges(path: Path) -> list[tuple[str, str]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelDirError(
            f"Cannot read {path} ({exc}); re-download the model's Qwen tokenizer files."
        ) from exc
    merges = []
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or (number == 1 and line.startswith(_MERGES_HEADER)):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ModelDirError(f"{path} line {number} is not a 'left right' merge: {line!r}.")
        merges.append((parts[0], parts[1]))
    return merges


def _configured_added_tokens(config_path: Path) -> list[tuple[int, str]]:
    """(id, content) of ``added_tokens_decoder`` in tokenizer_config.json, sorted by id; [] when absent."""
    if not config_path.is_file():
        return []
    config = _read_json(config_path)
    decoder = config.get("added_tokens_decoder", {}) if isinstance(config, dict) else None
    if not isinstance(decoder, dict):
        raise ModelDirError(f"{config_path}: 'added_tokens_decoder' is not an object; re-download it.")
    try:
        return sorted((int(index), str(entry["content"])) for index, entry in decoder.items())
    except (ValueError, TypeError, KeyError) as exc:
        raise ModelDirError(f"{config_path}: malformed 'added_tokens_decoder' entry ({exc}).") from exc


def _load_base(qwen_dir: Path) -> Tokenizer:
    tokenizer_json = qwen_dir / "tokenizer.json"
    if tokenizer_json.is_file():
        try:
            return Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # tokenizers raises a plain Exception on bad JSON
            raise ModelDirError(f"Cannot load {tokenizer_json} ({exc}); re-download it.") from exc
    missing = [name for name in ("vocab.json", "merges.txt") if not (qwen_dir / name).is_file()]
    if missing:
        raise ModelDirError(
            f"{qwen_dir} has no tokenizer.json and is missing {', '.join(missing)}: copy the Qwen tokenizer "
            "files (vocab.json, merges.txt, tokenizer_config.json) of the release into it."
        )
    vocab = _read_vocab(qwen_dir / "vocab.json")
    merges = _read_merges(qwen_dir / "merges.txt")
    try:
        return build_qwen2_tokenizer(vocab, merges)
    except Exception as exc:
        raise ModelDirError(
            f"vocab.json and merges.txt in {qwen_dir} do not form a BPE model ({exc})."
        ) from exc


def _add_tokens_in_order(tokenizer: Tokenizer, contents: Sequence[str]) -> None:
    """Add special tokens one by one, so that new ones get consecutive ids in list order."""
    for content in contents:
        tokenizer.add_special_tokens([_special(content)])


class QwenTextTokenizer:
    """Text → token ids for the CosyVoice2/3 LLM (no BOS/EOS are added).

    Args:
        tokenizer: a ready `tokenizers.Tokenizer` with the special tokens added; use `from_dir`.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer

    @classmethod
    def from_dir(
        cls, qwen_dir: str | Path, special_tokens: Sequence[str] = COSYVOICE2_SPECIAL_TOKENS
    ) -> QwenTextTokenizer:
        """Load the tokenizer of a ``CosyVoice-BlankEN`` directory.

        Uses ``tokenizer.json`` when present, else ``vocab.json`` + ``merges.txt``; then adds the
        tokens of ``tokenizer_config.json``'s ``added_tokens_decoder`` (by id), ``<|endoftext|>`` and
        ``special_tokens`` in order (tokens already present keep their ids). The default is the
        CosyVoice2 list; pass ``special_tokens_for(family)`` for another family.

        Raises:
            ModelDirError: a file is missing or malformed, or an added token does not get the id that
                tokenizer_config.json records.
        """
        qwen_dir = Path(qwen_dir)
        if not qwen_dir.is_dir():
            raise ModelDirError(f"Qwen tokenizer directory {qwen_dir} does not exist; check the model path.")
        tokenizer = _load_base(qwen_dir)
        config_path = qwen_dir / "tokenizer_config.json"
        for index, content in _configured_added_tokens(config_path):
            _add_tokens_in_order(tokenizer, [content])
            if tokenizer.token_to_id(content) != index:
                raise ModelDirError(
                    f"{config_path} gives {content!r} id {index} but it got id "
                    f"{tokenizer.token_to_id(content)}; the tokenizer files do not belong together."
                )
        _add_tokens_in_order(tokenizer, [ENDOFTEXT, *special_tokens])
        _LOGGER.debug("Loaded Qwen tokenizer from %s: %d ids", qwen_dir, tokenizer.get_vocab_size())
        return cls(tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (e.g. ``<|endofprompt|>``) are one id."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def count_tokens(self, text: str) -> int:
        """Number of tokens of ``text`` (the English length measure of sentence splitting)."""
        return len(self.encode(text))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are left out by default, as the official decode does."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (e.g. ``"<|endofprompt|>"``), or None when it is not in the vocabulary."""
        return self._tokenizer.token_to_id(token)

    def __len__(self) -> int:
        """Number of ids including added tokens (151663 for the released CosyVoice2 vocabulary, 151924 for v3)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)
