"""`trt-cosy make-test-model`: random weights in exactly the official release layout (v1, v2, v3)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from trt_cosy.cli import main
from trt_cosy.errors import InputError
from trt_cosy.models.registry import read_release_config

torch = pytest.importorskip("torch", reason="make-test-model needs the [build] extra")

DATA = Path(__file__).parent / "data"
GOLDEN = {"v1": DATA / "cosyvoice1-tiny", "v3": DATA / "cosyvoice3-tiny"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("release") / "tiny"
    result = CliRunner().invoke(main, ["make-test-model", "--out", str(out), "--seed", "3"])
    assert result.exit_code == 0, result.output
    return out


def _state(path: Path) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in torch.load(path, weights_only=True).items()}


@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt"])
def test_same_keys_and_shapes_as_the_official_tiny_checkpoint(
    tiny_model: Path, v2_tiny_dir: Path, name: str
) -> None:
    ours, official = _state(tiny_model / name), _state(v2_tiny_dir / name)
    assert ours == official


def test_layout_and_config(tiny_model: Path, v2_tiny_dir: Path) -> None:
    for name in (
        "cosyvoice2.yaml",
        "llm.pt",
        "flow.pt",
        "hift.pt",
        "campplus.onnx",
        "speech_tokenizer_v2.onnx",
        "CosyVoice-BlankEN/config.json",
        "CosyVoice-BlankEN/vocab.json",
        "CosyVoice-BlankEN/merges.txt",
        "CosyVoice-BlankEN/tokenizer_config.json",
    ):
        assert (tiny_model / name).is_file(), name
    assert read_release_config(tiny_model) == read_release_config(v2_tiny_dir)
    llm = torch.load(tiny_model / "llm.pt", weights_only=True)
    assert llm["llm.model.lm_head.weight"].data_ptr() == llm["llm.model.model.embed_tokens.weight"].data_ptr()


def test_loads_strictly_and_speaks_voiced_noise(tiny_model: Path) -> None:
    from trt_cosy.builder.reference import load_torch_model

    model = load_torch_model(tiny_model)
    mel = np.random.default_rng(0).normal(-4.0, 2.0, size=(1, 80, 20)).astype(np.float32)
    noise = np.random.default_rng(1).standard_normal((1, 20 * 480, 9)).astype(np.float32)
    out = model.runners["hift"].infer(
        {"mel": mel, "sine_noise": noise, "cache_source": np.zeros((1, 1, 0), np.float32)}
    )
    assert np.all(out["f0"] > 10.0), "calibrated f0 should be voiced"
    assert np.isfinite(out["wav"]).all() and np.abs(out["wav"]).max() > 1e-3


def test_standins_run_with_official_names(tiny_model: Path) -> None:
    from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner

    campplus = OrtRunner.from_path(tiny_model / "campplus.onnx", "campplus")
    tokenizer = OrtRunner.from_path(tiny_model / "speech_tokenizer_v2.onnx", "speech_tokenizer")
    assert campplus.input_names == ("input",) and campplus.output_names == ("output",)
    assert tokenizer.input_names == ("feats", "feats_length") and tokenizer.output_names == ("indices",)
    emb = campplus.infer({"input": np.zeros((1, 30, 80), np.float32)})["output"]
    assert emb.shape == (1, 192)
    tokens = tokenizer.infer(
        {
            "feats": np.random.default_rng(0).standard_normal((1, 128, 400)).astype(np.float32),
            "feats_length": np.array([400], np.int32),
        }
    )["indices"]
    assert tokens.shape == (1, 100) and tokens.min() >= 0 and tokens.max() < 6561


def test_tokenizer_has_the_cosyvoice_specials(tiny_model: Path) -> None:
    from trt_cosy.frontend.tokenizer import QwenTextTokenizer

    tokenizer = QwenTextTokenizer.from_dir(tiny_model / "CosyVoice-BlankEN")
    ids = tokenizer.encode("Hello<|endofprompt|>你好")
    assert tokenizer.token_to_id("<|endofprompt|>") in ids
    assert max(ids) < 2048


def test_same_seed_same_bytes_and_refuses_to_clobber(tmp_path: Path, tiny_model: Path) -> None:
    from trt_cosy.builder.testmodel.release import make_test_model

    again = make_test_model(tmp_path / "again", seed=3)
    for name in ("cosyvoice2.yaml", "CosyVoice-BlankEN/vocab.json", "campplus.onnx"):
        assert (again / name).read_bytes() == (tiny_model / name).read_bytes(), name
    a, b = (
        torch.load(again / "flow.pt", weights_only=True),
        torch.load(tiny_model / "flow.pt", weights_only=True),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(InputError, match="not empty"):
        make_test_model(again, seed=3)


# ------------------------------------------------------------------------------ CosyVoice 1 and 3


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    models = {}
    for family in ("v1", "v3"):
        out = root / family
        result = CliRunner().invoke(
            main, ["make-test-model", "--family", family, "--out", str(out), "--seed", "5"]
        )
        assert result.exit_code == 0, result.output
        assert f"random-weight {family} test model" in result.output
        models[family] = out
    return models


@pytest.mark.parametrize("family", ["v1", "v3"])
@pytest.mark.parametrize("name", ["llm.pt", "flow.pt", "hift.pt"])
def test_v1_v3_same_keys_and_shapes_as_golden(family_models: dict[str, Path], family: str, name: str) -> None:
    ours, official = _state(family_models[family] / name), _state(GOLDEN[family] / name)
    assert ours == official, sorted(set(ours) ^ set(official))[:10]


_LAYOUTS = {
    "v1": (
        "cosyvoice.yaml",
        "llm.pt",
        "flow.pt",
        "hift.pt",
        "spk2info.pt",
        "multilingual.tiktoken",
        "campplus.onnx",
        "speech_tokenizer_v1.onnx",
    ),
    "v3": (
        "cosyvoice3.yaml",
        "llm.pt",
        "flow.pt",
        "hift.pt",
        "campplus.onnx",
        "speech_tokenizer_v3.onnx",
        "CosyVoice-BlankEN/config.json",
        "CosyVoice-BlankEN/vocab.json",
        "CosyVoice-BlankEN/merges.txt",
        "CosyVoice-BlankEN/tokenizer_config.json",
    ),
}


@pytest.mark.parametrize("family", ["v1", "v3"])
def test_v1_v3_layout_and_config(family_models: dict[str, Path], family: str) -> None:
    model = family_models[family]
    for name in _LAYOUTS[family]:
        assert (model / name).is_file(), name
    config = read_release_config(model)
    assert config.family == family
    assert config == read_release_config(GOLDEN[family])
    if family == "v3":
        llm = torch.load(model / "llm.pt", weights_only=True)
        assert (
            llm["llm.model.lm_head.weight"].data_ptr()
            == llm["llm.model.model.embed_tokens.weight"].data_ptr()
        )


def test_v1_preset_speakers_in_the_official_format(family_models: dict[str, Path]) -> None:
    from trt_cosy.builder.spk2info import read_spk2info

    raw = torch.load(family_models["v1"] / "spk2info.pt", weights_only=True)
    assert {"中文女", "英文男"} <= set(raw)
    assert all(set(info) == {"embedding"} and info["embedding"].shape == (1, 192) for info in raw.values())
    speakers = read_spk2info(family_models["v1"] / "spk2info.pt")
    assert list(speakers) == list(raw) and len(speakers) >= 2
    assert not np.allclose(speakers["中文女"], speakers["英文男"])


def test_v1_tokenizer_reads_the_ranks_file(family_models: dict[str, Path]) -> None:
    from trt_cosy.models.v1.tokenizer import WhisperTextTokenizer

    tokenizer = WhisperTextTokenizer(family_models["v1"])  # multilingual.tiktoken in the release dir
    text_vocab = read_release_config(family_models["v1"]).llm.text_token_size
    assert len(tokenizer) <= text_vocab
    ids = tokenizer.encode("<|en|>Hello, this is a test. 你好，今天天气很好。<|endoftext|>")
    assert max(ids) < text_vocab and tokenizer.token_id("<|en|>") in ids
    assert tokenizer.decode(ids) == "<|en|>Hello, this is a test. 你好，今天天气很好。<|endoftext|>"
    assert len(ids) < len(
        "Hello, this is a test. 你好，今天天气很好。".encode()
    )  # real merges, not bytes only


@pytest.mark.parametrize(("family", "tokens", "codes"), [("v1", 200, 4096), ("v3", 100, 6561)])
def test_v1_v3_standin_tokenizers(
    family_models: dict[str, Path], family: str, tokens: int, codes: int
) -> None:
    from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner

    tokenizer = OrtRunner.from_path(
        family_models[family] / f"speech_tokenizer_{family}.onnx", "speech_tokenizer"
    )
    assert tokenizer.input_names == ("feats", "feats_length") and tokenizer.output_names == ("indices",)
    feats = np.random.default_rng(0).standard_normal((1, 128, 400)).astype(np.float32)
    out = tokenizer.infer({"feats": feats, "feats_length": np.array([400], np.int32)})["indices"]
    assert out.shape == (1, tokens) and out.min() >= 0 and out.max() < codes
    assert len(np.unique(out)) > 10  # not a constant code


@pytest.mark.parametrize("family", ["v1", "v3"])
def test_v1_v3_load_strictly_and_speak_voiced_noise(family_models: dict[str, Path], family: str) -> None:
    from trt_cosy.builder.reference import load_torch_model

    model = load_torch_model(family_models[family], threads=1, hift_noise_seconds=1)
    frames = 20
    hop = model.config.hift.samples_per_frame
    mel = np.random.default_rng(0).normal(-4.0, 2.0, size=(1, 80, frames)).astype(np.float32)
    if family == "v1":
        feed = {
            "mel": mel,
            "sine_noise": np.random.default_rng(1).standard_normal((1, frames * hop, 9)).astype(np.float32),
            "rand_phase": np.random.default_rng(2).random((1, 9)).astype(np.float32),
            "cache_source": np.zeros((1, 1, 0), np.float32),
        }
        out = model.runners["v1_hift"].infer(feed)
    else:
        out = model.runners["hift"].infer({"mel": mel, "sine_noise": model.hift_noise[:, : frames * hop]})
    assert np.all(out["f0"] > 10.0), "calibrated f0 should be voiced"
    assert np.isfinite(out["wav"]).all() and np.abs(out["wav"]).max() > 1e-3


def test_unknown_family_is_refused(tmp_path: Path) -> None:
    from trt_cosy.builder.testmodel.release import make_test_model

    with pytest.raises(InputError, match="unknown family"):
        make_test_model(tmp_path / "x", family="v4")
