"""CosyVoice3's text tokenizer: the official v3 special-token list and its ids (spec §2.3).

The list is the ``additional_special_tokens`` of the official ``CosyVoice3Tokenizer``
(``cosyvoice/tokenizer/tokenizer.py``, lines 280-307 at FunAudioLLM/CosyVoice ace7c47); its SHA-256
below was taken from that file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from trt_cosy import families
from trt_cosy.builder.testmodel.tokenizer_writer import write_test_tokenizer
from trt_cosy.config import QWEN_DIR
from trt_cosy.frontend.tokenizer import (
    COSYVOICE2_SPECIAL_TOKENS,
    COSYVOICE3_SPECIAL_TOKENS,
    ENDOFTEXT,
    QwenTextTokenizer,
    special_tokens_for,
)

TINY_TEXT_VOCAB = 2048  # the golden tiny models' Qwen2 vocab_size (what testmodel_parts writes)
OFFICIAL_V3_SHA256 = "4d5267643001673d742c7033834779c1e24f936caaf7a9ce850807222ee94b91"  # "\n".join(list)
RELEASED_BPE_SIZE = 151643  # CosyVoice-BlankEN vocab.json entries; <|endoftext|> is the next id
MARKED_TEXT = "You are a helpful assistant.<|endofprompt|>[breath]你好[n][ǐ][h][ǎo][AA1]<|endofsystem|>"


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("CosyVoice-BlankEN")
    write_test_tokenizer(directory, TINY_TEXT_VOCAB)
    return directory


@pytest.fixture(scope="module")
def bpe_size(qwen_dir) -> int:
    return len(json.loads((qwen_dir / "vocab.json").read_text("utf-8")))


@pytest.fixture(scope="module")
def v3(qwen_dir) -> QwenTextTokenizer:
    return families.load_text_tokenizer("v3", qwen_dir)


@pytest.fixture(scope="module")
def v2(qwen_dir) -> QwenTextTokenizer:
    return families.load_text_tokenizer("v2", qwen_dir)


def test_v3_list_is_the_official_one():
    tokens = COSYVOICE3_SPECIAL_TOKENS
    digest = hashlib.sha256("\n".join(tokens).encode("utf-8")).hexdigest()
    assert digest == OFFICIAL_V3_SHA256, f"v3 list changed: {len(tokens)} tokens, sha256 {digest}"
    assert len(tokens) == len(set(tokens)) == 280
    assert tokens[:19] == COSYVOICE2_SPECIAL_TOKENS and tokens[19] == "<|endofsystem|>"
    assert tokens[20:24] == ("[AA]", "[AA0]", "[AA1]", "[AA2]") and tokens[103] == "[ZH]"
    assert tokens[104] == "[a]" and tokens[-1] == "[ǜ]"
    assert special_tokens_for("v3") is COSYVOICE3_SPECIAL_TOKENS
    assert special_tokens_for("v2") is COSYVOICE2_SPECIAL_TOKENS
    with pytest.raises(ValueError, match="WhisperTextTokenizer"):
        special_tokens_for("v1")


def test_v3_ids_follow_the_list_on_the_tiny_vocab(v3, bpe_size):
    """<|endoftext|> right after the BPE ids, then the 280 tokens consecutively, in list order."""
    for offset, token in enumerate((ENDOFTEXT, *COSYVOICE3_SPECIAL_TOKENS)):
        assert v3.token_to_id(token) == bpe_size + offset, (token, v3.token_to_id(token), bpe_size + offset)
    assert v3.token_to_id("<|endofprompt|>") == bpe_size + 3
    assert v3.token_to_id("[ǜ]") == bpe_size + 280
    assert len(v3) == bpe_size + 281, len(v3)


def test_v3_ids_on_the_released_vocab_size(tmp_path):
    """A stand-in vocab of the released size: ids as the official code hard-codes them (151646, …)."""
    vocab = {symbol: index for index, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({f"filler{index}": index for index in range(len(vocab), RELEASED_BPE_SIZE)})
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    added = {
        str(RELEASED_BPE_SIZE + k): {"content": c}
        for k, c in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}), "utf-8")
    tokenizer = families.load_text_tokenizer("v3", tmp_path)
    expected = {"<|endofprompt|>": 151646, "[mn]": 151662, "<|endofsystem|>": 151663, "[AA]": 151664}
    expected |= {"[ZH]": 151747, "[a]": 151748, "[ǜ]": 151923}
    measured = {token: tokenizer.token_to_id(token) for token in expected}
    assert measured == expected
    assert len(tokenizer) == 151924  # the official Triton v3 recipe's ORIGINAL_VOCAB_SIZE


def test_v3_markers_in_text_are_single_ids(v3, bpe_size):
    ids = v3.encode(MARKED_TEXT)
    markers = ["<|endofprompt|>", "[breath]", "[n]", "[ǐ]", "[h]", "[ǎo]", "[AA1]", "<|endofsystem|>"]
    marker_ids = [v3.token_to_id(token) for token in markers]
    assert [index for index in ids if index > bpe_size] == marker_ids, ids
    assert v3.decode(ids, skip_special_tokens=False) == MARKED_TEXT
    assert v3.decode(ids) == "You are a helpful assistant.你好"


def test_v2_is_unchanged(qwen_dir, v2, v3, bpe_size):
    for offset, token in enumerate((ENDOFTEXT, *COSYVOICE2_SPECIAL_TOKENS)):
        assert v2.token_to_id(token) == v3.token_to_id(token) == bpe_size + offset, token
    assert len(v2) == bpe_size + 20, len(v2)
    assert v2.token_to_id("<|endofsystem|>") is None and v2.token_to_id("[AA1]") is None
    assert len(v2.encode("[AA1]")) > 1  # ordinary BPE text for v2
    assert v2.encode(MARKED_TEXT) != v3.encode(MARKED_TEXT)
    plain = "Hello, world! 今天天气很好。<|endofprompt|>[breath]"
    assert v2.encode(plain) == v3.encode(plain)
    assert len(QwenTextTokenizer.from_dir(qwen_dir)) == len(v2)  # the default list is still v2's


def test_v3_test_model_tokenizer_fits_its_text_embedding(tmp_path):
    pytest.importorskip("torch", reason="needs the [build] extra (torch) to write the test model's Qwen folder")
    from trt_cosy.builder.testmodel.parts import write_qwen_dir
    from trt_cosy.families import load_text_tokenizer

    write_qwen_dir(tmp_path, "tiny", family="v3")
    rows = json.loads((tmp_path / QWEN_DIR / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    tokenizer = load_text_tokenizer("v3", tmp_path / QWEN_DIR)
    ids = tokenizer.encode("[breath]你好[AA1]<|endofsystem|>[ǜ]")
    assert len(tokenizer) <= rows and max(ids) < rows, (len(tokenizer), rows, ids)
