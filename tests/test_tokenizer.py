"""The Qwen2 text tokenizer (tokenizers library) and the test-tokenizer writer (spec §2.3)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers

from trt_cosy.builder.testmodel.tokenizer_writer import write_test_tokenizer
from trt_cosy.errors import InputError, ModelDirError
from trt_cosy.frontend.tokenizer import (
    COSYVOICE2_SPECIAL_TOKENS,
    ENDOFTEXT,
    QwenTextTokenizer,
    build_qwen2_tokenizer,
)

TINY_TEXT_VOCAB = 2048  # the golden tiny model's Qwen2 vocab_size
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
TEXTS = (
    "你好，世界！今天天气很好，我们一起去公园散步吧。",
    "Hello, world! Text to speech turns words into speech.",
    "我喜欢用 iPhone 拍照, also 喜欢 MacBook. 2024年3月5日",
    "Tabs\tnew lines\n\nemoji 😀, accents café, full-width ＡＢＣ１２３",
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    qwen_dir = tmp_path_factory.mktemp("CosyVoice-BlankEN")
    write_test_tokenizer(qwen_dir, TINY_TEXT_VOCAB)
    return qwen_dir


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> QwenTextTokenizer:
    return QwenTextTokenizer.from_dir(tokenizer_dir)


def copy_dir(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_writer_layout_is_official_and_deterministic(tokenizer_dir, tmp_path):
    assert sorted(path.name for path in tokenizer_dir.iterdir()) == sorted(TOKENIZER_FILES)
    assert (tokenizer_dir / "merges.txt").read_text("utf-8").startswith("#version: 0.2\n")
    write_test_tokenizer(tmp_path, TINY_TEXT_VOCAB)
    for name in TOKENIZER_FILES:
        assert (tmp_path / name).read_bytes() == (tokenizer_dir / name).read_bytes(), name


def test_round_trip(tokenizer):
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids and all(0 <= index < TINY_TEXT_VOCAB for index in ids)
        assert tokenizer.decode(ids) == text


def test_bpe_merges_shorten_common_text(tokenizer):
    text = "今天天气很好，我们一起去公园散步吧。"
    assert tokenizer.count_tokens(text) < len(text.encode("utf-8")) // 2


def test_special_tokens_have_consecutive_ids_in_official_order(tokenizer_dir, tokenizer):
    base = len(json.loads((tokenizer_dir / "vocab.json").read_text("utf-8")))
    tokens = (ENDOFTEXT, *COSYVOICE2_SPECIAL_TOKENS)
    assert [tokenizer.token_to_id(token) for token in tokens] == list(range(base, base + len(tokens)))
    assert len(tokenizer) == base + 20 <= TINY_TEXT_VOCAB
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text("utf-8"))
    recorded = {int(index): entry["content"] for index, entry in config["added_tokens_decoder"].items()}
    assert recorded == {base: ENDOFTEXT, base + 1: "<|im_start|>", base + 2: "<|im_end|>"}


def test_special_tokens_in_text_are_single_ids(tokenizer):
    endofprompt = tokenizer.token_to_id("<|endofprompt|>")
    ids = tokenizer.encode("Speak happily.<|endofprompt|>你好")
    assert ids.count(endofprompt) == 1
    assert ids[ids.index(endofprompt) + 1 :] == tokenizer.encode("你好")
    assert ids[: ids.index(endofprompt)] == tokenizer.encode("Speak happily.")
    breath = tokenizer.encode("[breath]")
    assert breath == [tokenizer.token_to_id("[breath]")]
    assert tokenizer.decode(ids) == "Speak happily.你好"  # specials skipped, as the official decode does
    assert tokenizer.decode(ids, skip_special_tokens=False) == "Speak happily.<|endofprompt|>你好"


def test_tokenizer_json_gives_the_same_ids(tokenizer_dir, tokenizer, tmp_path):
    vocab = json.loads((tokenizer_dir / "vocab.json").read_text("utf-8"))
    lines = (tokenizer_dir / "merges.txt").read_text("utf-8").splitlines()[1:]
    merges = [tuple(line.split()) for line in lines]
    build_qwen2_tokenizer(vocab, merges).save(str(tmp_path / "tokenizer.json"))
    from_json = QwenTextTokenizer.from_dir(tmp_path)
    assert len(from_json) == len(tokenizer)
    for text in (*TEXTS, "a<|endofprompt|>b[mn]"):
        assert from_json.encode(text) == tokenizer.encode(text)


def test_release_sized_vocab_gives_the_spec_ids(tmp_path):
    # Same shape as the released CosyVoice-BlankEN: 151643 BPE ids, three added tokens in the config.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab.update({f"tok{index}": index for index in range(len(alphabet), 151643)})
    (tmp_path / "vocab.json").write_text(json.dumps(vocab), "utf-8")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n", "utf-8")
    config = {
        "added_tokens_decoder": {
            str(151643 + offset): {"content": content, "special": True}
            for offset, content in enumerate((ENDOFTEXT, "<|im_start|>", "<|im_end|>"))
        }
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), "utf-8")
    tokenizer = QwenTextTokenizer.from_dir(tmp_path)
    assert tokenizer.token_to_id("<|im_end|>") == 151645
    assert tokenizer.token_to_id("<|endofprompt|>") == 151646
    assert tokenizer.token_to_id("[breath]") == 151647
    assert tokenizer.token_to_id("[mn]") == 151662
    assert len(tokenizer) == 151663


@pytest.mark.parametrize("name", ["vocab.json", "merges.txt"])
def test_missing_file_names_it(tokenizer_dir, tmp_path, name):
    qwen_dir = copy_dir(tokenizer_dir, tmp_path / "qwen")
    (qwen_dir / name).unlink()
    with pytest.raises(ModelDirError, match=name):
        QwenTextTokenizer.from_dir(qwen_dir)


def test_missing_directory(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        QwenTextTokenizer.from_dir(tmp_path / "absent")


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("vocab.json", "{not json", "vocab.json"),
        ("vocab.json", "[1, 2]", "vocab.json"),
        ("merges.txt", "#version: 0.2\nĠ t extra\n", "merges.txt line 2"),
        ("tokenizer_config.json", "{", "tokenizer_config.json"),
        ("tokenizer_config.json", '{"added_tokens_decoder": {"5": {"content": "<|endoftext|>"}}}', "id 5"),
        ("tokenizer.json", "{}", "tokenizer.json"),
    ],
)
def test_malformed_file_names_it(tokenizer_dir, tmp_path, name, content, message):
    qwen_dir = copy_dir(tokenizer_dir, tmp_path / "qwen")
    (qwen_dir / name).write_text(content, "utf-8")
    with pytest.raises(ModelDirError, match=message):
        QwenTextTokenizer.from_dir(qwen_dir)


def test_writer_rejects_too_small_vocab(tmp_path):
    with pytest.raises(InputError, match="at least 276"):
        write_test_tokenizer(tmp_path, 200)
