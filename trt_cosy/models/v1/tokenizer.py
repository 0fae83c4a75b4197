"""CosyVoice 1 text tokenizer: openai-whisper's multilingual tiktoken encoding (spec §2.3, v1).

The official v1 yaml builds ``whisper.tokenizer.get_tokenizer(multilingual=True, num_languages=100,
language='en', task='transcribe')`` and encodes with ``allowed_special='all'``. Importing
openai-whisper pulls in torch, so this module rebuilds the same ``tiktoken.Encoding`` from the
``multilingual.tiktoken`` ranks file directly: 50257 BPE ranks, then ``<|endoftext|>`` (50257),
``<|startoftranscript|>``, 100 language tokens, ``<|translate|>``, ``<|transcribe|>``,
``<|startoflm|>``, ``<|startofprev|>``, ``<|nospeech|>``, ``<|notimestamps|>`` (50364) and 1501
timestamps: 51866 ids. There is no ``<|endofprompt|>`` special in v1 (it is ordinary BPE text).
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from ...errors import ModelDirError

__all__ = [
    "WHISPER_LANGUAGES",
    "WHISPER_SPLIT_PATTERN",
    "V1_TOKENIZER_FILE",
    "WhisperTextTokenizer",
    "whisper_specials",
]

_LOGGER = logging.getLogger(__name__)

V1_TOKENIZER_FILE: Final = "multilingual.tiktoken"
WHISPER_SPLIT_PATTERN: Final = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)
# openai-whisper ``LANGUAGES`` keys, in dict order (the order fixes the language token ids).
WHISPER_LANGUAGES: Final = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt "
    "la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc "
    "ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue"
).split()
_TIMESTAMPS: Final = 1501  # <|0.00|> .. <|30.00|>


def whisper_specials(num_languages: int = 100) -> list[str]:
    """The special tokens appended after the BPE ranks, in id order (``whisper.tokenizer.get_encoding``)."""
    return [
        "<|endoftext|>",
        "<|startoftranscript|>",
        *[f"<|{lang}|>" for lang in WHISPER_LANGUAGES[:num_languages]],
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
        *[f"<|{i * 0.02:.2f}|>" for i in range(_TIMESTAMPS)],
    ]


def _read_ranks(path: Path) -> dict[bytes, int]:
    """``<base64 token> <rank>`` per line, as tiktoken's ``load_tiktoken_bpe`` reads it."""
    try:
        lines = Path(path).read_text(encoding="ascii").splitlines()
    except FileNotFoundError as exc:
        raise ModelDirError(
            f"{path} is missing: CosyVoice 1 needs openai-whisper's {V1_TOKENIZER_FILE} (whisper/assets/ in "
            "the openai-whisper package). Copy it into the model directory or pass its path."
        ) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"{path} is not a readable tiktoken ranks file ({exc}).") from exc
    ranks: dict[bytes, int] = {}
    try:
        for line in lines:
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    except (ValueError, binascii.Error) as exc:
        raise ModelDirError(f"{path} is not a tiktoken ranks file (bad line: {exc}).") from exc
    return ranks


class WhisperTextTokenizer:
    """``encode(text) -> list[int]`` with whisper's multilingual encoding; specials are recognised.

    Args:
        ranks_path: ``multilingual.tiktoken``, or a directory that holds it (the release dir).
        num_languages: language tokens to register (100 for the official v1 yaml).
    """

    def __init__(self, ranks_path: Path, num_languages: int = 100):
        try:
            import tiktoken
        except ImportError as exc:  # P10: name what to install
            raise ModelDirError("the CosyVoice 1 tokenizer needs `tiktoken`: pip install tiktoken") from exc
        path = Path(ranks_path)
        if path.is_dir():
            path = path / V1_TOKENIZER_FILE
        ranks = _read_ranks(path)
        specials = {token: len(ranks) + index for index, token in enumerate(whisper_specials(num_languages))}
        self.encoding = tiktoken.Encoding(
            name=path.name,
            explicit_n_vocab=len(ranks) + len(specials),
            pat_str=WHISPER_SPLIT_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        _LOGGER.debug("v1 tokenizer: %d ranks + %d specials from %s", len(ranks), len(specials), path)

    def __len__(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        """Official ``tokenizer.encode(text, allowed_special='all')``."""
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(list(ids))

    def token_id(self, token: str) -> int:
        """The id of a special token such as ``<|en|>`` or ``<|endoftext|>``."""
        return self.encoding.encode_single_token(token)
