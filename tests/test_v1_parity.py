"""CosyVoice 1 (300M family): golden parity of the torch reference + v1 host stages, tokenizer,
preset speakers, streaming schedule, LLM input layouts; ONNX export parity (slow).

Golden data: tests/data/cosyvoice1-tiny (golden README §7); the recorded official draws (CFM z,
SineGen phases and noise) are injected; tolerances come from its ``meta_json``.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import numpy as np
import pytest

from trt_cosy.errors import ModelDirError
from trt_cosy.models.v1 import graphs as graphs_v1
from trt_cosy.models.v1.config import v1_config_from_release_dir
from trt_cosy.models.v1.stages import (
    V1FlowStage,
    V1LLMStage,
    V1StreamState,
    V1Synthesizer,
    interpolation_indices,
    load_speakers,
    stream_token_chunks,
)
from trt_cosy.stages.sampling import greedy_sample

V1_TINY = Path(__file__).parent / "data" / "cosyvoice1-tiny"
_RUNS = ("nonstream", "sft", "stream")
_INJECTED = re.compile(
    r"^(in_|meta_json$)|_flow_z$|_flow_tokens$|rand_phase$|sine_noise$|^llm_sampled_tokens$"
)


@pytest.fixture(scope="module")
def golden() -> dict:
    with np.load(V1_TINY / "reference.npz") as data:
        arrays = {key: data[key] for key in data.files}
    arrays["meta"] = json.loads(str(arrays.pop("meta_json")))
    return arrays


@pytest.fixture(scope="module")
def model():
    torch = pytest.importorskip("torch")
    from trt_cosy.models.v1.export.reference import load_torch_model_v1

    torch.set_num_threads(1)
    return load_torch_model_v1(V1_TINY)


def _tolerance(golden: dict, key: str) -> float:
    for group in golden["meta"]["tolerances_recommended"].values():
        if re.search(group["key_regex"], key):
            return float(group["recommended_max_abs"])
    raise KeyError(f"no tolerance for {key}")


def _check(golden: dict, ours: dict[str, np.ndarray]) -> None:
    """Every key of ``ours`` within the golden tolerance; the message lists every measured error."""
    rows, failed = [], []
    for key, value in sorted(ours.items()):
        ref = golden[key]
        assert np.shape(value) == ref.shape, f"{key}: shape {np.shape(value)} != golden {ref.shape}"
        err = (
            float(np.max(np.abs(np.asarray(value, np.float64) - ref.astype(np.float64)))) if ref.size else 0.0
        )
        tol = _tolerance(golden, key)
        rows.append(f"{key}: {err:.3e} (tol {tol:.0e})")
        if not err <= tol:
            failed.append(key)
    assert not failed, f"out of tolerance: {failed}\n" + "\n".join(rows)


class _Recorded:
    """``V1Draws`` replaying the official draws of chunk ``prefix`` (float16 -> float32)."""

    def __init__(self, golden: dict, prefix: str, hift_prefix: str | None = None):
        self.golden, self.prefix = golden, prefix
        self.hift_prefix = prefix + "hift_" if hift_prefix is None else hift_prefix

    def flow_noise(self, frames: int) -> np.ndarray:
        return self.golden[self.prefix + "flow_z"].astype(np.float32)

    def hift_phase(self) -> np.ndarray:
        return self.golden[self.hift_prefix + "rand_phase"].astype(np.float32)[:, :, 0]  # [1, 9]

    def hift_noise(self, samples: int) -> np.ndarray:
        return self.golden[self.hift_prefix + "sine_noise"].astype(np.float32).transpose(0, 2, 1)  # [1, S, 9]


class _Recording:
    """Runner wrapper keeping the last feed and outputs."""

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
        self.feed: dict = {}
        self.out: dict = {}

    @property
    def input_names(self):
        return self.inner.input_names

    @property
    def output_names(self):
        return self.inner.output_names

    def infer(self, feed):
        self.feed, self.out = dict(feed), self.inner.infer(feed)
        return self.out


def _llm_stage(model) -> V1LLMStage:
    runners = model.runners
    return V1LLMStage(
        runners[graphs_v1.V1_TEXT_ENCODER.name],
        runners[graphs_v1.V1_LLM.name],
        model.llm_tables,
        model.config.llm,
    )


def _ids(golden: dict, key: str) -> np.ndarray:
    return golden[key].reshape(-1).astype(np.int64)


def test_config_reads_v1_yaml():
    config = v1_config_from_release_dir(V1_TINY)
    assert (config.family, config.sample_rate, config.hift.samples_per_frame) == ("v1", 22050, 256)
    assert config.llm.text_encoder.static_chunk_size == 1 and config.flow.encoder.static_chunk_size == 0
    assert config.flow.estimator.channels == (32, 32) and config.llm.speech_vocab_size == 4097
    assert config.flow.mel_frames(100) == 172 and config.stream.mel_overlap_len == 34


def test_llm_teacher_forced_and_cached(model, golden):
    stage = _llm_stage(model)
    text, prompt_text = _ids(golden, "in_text"), _ids(golden, "in_prompt_text")
    prompt_speech, target = _ids(golden, "in_prompt_speech_token"), _ids(golden, "in_target_speech_token")
    n_tf = golden["meta"]["llm_tf"]["n_tf_target"]
    first = golden["meta"]["llm_tf"]["first_target_pred_pos"]
    lm_input = stage.build_inputs(
        text, prompt_text, np.concatenate([prompt_speech, target[:n_tf]]), golden["in_spk_embedding"]
    )
    logits, hidden = stage.teacher_forced(lm_input)
    logp, cached_hidden = stage.cached_steps(lm_input[:, : first + 1], target[:n_tf])
    ours = {
        "llm_tf_lm_input": lm_input,
        "llm_tf_hidden": hidden,
        "llm_tf_logits": logits[:, first:],
        "llm_tf_cached_logp": logp,
        "llm_tf_cached_hidden": cached_hidden,
    }
    _check(golden, ours)


@pytest.mark.parametrize("mode", ["zero_shot", "sft"])
def test_llm_greedy_decode(model, golden, mode):
    prefix = "" if mode == "zero_shot" else "sft_"
    recorder = _Recording(model.runners[graphs_v1.V1_LLM.name])
    logits: list[np.ndarray] = []
    original = recorder.infer

    def infer(feed):
        out = original(feed)
        logits.append(out["logits"][0, -1].copy())
        return out

    recorder.infer = infer
    stage = V1LLMStage(
        model.runners[graphs_v1.V1_TEXT_ENCODER.name], recorder, model.llm_tables, model.config.llm
    )
    steps = golden[prefix + "llm_greedy_tokens"].size
    if mode == "zero_shot":
        args = (
            _ids(golden, "in_prompt_text"),
            _ids(golden, "in_prompt_speech_token"),
            golden["in_spk_embedding"],
        )
    else:
        args = (np.zeros(0, np.int64), np.zeros(0, np.int64), golden["in_sft_spk_embedding"])
    tokens = list(stage.generate(_ids(golden, "in_text"), *args, greedy_sample, max_new_tokens=steps))
    np.testing.assert_array_equal(np.asarray(tokens), golden[prefix + "llm_greedy_tokens"])
    _check(golden, {prefix + "llm_greedy_logits": np.stack(logits[:steps])})


def test_llm_input_layouts(model, golden):
    """SFT: [sos, spk, text, task]; instruct (no embedding): [sos, text(instruct ++ text), task]."""
    stage = _llm_stage(model)
    text, instruct = _ids(golden, "in_text"), _ids(golden, "in_prompt_text")
    sft = stage.build_inputs(
        text, np.zeros(0, np.int64), np.zeros(0, np.int64), golden["in_sft_spk_embedding"]
    )
    assert sft.shape[1] == 1 + 1 + text.size + 1
    instruct_input = stage.build_inputs(text, instruct, np.zeros(0, np.int64), None)
    assert instruct_input.shape[1] == 1 + instruct.size + text.size + 1
    tables = model.llm_tables["llm_embedding"]
    np.testing.assert_array_equal(instruct_input[0, 0], tables[0])
    np.testing.assert_array_equal(instruct_input[0, -1], tables[1])
    assert not np.allclose(instruct_input[0, 1], sft[0, 1])  # the instruct row 1 is text, not the speaker


def _synthesize(model, golden, run: str) -> dict[str, np.ndarray]:
    """The official token2wav chain of one golden run, recording every intermediate key."""
    meta = golden["meta"][run]
    flow_encoder = _Recording(model.runners[graphs_v1.V1_FLOW_ENCODER.name])
    hift = _Recording(model.runners[graphs_v1.V1_HIFT.name])
    flow = V1FlowStage(flow_encoder, model.runners[graphs_v1.V1_FLOW_ESTIMATOR.name], model.config.flow)
    mels: list[np.ndarray] = []
    token2mel = flow.token2mel

    def recording_token2mel(*args):
        out = token2mel(*args)
        mels.append(out.mel)
        return out

    flow.token2mel = recording_token2mel
    synth = V1Synthesizer(flow, hift, model.config)
    prompt_tokens = golden["in_prompt_speech_token"][:, : meta["prompt_tokens"]]
    prompt_feat = golden["in_prompt_feat"][:, : meta["prompt_feat_frames"]]
    embedding = golden["in_sft_spk_embedding" if run == "sft" else "in_spk_embedding"]
    state, ours, pieces = V1StreamState(), {}, []
    empty = {
        "mel_overlap_in": np.zeros((1, 80, 0)),
        "hift_cache_source": np.zeros((1, 1, 0)),
        "hift_speech_cache_in": np.zeros((1, 0)),
    }
    for index, chunk in enumerate(meta["chunks"]):
        prefix = f"{run}_c{index}_"
        ours[prefix + "flow_cache_in"] = state.flow_cache
        for key, value in (
            ("mel_overlap_in", state.mel_overlap),
            ("hift_cache_source", state.hift_source),
            ("hift_speech_cache_in", state.hift_speech),
        ):
            ours[prefix + key] = empty[key] if value is None else value
        draws = _Recorded(golden, prefix)
        pieces.append(
            synth.token2wav(
                golden[prefix + "flow_tokens"],
                prompt_tokens,
                prompt_feat,
                embedding,
                state,
                draws,
                chunk["finalize"],
            )
        )
        ours[prefix + "flow_h"] = flow_encoder.out["h"]
        ours[prefix + "flow_mu"] = flow_encoder.out["mu"].transpose(0, 2, 1)  # [1, T, 80] as stored
        ours[prefix + "flow_mel"] = mels[-1]
        ours[prefix + "hift_mel"] = hift.feed["mel"]
        ours[prefix + "hift_f0"] = hift.out["f0"]
        wav_key = prefix + ("hift_wav" if prefix + "hift_wav" in golden else "hift_source")
        ours[wav_key] = hift.out["wav" if wav_key.endswith("wav") else "source"]
    ours[f"{run}_wav"] = np.concatenate(pieces, axis=1)
    return ours


@pytest.mark.parametrize("run", _RUNS)
def test_flow_and_streaming_chain(model, golden, run):
    _check(golden, _synthesize(model, golden, run))


def test_hift_standalone(model, golden):
    runner = model.runners[graphs_v1.V1_HIFT.name]
    ours = {}

    def vocode(hift_prefix: str, mel: np.ndarray, cache: np.ndarray) -> dict[str, np.ndarray]:
        draws = _Recorded(golden, "", hift_prefix)
        feed = {
            "mel": mel,
            "sine_noise": draws.hift_noise(0),
            "rand_phase": draws.hift_phase(),
            "cache_source": cache,
        }
        return runner.infer(feed)

    out = vocode("hift_synth_", golden["in_hift_synth_mel"], np.zeros((1, 1, 0), np.float32))
    ours.update(hift_synth_wav=out["wav"], hift_synth_source=out["source"], hift_synth_f0=out["f0"])
    for run in _RUNS:
        for index in range(golden["meta"][run]["n_chunks"]):
            prefix = f"{run}_c{index}_"
            out = vocode(prefix + "hift_", golden[prefix + "hift_mel"], golden[prefix + "hift_cache_source"])
            ours[prefix + "hift_f0"] = out["f0"]
            if prefix + "hift_wav" in golden:
                ours[prefix + "hift_wav"] = out["wav"]
            else:
                ours[prefix + "hift_source"], ours[f"{run}_wav"] = out["source"], out["wav"]
    _check(golden, ours)


def test_every_golden_key_is_covered(golden):
    compared = {key for key in golden if key != "meta" and not _INJECTED.search(key)}
    covered = {
        "llm_tf_lm_input",
        "llm_tf_hidden",
        "llm_tf_logits",
        "llm_tf_cached_logp",
        "llm_tf_cached_hidden",
    }
    covered |= {"llm_greedy_tokens", "llm_greedy_logits", "sft_llm_greedy_tokens", "sft_llm_greedy_logits"}
    covered |= {"hift_synth_wav", "hift_synth_source", "hift_synth_f0"} | {f"{run}_wav" for run in _RUNS}
    suffixes = (
        "flow_h",
        "flow_mu",
        "flow_cache_in",
        "flow_mel",
        "mel_overlap_in",
        "hift_mel",
        "hift_cache_source",
    )
    suffixes += ("hift_speech_cache_in", "hift_f0", "hift_wav", "hift_source")
    covered |= {key for key in compared if key.endswith(suffixes) and key.split("_c")[0] in _RUNS}
    assert compared <= covered, sorted(compared - covered)


def test_stream_schedule_matches_golden(golden):
    target = _ids(golden, "in_target_speech_token")
    chunks = list(stream_token_chunks(iter(target.tolist())))
    assert [finalize for _, finalize in chunks] == [False, False, True]
    for index, (tokens, _) in enumerate(chunks):
        np.testing.assert_array_equal(tokens, golden[f"stream_c{index}_flow_tokens"])
    assert list(stream_token_chunks(iter([]))) == []
    assert [t.shape[1] for t, _ in stream_token_chunks(range(30))] == [30]


def test_interpolation_matches_torch():
    torch = pytest.importorskip("torch")
    for in_size, out_size in ((20, 34), (60, 103), (25, 43), (7, 7), (50, 86), (3, 1)):
        x = torch.randn(1, 4, in_size)
        expected = torch.nn.functional.interpolate(x, size=out_size, mode="linear").numpy()
        index0, index1, weight1 = interpolation_indices(in_size, out_size)
        ours = (1 - weight1) * x.numpy()[..., index0] + weight1 * x.numpy()[..., index1]
        np.testing.assert_allclose(ours, expected, atol=1e-6)


def test_preset_speakers_roundtrip(golden, tmp_path):
    pytest.importorskip("torch")
    from trt_cosy.builder.spk2info import read_spk2info, write_speakers

    speakers = read_spk2info(V1_TINY / "spk2info.pt")
    assert list(speakers) == ["中文女", "英文男"]
    loaded = load_speakers(write_speakers(speakers, tmp_path / "speakers.npz"))
    np.testing.assert_array_equal(loaded["中文女"], golden["in_sft_spk_embedding"][0])
    with pytest.raises(ModelDirError):
        read_spk2info(tmp_path / "missing.pt")


def _write_ranks(path: Path) -> None:
    """A tiny ranks file in whisper's format: 256 byte tokens, then a few merges."""
    tokens = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w", b" wor"]
    path.write_text("".join(f"{base64.b64encode(t).decode()} {rank}\n" for rank, t in enumerate(tokens)))


def test_tokenizer_v1_with_generated_ranks(tmp_path):
    pytest.importorskip("tiktoken")
    from trt_cosy.models.v1.tokenizer import WhisperTextTokenizer

    _write_ranks(tmp_path / "multilingual.tiktoken")
    tokenizer = WhisperTextTokenizer(tmp_path)  # a directory holding multilingual.tiktoken
    base = 262
    assert len(tokenizer) == base + 1609
    assert tokenizer.token_id("<|endoftext|>") == base and tokenizer.token_id("<|en|>") == base + 2
    assert (
        tokenizer.token_id("<|yue|>") == base + 101 and tokenizer.token_id("<|notimestamps|>") == base + 107
    )
    ids = tokenizer.encode("<|en|>hello wor")
    assert ids == [base + 2, 259, 261] and tokenizer.decode(ids) == "<|en|>hello wor"
    assert tokenizer.encode("<|endofprompt|>") == list(b"<|endofprompt|>")  # plain text in v1
    with pytest.raises(ModelDirError):
        WhisperTextTokenizer(tmp_path / "nope.tiktoken")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(graphs_v1.V1_GRAPHS))
def test_onnx_export_matches_torch(model, tmp_path, name):
    pytest.importorskip("onnxruntime")
    from trt_cosy.builder.export import export_graph
    from trt_cosy.models.v1.export.reference import export_plans_v1

    plan = export_plans_v1(model.config)[name]
    tolerance = 1e-3 if name == graphs_v1.V1_HIFT.name else 1e-4
    result = export_graph(
        graphs_v1.V1_GRAPHS[name],
        model.runners[name].module,
        plan.sample,
        tmp_path / f"{name}.onnx",
        plan.dynamic_shapes,
        parity_inputs=plan.parity,
        tolerance=tolerance,
    )
    assert max(result.max_errors.values()) <= tolerance, result.max_errors
