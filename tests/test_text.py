"""Text normalisation and splitting against the official golden outputs (golden README §5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trt_cosy.errors import InputError, TrtCosyError
from trt_cosy.frontend.text import TextNormalizer, contains_chinese, spell_out_numbers, split_paragraph

GOLDEN = json.loads((Path(__file__).parent / "data" / "text" / "text_normalize.json").read_text("utf-8"))
CASES = GOLDEN["cases"]


def utf8_byte_count(text: str) -> int:
    """The golden's stand-in tokenizer for English splitting: one token per UTF-8 byte."""
    return len(text.encode("utf-8"))


@pytest.fixture(scope="module")
def rules_only() -> TextNormalizer:
    return TextNormalizer("none", count_tokens=utf8_byte_count)


@pytest.fixture(scope="module")
def with_wetext() -> TextNormalizer:
    pytest.importorskip("wetext", reason="wetext is not installed (pip install 'trt-cosy[cpu]')")
    return TextNormalizer("wetext", count_tokens=utf8_byte_count)


def test_golden_has_all_cases():
    assert len(CASES) == 35
    assert sum(not case["split_tokenizer_independent"] for case in CASES) == 1


@pytest.mark.parametrize("case", CASES, ids=[f"case{case['id']}" for case in CASES])
def test_golden_normalized(rules_only, case):
    got = rules_only.normalize(case["input"])
    assert got == case["normalized"], (
        f"case {case['id']} ({case['branch']}): {got!r} != {case['normalized']!r}"
    )


@pytest.mark.parametrize("case", CASES, ids=[f"case{case['id']}" for case in CASES])
def test_golden_split(rules_only, case):
    # Every case can be compared: the golden split English text with the same byte-count stand-in.
    # `split_tokenizer_independent` only says whether a real BPE tokenizer could change the result.
    got = rules_only.split(case["input"])
    assert got == case["split"], f"case {case['id']} ({case['branch']}): {got!r} != {case['split']!r}"


def test_golden_split_with_one_token_per_word_still_matches_where_independent():
    # A much smaller length measure must not change the tokenizer-independent cases.
    normalizer = TextNormalizer("none", count_tokens=lambda text: len(text.split()))
    for case in CASES:
        if case["split_tokenizer_independent"]:
            assert normalizer.split(case["input"]) == case["split"], f"case {case['id']}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "2024年3月5日 共有123个苹果",
            "二零二四年三月五日共有一百二十三个苹果",
        ),  # wetext keeps the blank; replace_blank drops it
        ("今天是2024年3月15日，气温是25.5度。", "今天是二零二四年三月十五日，气温是二十五点五度。"),
        (
            "这件衣服打八折，原价￥299，现价239.2元。",
            "这件衣服打八折，原价两百九十九元，现价两百三十九点二元。",
        ),
        (
            "增长率达到了12.5%，比去年提高了3个百分点。",
            "增长率达到了百分之十二点五，比去年提高了三个百分点。",
        ),
        ("面积是100m²，体积是20m³。", "面积是一百平方米，体积是二十立方米。"),
        ("价格是$100或者€85。", "价格是一百美元或者八十五欧元。"),
        ("我喜欢用iPhone 15 Pro拍照，also 喜欢 MacBook。", "我喜欢用iPhone十五Pro拍照，also喜欢MacBook。"),
        ("温度-3℃，风速5m/s。", "温度负三摄氏度，风速每秒五米。"),
        ("结尾有逗号，", "结尾有逗号。"),
        ("I have $5.20", "I have five point two dollars"),
        ("I have 3 apples and 25 oranges.", "I have three apples and twenty five oranges."),
        ("It costs $12.50, about 15% off.", "It costs twelve point five dollars, about fifteen percent off."),
        ("In 1999, 2,000 people came.", "In nineteen ninety nine, two thousand people came."),
        (
            "The meeting is at 10:30 on 2024-03-15.",
            "The meeting is at ten thirty on the fifteenth of march twenty twenty four.",
        ),
        # wetext 0.1.8 asserts on runs of whitespace in English: the pieces are verbalised one by one.
        ("First line has 2 words.\n\nSecond has 3.", "First line has two words.\n\nSecond has three."),
        ("<|endofprompt|>Speak 3 times.", "<|endofprompt|>Speak 3 times."),
    ],
)
def test_wetext_normalize(with_wetext, text, expected):
    got = with_wetext.normalize(text)
    assert got == expected, f"{text!r}: {got!r} != {expected!r}"


def test_wetext_split_appends_final_mark_and_drops_punctuation(with_wetext):
    assert with_wetext.split("2024年3月5日 共有123个苹果") == ["二零二四年三月五日共有一百二十三个苹果。"]
    assert with_wetext.split("I have $5.20") == ["I have five point two dollars."]
    assert with_wetext.split("！？。") == []


def test_zh_split_merges_short_tail_and_cuts_long_text():
    sentence = "这是一个二十个字左右的句子用来测试切分逻辑好吗。"  # 24 characters
    segments = split_paragraph(sentence * 5 + "短。", "zh", len)
    assert segments == [sentence * 3, sentence * 2 + "短。"]


def test_closing_quote_stays_with_its_sentence():
    assert split_paragraph("他说：“好。”然后走了", "zh", len) == ["他说：“好。”然后走了。"]

    def per_sentence(part: str) -> int:  # 70 units per sentence: every sentence becomes a segment
        return 70 * part.count(".")

    assert split_paragraph('He said "Go." Then left', "en", per_sentence) == ['He said "Go."', " Then left."]


def test_en_split_uses_token_counts():
    text = "One two three. " * 12  # 12 sentences of 3 words
    segments = split_paragraph(text.strip(), "en", lambda part: len(part.split()) * 4)
    assert len(segments) == 2, segments
    assert "".join(segments) == text.strip()


def test_spell_out_numbers_keeps_official_quirks():
    assert spell_out_numbers("3rd 2,000 10:30") == "threerd two,zero ten:thirty"
    assert spell_out_numbers("0 and 007") == "zero and seven"
    huge = "1" + "0" * 40  # beyond inflect's named powers: spelled digit by digit instead of crashing
    assert spell_out_numbers(huge) == " ".join(["one"] + ["zero"] * 40)


def test_blank_rules_between_ascii_and_cjk(rules_only):
    assert rules_only.normalize("中文 中文 abc def 中文 A - B") == "中文中文abc def中文A，B"


def test_whitespace_only_and_skip_cases(rules_only):
    assert rules_only.normalize("   ") == ""
    assert rules_only.split("   ") == []
    assert rules_only.split("") == [""]
    assert rules_only.split("  <|endofprompt|>x  ") == ["  <|endofprompt|>x  "]


def test_contains_chinese():
    assert contains_chinese("abc中")
    assert not contains_chinese("！？。 abc")


def test_english_split_without_token_counter_raises():
    normalizer = TextNormalizer("none")
    assert normalizer.split("中文没有问题") == ["中文没有问题。"]
    with pytest.raises(TrtCosyError, match="count_tokens"):
        normalizer.split("English needs a tokenizer.")


def test_unknown_engine_raises():
    with pytest.raises(InputError, match="wetext"):
        TextNormalizer("ttsfrd")  # type: ignore[arg-type]
