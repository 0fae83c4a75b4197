"""TensorRT inputs for CosyVoice 1 and 3: profiles per family (fast), the float32 v1 HiFT phase against
the official float64-accumulated one (fast), and ``trt-cosy build --backend tensorrt --onnx-only`` on
the golden tiny checkpoints (slow): fp16 graphs without float64, profiles.json and tensorrt.json, the
fp16 graphs against their fp32 exports on the golden inputs (ONNX Runtime CPU), and the runtime's
checks before it needs a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import onnx
from click.testing import CliRunner
from onnx import TensorProto, helper

from trt_cosy.config import ModelConfig
from trt_cosy.errors import EngineMismatchError, InputError, MissingDependencyError, TrtCosyError
from trt_cosy.models.registry import read_release_config, trt_graphs, trt_profiles
from trt_cosy.models.v1 import graphs as graphs_v1
from trt_cosy.models.v3 import graphs as graphs_v3
from trt_cosy.runtime.backends.tensorrt.cuda import gpu_unavailable_reason
from trt_cosy.runtime.profiles import read_profiles

DATA = Path(__file__).parent / "data"
RELEASES = {"v1": DATA / "cosyvoice1-tiny", "v3": DATA / "cosyvoice3-tiny"}
FAMILY_GRAPHS = {"v1": graphs_v1.V1_GRAPHS, "v3": graphs_v3.GRAPHS_V3}

# fp16-vs-fp32 max error (max |d| / max(1, max |fp32|), worst output) measured on the golden inputs
# (docs/tensorrt.md, "CosyVoice 1 and 3"); bounds are about 4x that. HiFT source and f0 are fp32
# islands: exactly 0.
BOUNDS = {
    "v1": {
        "v1_text_encoder": 2e-3,
        "llm": 2e-3,
        "v1_flow_encoder": 4e-3,
        "flow_estimator": 6e-3,
        "v1_hift": 5e-4,
    },
    "v3": {
        "llm": 2e-3,
        "llm_decode": 2e-3,  # the batched decode step (Qwen2 families only)
        "flow_encoder": 1.5e-3,
        "flow_estimator": 1.5e-3,
        "flow_estimator_stream": 1.5e-3,
        "hift": 5e-4,
        "hift_stream": 5e-4,
    },
}


@pytest.fixture(scope="module")
def configs() -> dict[str, ModelConfig]:
    return {family: read_release_config(path) for family, path in RELEASES.items()}


# -- profiles (fast) --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["v1", "v3"])
def test_profiles_cover_the_family_graphs(configs, family):
    profiles = trt_profiles(configs[family])
    specs = trt_graphs(family)  # v3 adds the flow step graphs, v1 (its own flow) does not
    assert set(profiles) == set(specs)
    assert set(specs) - set(FAMILY_GRAPHS[family]) == (
        {"flow_step", "flow_step_stream"} if family == "v3" else set()
    )
    for name, graph in profiles.items():
        graph.check_spec(specs[name])


def _pick(profiles, graph: str, shapes: dict[str, tuple[int, ...]]) -> str:
    return profiles[graph].profiles[profiles[graph].select(shapes)].name


def test_v1_profile_selection_for_typical_shapes(configs):
    config = configs["v1"]
    profiles = trt_profiles(config)
    hop = config.hift.samples_per_frame  # 256 at 22.05 kHz

    def hift(frames: int, cached: int) -> dict[str, tuple[int, ...]]:
        return {
            "mel": (1, 80, frames),
            "sine_noise": (1, hop * frames, 9),
            "rand_phase": (1, 9),
            "cache_source": (1, 1, cached),
        }

    def encoder(tokens: int, frames: int) -> dict[str, tuple[int, ...]]:
        return {
            "tokens": (1, tokens),
            "embedding": (1, 192),
            "index0": (frames,),
            "index1": (frames,),
            "weight1": (frames,),
        }

    # a streaming chunk: 20 cached + 206 - 34 frames with the 5120-sample source cache
    assert _pick(profiles, "v1_hift", hift(192, 5120)) == "stream"
    assert _pick(profiles, "v1_hift", hift(1200, 0)) == "long"  # one 14 s utterance
    # prompt 25 + chunk 120 tokens; 43 + 206 frames (50 Hz tokens, 86.13 frames/s)
    assert _pick(profiles, "v1_flow_encoder", encoder(145, 249)) == "stream"
    assert _pick(profiles, "v1_flow_encoder", encoder(1200, config.flow.mel_frames(1200))) == "long"
    estimator = {
        "x": (2, 80, 2583),
        "mask": (2, 1, 2583),
        "mu": (2, 80, 2583),
        "t": (2,),
        "spks": (2, 80),
        "cond": (2, 80, 2583),
    }
    assert _pick(profiles, "flow_estimator", estimator) == "long"  # 1500 tokens = 30 s
    text = {"text_embeds": (1, 20, config.llm.text_encoder_input_size), "embedding": (1, 192)}
    assert _pick(profiles, "v1_text_encoder", text) == "text"
    lm = config.llm.llm
    cache = (lm.num_blocks, 1, lm.attention_heads, 300, lm.output_size // lm.attention_heads)
    step = {"inputs_embeds": (1, 1, config.llm.llm_input_size), "past_keys": cache, "past_values": cache}
    assert _pick(profiles, "llm", step) == "decode_512"
    with pytest.raises(InputError, match="beyond the largest TensorRT profile"):
        profiles["v1_hift"].select(hift(3000, 0))


def test_v3_profile_selection_for_typical_shapes(configs):
    config = configs["v3"]
    profiles = trt_profiles(config)
    hop = config.hift.samples_per_frame  # 480 at 24 kHz

    def hift(frames: int) -> dict[str, tuple[int, ...]]:
        return {"mel": (1, 80, frames), "sine_noise": (1, hop * frames, 9)}

    assert _pick(profiles, "hift_stream", hift(58)) == "stream"  # first chunk: 50 frames + look-ahead
    assert _pick(profiles, "hift", hift(2400)) == "long"
    with pytest.raises(InputError, match="allows"):  # the streaming vocoder needs 9 frames
        profiles["hift_stream"].select(hift(graphs_v3.HIFT_STREAM_MIN_FRAMES - 1))
    flow = {"tokens": (1, 105), "context": (1, 3), "context_valid": (1,), "embedding": (1, 192)}
    assert _pick(profiles, "flow_encoder", flow) == "stream"
    assert "streaming" not in profiles["flow_encoder"].input_names


# -- the v1 HiFT phase in float32 (fast) ------------------------------------------------------------


def test_v1_source_phase_is_float32_and_matches_the_official_rounding():
    torch = pytest.importorskip("torch")
    from trt_cosy.models.v1.export.hift import SineGenSource

    source = SineGenSource(22050, 8, 0.1, 0.003, 10.0, 256)
    generator = torch.Generator().manual_seed(0)
    f0 = torch.rand(1, 600, generator=generator) * 450 + 50  # f0: [1, F] Hz, 7 s
    f0[:, ::9] = 1.5  # unvoiced frames
    ours = source.cycles(f0).flatten(1, 2)  # [1, 256F, 9]
    assert ours.dtype == torch.float32
    step = f0.repeat_interleave(256, dim=1).unsqueeze(-1) * source.harmonic_numbers / 22050  # [1, S, 9]
    exact = torch.cumsum(step.to(torch.float64), dim=1)  # what torch's CPU cumsum accumulates
    official = exact.to(torch.float32)
    official = official - torch.floor(official)

    def wrapped(a, b):
        diff = (a.double() - b.double()).abs() % 1
        return torch.minimum(diff, 1 - diff)

    to_official, official_error = wrapped(ours, official), wrapped(official, exact - torch.floor(exact))
    mismatched = float((to_official > 0).double().mean())
    # Equal to the official float32 rounding except where X is within 2^-24 of a rounding boundary;
    # there one float32 ulp of X apart, the size of the official's own rounding error.
    assert mismatched < 1e-2, f"{mismatched:.2e} of the samples differ from the official phase"
    assert to_official.max() <= 2 * official_error.max() + 1e-7, (
        f"max {to_official.max():.3e} cycles from the official phase, whose own error is "
        f"{official_error.max():.3e}"
    )
    naive = torch.cumsum(step, dim=1)  # float32 sum; CPU torch still accumulates in float64
    assert (wrapped(naive - torch.floor(naive), official)).max() <= 1e-6


def test_float64_graphs_are_refused():
    from trt_cosy.builder.quantize.precision import convert_model_fp16

    nodes = [
        helper.make_node("Cast", ["x"], ["x64"], to=TensorProto.DOUBLE),
        helper.make_node("CumSum", ["x64", "axis"], ["c64"]),
        helper.make_node("Cast", ["c64"], ["y"], to=TensorProto.FLOAT),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "S"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "S"])],
        [helper.make_tensor("axis", TensorProto.INT64, [], [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(TrtCosyError, match="TensorRT has no float64"):
        convert_model_fp16(model)


# -- build --backend tensorrt --onnx-only on the golden tiny checkpoints (slow) -----------------------


def _build(factory: pytest.TempPathFactory, family: str) -> Path:
    from trt_cosy.cli import main

    out = factory.mktemp(f"trt-{family}") / "engines"
    args = [
        "build",
        "--model-dir",
        str(RELEASES[family]),
        "--out",
        str(out),
        "--backend",
        "tensorrt",
        "--onnx-only",
    ]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("torch", reason="building engines needs the [build] extra")
    return {family: _build(tmp_path_factory, family) for family in ("v1", "v3")}


def _golden(family: str) -> dict[str, np.ndarray]:
    with np.load(RELEASES[family] / "reference.npz") as data:
        return {key: data[key] for key in data.files if key != "meta_json"}


def _estimator(golden: dict[str, np.ndarray], z: np.ndarray, prompt: int) -> dict[str, np.ndarray]:
    mu = golden["nonstream_c0_flow_mu"].transpose(0, 2, 1)  # [1, 80, F]
    frames = mu.shape[2]
    cond = np.zeros((2, 80, frames), np.float32)
    cond[0, :, :prompt] = golden["in_prompt_feat"][0, :prompt].T
    return {
        "x": np.repeat(z[:, :, :frames].astype(np.float32), 2, 0),  # [2, 80, F]
        "mask": np.ones((2, 1, frames), np.float32),
        "mu": np.concatenate([mu, 0 * mu]).astype(np.float32),
        "t": np.array([0.5, 0.5], np.float32),
        "spks": np.random.default_rng(0).standard_normal((2, 80)).astype(np.float32),
        "cond": cond,
    }


def _empty_cache(dims: tuple[int, int, int]) -> np.ndarray:
    layers, heads, head_dim = dims  # [L, 1, H, 0, Dh]
    return np.zeros((layers, 1, heads, 0, head_dim), np.float32)


def _v1_feeds(engines: Path, config) -> dict[str, list[dict[str, np.ndarray]]]:
    from trt_cosy.models.v1.stages import regulator_indices

    golden = _golden("v1")
    lm = config.llm.llm
    empty = _empty_cache((lm.num_blocks, lm.attention_heads, lm.output_size // lm.attention_heads))
    text = np.concatenate([golden["in_prompt_text"], golden["in_text"]], 1)[0]
    prompt, target = golden["in_prompt_speech_token"], golden["nonstream_c0_flow_tokens"]
    prompt_frames = golden["in_prompt_feat"].shape[1]
    index0, index1, weight1 = regulator_indices(prompt.shape[1], target.shape[1], prompt_frames, config.flow)

    def hift(key: str) -> dict[str, np.ndarray]:
        return {
            "mel": golden[f"{key}_hift_mel"],
            "sine_noise": golden[f"{key}_hift_sine_noise"].astype(np.float32).transpose(0, 2, 1),
            "rand_phase": golden[f"{key}_hift_rand_phase"].astype(np.float32)[:, :, 0],
            "cache_source": golden[f"{key}_hift_cache_source"],
        }

    return {
        "v1_text_encoder": [
            {
                "text_embeds": np.load(engines / "text_embedding.npy")[text][None],
                "embedding": golden["in_spk_embedding"],
            }
        ],
        "llm": [{"inputs_embeds": golden["llm_tf_lm_input"], "past_keys": empty, "past_values": empty}],
        "v1_flow_encoder": [
            {
                "tokens": np.concatenate([prompt, target], 1).astype(np.int64),
                "embedding": golden["in_spk_embedding"],
                "index0": index0,
                "index1": index1,
                "weight1": weight1,
            }
        ],
        "flow_estimator": [_estimator(golden, golden["nonstream_c0_flow_z"], prompt_frames)],
        "v1_hift": [hift("nonstream_c0"), hift("stream_c1")],
    }


def _v3_feeds(engines: Path, config) -> dict[str, list[dict[str, np.ndarray]]]:
    golden = _golden("v3")
    qwen = config.llm.qwen
    empty = _empty_cache((qwen.num_layers, qwen.num_kv_heads, qwen.head_dim))
    tokens = np.concatenate([golden["in_prompt_speech_token"], golden["in_target_speech_token"]], 1)
    noise = np.load(engines / "hift_noise.npy", mmap_mode="r")  # [1, S, 9]

    def hift(mel: np.ndarray) -> dict[str, np.ndarray]:
        samples = mel.shape[2] * config.hift.samples_per_frame
        return {"mel": mel, "sine_noise": np.ascontiguousarray(noise[:, :samples])}

    estimator = _estimator(golden, golden["flow_rand_noise"], golden["in_prompt_feat"].shape[1])
    mel = golden["nonstream_c0_hift_mel"]  # [1, 80, 160]
    return {
        "llm": [{"inputs_embeds": golden["llm_tf_lm_input"], "past_keys": empty, "past_values": empty}],
        "flow_encoder": [
            {
                "tokens": tokens[:, :-3].astype(np.int64),
                "context": tokens[:, -3:].astype(np.int64),
                "context_valid": np.ones(1, np.float32),
                "embedding": golden["in_spk_embedding"],
            }
        ],
        "flow_estimator": [estimator],
        "flow_estimator_stream": [estimator],
        "hift": [hift(mel), hift(golden["in_hift_synth_mel"])],
        "hift_stream": [hift(mel), hift(mel[:, :, :58])],
    }


@pytest.mark.slow
@pytest.mark.parametrize("family", ["v1", "v3"])
def test_onnx_only_writes_fp16_graphs_profiles_and_summary(built, configs, family):
    out = built[family]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == "tensorrt" and manifest["precision"] == "fp16"
    summary = json.loads((out / "tensorrt.json").read_text())
    profiles = read_profiles(out / "profiles.json")
    batched = {"llm_decode"} if family == "v3" else set()  # the Qwen2 LLMs get the batched decode graph
    assert set(summary["graphs"]) == set(profiles) == set(trt_graphs(family)) | batched
    assert summary["family"] == family
    for name, entry in summary["graphs"].items():
        assert entry["onnx"] == f"{name}.fp16.onnx" and entry["onnx"] in manifest["files"]
        model = onnx.load(str(out / entry["onnx"]), load_external_data=False)
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        dtypes = {v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.output)}
        dtypes |= {t.data_type for t in model.graph.initializer}
        casts = {a.i for n in model.graph.node for a in n.attribute if n.op_type == "Cast" and a.name == "to"}
        assert TensorProto.DOUBLE not in dtypes | casts, f"{name}: float64 in a TensorRT graph"
        assert TensorProto.FLOAT16 in dtypes, f"{name}: nothing runs in fp16"
        if "derived_from" in entry:  # a flow step graph: the wrapped estimator was measured itself
            assert entry["derived_from"] in summary["graphs"], entry
            continue
        worst = max(entry["fp16_vs_fp32_max_error"].values())
        assert worst < BOUNDS[family][name], f"{name}: export feeds {entry['fp16_vs_fp32_max_error']}"
    assert not (out / "plans").exists()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["v1", "v3"])
def test_fp16_graphs_track_fp32_on_golden_inputs(built, configs, family):
    from trt_cosy.builder.quantize.precision import compare_fp16

    out, config = built[family], configs[family]
    feeds = (_v1_feeds if family == "v1" else _v3_feeds)(out, config)
    assert set(feeds) == set(FAMILY_GRAPHS[family])
    measured = {}
    for name, graph_feeds in feeds.items():
        errors = compare_fp16(out / f"{name}.onnx", out / f"{name}.fp16.onnx", graph_feeds, threads=2)
        measured[name] = errors
        assert max(errors.values()) < BOUNDS[family][name], f"{family} {name}: fp16 vs fp32 {errors}"
    hift = measured["v1_hift" if family == "v1" else "hift"]
    assert hift["source"] == 0 and hift["f0"] == 0, hift  # fp32 islands: bit-identical
    print(
        f"{family} fp16 vs fp32 on golden inputs:",
        {k: {o: f"{e:.2e}" for o, e in v.items()} for k, v in measured.items()},
    )


@pytest.mark.slow
def test_runtime_checks_the_family_graph_set_before_tensorrt(built, tmp_path):
    from trt_cosy.runtime.engines import load_engines

    if gpu_unavailable_reason() is not None:
        for out in built.values():
            with pytest.raises(MissingDependencyError, match="NVIDIA GPU"):
                load_engines(out, backend="tensorrt")
    with pytest.raises(EngineMismatchError, match="trt-cosy build"):
        load_engines(built["v1"])  # ONNX Runtime never loads engines built for TensorRT
    # a v1 directory whose profiles name the CosyVoice2 graphs is refused before any plan is read
    import shutil

    broken = tmp_path / "v1"
    shutil.copytree(built["v1"], broken)
    raw = json.loads((broken / "profiles.json").read_text())
    raw["flow_encoder"] = raw.pop("v1_flow_encoder")
    (broken / "profiles.json").write_text(json.dumps(raw))
    from trt_cosy.runtime.engines import _check_trt_graphs

    with pytest.raises(EngineMismatchError, match="a v1 model has"):
        _check_trt_graphs(broken, "v1")
