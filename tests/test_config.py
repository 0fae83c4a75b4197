"""Reading release directories: the tagged-yaml reader and ModelConfig."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trt_cosy.config import ModelConfig
from trt_cosy.errors import ModelDirError
from trt_cosy.hyperyaml import Tagged, load_hyperyaml
from trt_cosy.models.registry import family_of_release, read_release_config
from trt_cosy.models.v1.config import V1ModelConfig
from trt_cosy.models.v3.config import V3ModelConfig


def test_reads_golden_tiny_config(v2_tiny_dir: Path) -> None:
    config = read_release_config(v2_tiny_dir)
    assert config.family == "v2"
    assert config.sample_rate == 24000
    assert config.llm.qwen.hidden_size == 64 and config.llm.qwen.num_layers == 2
    assert config.llm.speech_vocab_size == 6564
    assert config.llm.stop_tokens == (6561, 6562, 6563)
    assert (config.llm.top_p, config.llm.top_k, config.llm.win_size, config.llm.tau_r) == (0.8, 25, 10, 0.1)
    assert config.flow.encoder.output_size == 64 and config.flow.encoder.num_blocks == 2
    # static_chunk_size: !ref <chunk_size> * <token_mel_ratio> -> 50
    assert config.flow.estimator.static_chunk_size == 50
    assert config.flow.estimator.channels == (64,)
    assert config.hift.base_channels == 64 and config.hift.samples_per_frame == 480
    assert config.flow.cfm.inference_cfg_rate == 0.7


def test_config_round_trips_to_json(v2_tiny_dir: Path) -> None:
    config = read_release_config(v2_tiny_dir)
    assert json.loads(json.dumps(config.to_dict()))["llm"]["qwen"]["vocab_size"] == 2048


def test_tags_are_data_and_refs_evaluate(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text(
        "__seed: !apply:torch.manual_seed [1986]\n"
        "a: 25\nb: 2\n"
        "c: !ref <a> * <b> + 1\n"
        "d: !new:pkg.mod.Klass\n    width: !ref <a>\n    inner: !name:pkg.f\n        k: 3\n"
        "e: !ref <d>\n",
        encoding="utf-8",
    )
    doc = load_hyperyaml(path)
    assert doc["c"] == 51
    assert isinstance(doc["d"], Tagged) and doc["d"].class_name == "Klass" and doc["d"]["width"] == 25
    assert doc["d"]["inner"].kind == "name" and doc["d"]["inner"]["k"] == 3
    assert doc["__seed"].kind == "apply" and doc["__seed"].args == [1986]
    assert doc["e"] is doc["d"]


def test_bad_ref_names_file(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("a: !ref <missing>\n", encoding="utf-8")
    with pytest.raises(ModelDirError, match="missing"):
        load_hyperyaml(path)


def test_missing_dir_and_yaml(tmp_path: Path) -> None:
    with pytest.raises(ModelDirError, match="does not exist"):
        read_release_config(tmp_path / "nope")
    with pytest.raises(ModelDirError, match="cosyvoice2.yaml") as info:
        read_release_config(tmp_path)
    assert "cosyvoice.yaml" in str(info.value) and "cosyvoice3.yaml" in str(info.value)


@pytest.mark.parametrize(
    ("name", "family", "kind", "sample_rate"),
    [
        ("cosyvoice1-tiny", "v1", V1ModelConfig, 22050),
        ("cosyvoice2-tiny", "v2", ModelConfig, 24000),
        ("cosyvoice3-tiny", "v3", V3ModelConfig, 24000),
    ],
)
def test_dispatches_by_yaml(name: str, family: str, kind: type, sample_rate: int) -> None:
    model_dir = Path(__file__).parent / "data" / name
    assert family_of_release(model_dir).name == family
    config = read_release_config(model_dir)
    assert type(config) is kind and config.family == family and config.sample_rate == sample_rate
    assert json.loads(json.dumps(config.to_dict()))["family"] == family


def test_yaml_order_is_the_official_one(tmp_path: Path, v2_tiny_dir: Path) -> None:
    """AutoModel checks cosyvoice.yaml, then cosyvoice2.yaml, then cosyvoice3.yaml."""
    for name in ("cosyvoice3.yaml", "cosyvoice2.yaml", "cosyvoice.yaml"):
        (tmp_path / name).write_text("sample_rate: 1\n", encoding="utf-8")
        assert family_of_release(tmp_path).name == {"cosyvoice3.yaml": "v3", "cosyvoice2.yaml": "v2"}.get(name, "v1")


def test_other_family_yaml_is_read_and_checked(tmp_path: Path) -> None:
    (tmp_path / "cosyvoice.yaml").write_text("sample_rate: 22050\n", encoding="utf-8")
    with pytest.raises(ModelDirError, match="cosyvoice.yaml.*TransformerLM"):
        read_release_config(tmp_path)
    (tmp_path / "cosyvoice.yaml").unlink()
    (tmp_path / "cosyvoice3.yaml").write_text("sample_rate: 24000\n", encoding="utf-8")
    with pytest.raises(ModelDirError, match="config.json is missing"):
        read_release_config(tmp_path)


def test_malformed_yaml_and_qwen_config(tmp_path: Path, v2_tiny_dir: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(v2_tiny_dir, model, ignore=shutil.ignore_patterns("*.pt", "*.npz", "*.safetensors"))
    (model / "CosyVoice-BlankEN" / "config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ModelDirError, match="config.json"):
        read_release_config(model)
    (model / "CosyVoice-BlankEN" / "config.json").unlink()
    with pytest.raises(ModelDirError, match="config.json is missing"):
        read_release_config(model)
    (model / "cosyvoice2.yaml").write_text("llm: [unclosed\n", encoding="utf-8")
    with pytest.raises(ModelDirError, match="not valid YAML"):
        read_release_config(model)


def test_wrong_class_is_reported(tmp_path: Path, v2_tiny_dir: Path) -> None:
    model = tmp_path / "m"
    shutil.copytree(v2_tiny_dir, model, ignore=shutil.ignore_patterns("*.pt", "*.npz", "*.safetensors"))
    text = (model / "cosyvoice2.yaml").read_text(encoding="utf-8")
    (model / "cosyvoice2.yaml").write_text(
        text.replace("llm.llm.Qwen2LM", "llm.llm.TransformerLM"), encoding="utf-8"
    )
    with pytest.raises(ModelDirError, match="Qwen2LM"):
        read_release_config(model)
