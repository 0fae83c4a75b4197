"""CosyVoice2 speech LLM: torch reference vs the golden official outputs, the host decode loop,
the samplers, and the ONNX export of the LLM graph."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch", reason="needs the [build] extra (torch)")

import torch

from trt_cosy.builder.modules.llm import LLMGraph, embedding_tables, load_llm
from trt_cosy.builder.torch_runner import TorchRunner
from trt_cosy.config import LLMConfig
from trt_cosy.errors import InputError
from trt_cosy.models.registry import read_release_config
from trt_cosy.runtime.graphs import LLM
from trt_cosy.stages.llm import LLMStage
from trt_cosy.stages.sampling import RASSampler, greedy_sample, nucleus_sample

TOL = 1e-4  # golden README: llm_tf_hidden / logits / cached_logp / greedy_logits
PREFILL_LEN = 43  # [sos, 16 text, task, 25 prompt speech]
NUM_FORCED = 8


@pytest.fixture(scope="module")
def config(v2_tiny_dir: Path) -> LLMConfig:
    return read_release_config(v2_tiny_dir).llm


@pytest.fixture(scope="module")
def model(v2_tiny_dir: Path, config: LLMConfig):
    return load_llm(v2_tiny_dir, config)


@pytest.fixture(scope="module")
def stage(model, config: LLMConfig) -> LLMStage:
    return LLMStage(TorchRunner(LLM, LLMGraph(model)), embedding_tables(model), config)


def _max_err(actual: np.ndarray, expected: np.ndarray) -> float:
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    return float(np.abs(actual.astype(np.float64) - expected.astype(np.float64)).max())


def _tf_inputs(stage: LLMStage, ref: dict[str, np.ndarray]) -> np.ndarray:
    speech = np.concatenate([ref["in_prompt_speech_token"][0], ref["in_target_speech_token"][0, :NUM_FORCED]])
    return stage.build_inputs(ref["in_text"], ref["in_prompt_text"], speech)


# ---------------------------------------------------------------- golden parity


def test_embedding_tables(model, config: LLMConfig):
    tables = embedding_tables(model)
    width = config.llm_input_size
    assert tables["text_embedding"].shape == (config.qwen.vocab_size, width)
    assert tables["speech_embedding"].shape == (config.speech_vocab_size, width)
    assert tables["llm_embedding"].shape == (2, width)
    assert all(table.dtype == np.float32 for table in tables.values())


def test_lm_input_is_exact(stage: LLMStage, v2_reference):
    lm_input = _tf_inputs(stage, v2_reference)
    err = _max_err(lm_input, v2_reference["llm_tf_lm_input"])
    assert err == 0.0, f"llm_tf_lm_input max abs error {err:.3g} (must be exact)"


def test_teacher_forced_hidden_and_logits(stage: LLMStage, v2_reference):
    logits, hidden = stage.teacher_forced(v2_reference["llm_tf_lm_input"])
    hidden_err = _max_err(hidden, v2_reference["llm_tf_hidden"])
    logits_err = _max_err(logits, v2_reference["llm_tf_logits"])
    assert hidden_err <= TOL, f"llm_tf_hidden max abs error {hidden_err:.3g} > {TOL}"
    assert logits_err <= TOL, f"llm_tf_logits max abs error {logits_err:.3g} > {TOL}"


def test_cached_logp(stage: LLMStage, v2_reference):
    prefix = v2_reference["llm_tf_lm_input"][:, :PREFILL_LEN]  # [1, 43, D]
    forced = v2_reference["in_target_speech_token"][0, :NUM_FORCED]
    logp = stage.cached_logp(prefix, forced)
    err = _max_err(logp, v2_reference["llm_tf_cached_logp"])
    assert err <= TOL, f"llm_tf_cached_logp max abs error {err:.3g} > {TOL}"


class _RecordingRunner:
    """Wraps a runner and keeps the last-position logits of every call."""

    def __init__(self, inner):
        self.inner = inner
        self.name = inner.name
        self.input_names = inner.input_names
        self.output_names = inner.output_names
        self.last_logits: list[np.ndarray] = []

    def infer(self, feed):
        outputs = self.inner.infer(feed)
        self.last_logits.append(outputs["logits"][0, -1].copy())
        return outputs


def test_greedy_decode(stage: LLMStage, v2_reference):
    recorder = _RecordingRunner(stage.runner)
    recording = LLMStage(recorder, _tables_of(stage), stage.config)
    expected_tokens = v2_reference["llm_greedy_tokens"]
    tokens = list(
        recording.generate(
            v2_reference["in_text"],
            v2_reference["in_prompt_text"],
            v2_reference["in_prompt_speech_token"],
            greedy_sample,
            max_new_tokens=len(expected_tokens),
        )
    )
    assert recording.length_limits(v2_reference["in_text"].size) == (16, 160)
    assert tokens == expected_tokens.tolist(), f"greedy tokens {tokens} != {expected_tokens.tolist()}"
    err = _max_err(np.stack(recorder.last_logits), v2_reference["llm_greedy_logits"])
    assert err <= TOL, f"llm_greedy_logits max abs error {err:.3g} > {TOL}"


def test_interleaved_requests_do_not_share_state(stage: LLMStage, v2_reference):
    args = (v2_reference["in_text"], v2_reference["in_prompt_text"], v2_reference["in_prompt_speech_token"])
    first = stage.generate(*args, greedy_sample, max_new_tokens=6)
    second = stage.generate(*args, greedy_sample, max_new_tokens=6)
    pairs = list(zip(first, second, strict=True))
    expected = v2_reference["llm_greedy_tokens"][:6].tolist()
    assert [a for a, _ in pairs] == expected and [b for _, b in pairs] == expected


def _tables_of(stage: LLMStage) -> dict[str, np.ndarray]:
    return {
        "text_embedding": stage.text_embedding,
        "speech_embedding": stage.speech_embedding,
        "llm_embedding": stage.llm_embedding,
    }


# ---------------------------------------------------------------- decode loop rules


class _FavouriteRunner:
    """LLM contract stand-in whose logits always favour ``favourite`` (then ``runner_up``)."""

    name = LLM.name
    input_names = LLM.input_names
    output_names = LLM.output_names

    def __init__(self, config: LLMConfig, favourite: int, runner_up: int = 5):
        self.config = config
        self.favourite = favourite
        self.runner_up = runner_up

    def infer(self, feed):
        embeds, past = feed["inputs_embeds"], feed["past_keys"]
        new_len = embeds.shape[1]
        logits = np.zeros((1, new_len, self.config.speech_vocab_size), np.float32)
        logits[..., self.favourite] = 10.0
        logits[..., self.runner_up] = 5.0
        qwen = self.config.qwen
        present = np.zeros(
            (qwen.num_layers, 1, qwen.num_kv_heads, past.shape[3] + new_len, qwen.head_dim), np.float32
        )
        return {"logits": logits, "hidden": embeds, "present_keys": present, "present_values": present.copy()}


def _fake_stage(config: LLMConfig, favourite: int) -> LLMStage:
    width = config.llm_input_size
    tables = {
        "text_embedding": np.zeros((config.qwen.vocab_size, width), np.float32),
        "speech_embedding": np.zeros((config.speech_vocab_size, width), np.float32),
        "llm_embedding": np.zeros((2, width), np.float32),
    }
    return LLMStage(_FavouriteRunner(config, favourite), tables, config)


def test_eos_masked_before_min_len_and_not_yielded(config: LLMConfig):
    stage = _fake_stage(config, favourite=config.eos_token)
    tokens = list(
        stage.generate(np.array([1, 2, 3]), np.array([], np.int32), np.array([], np.int32), greedy_sample)
    )
    assert tokens == [5] * 6, f"expected min_len=6 runner-up tokens then a silent stop, got {tokens}"


def test_other_stop_tokens_are_not_masked(config: LLMConfig):
    for stop in config.stop_tokens[1:]:
        stage = _fake_stage(config, favourite=stop)
        tokens = list(stage.generate(np.array([1, 2]), np.array([7]), np.array([3, 4]), greedy_sample))
        assert tokens == [], (
            f"stop token {stop} must end decoding at once without being yielded, got {tokens}"
        )


def test_max_len_and_max_new_tokens(config: LLMConfig):
    stage = _fake_stage(config, favourite=42)
    assert len(list(stage.generate(np.array([1, 2]), [], [], greedy_sample))) == 40
    assert len(list(stage.generate(np.array([1, 2]), [], [], greedy_sample, max_new_tokens=3))) == 3


def test_bad_inputs_raise(config: LLMConfig):
    stage = _fake_stage(config, favourite=42)
    with pytest.raises(InputError):
        stage.generate(np.array([], np.int32), [], [], greedy_sample)
    with pytest.raises(InputError):
        stage.generate(np.array([config.qwen.vocab_size]), [], [], greedy_sample)
    with pytest.raises(InputError):
        stage.build_inputs(np.array([1]), [], np.array([config.speech_token_size]))


# ---------------------------------------------------------------- samplers


class _FixedUniforms:
    """Generator stand-in returning preset uniforms, to pin each draw."""

    def __init__(self, *values: float):
        self.values = list(values)

    def random(self) -> float:
        return self.values.pop(0)


def test_nucleus_includes_crossing_token():
    probs = np.array([0.15, 0.25, 0.1, 0.5], np.float32)  # sorted: 3 (0.5), 1 (0.25), 0, 2
    # Mass before token 1 is 0.5 < 0.7, so 1 is kept although it crosses 0.7; token 0 is not.
    assert nucleus_sample(probs, 0.7, 25, _FixedUniforms(0.99)) == 1
    assert nucleus_sample(probs, 0.7, 25, _FixedUniforms(0.7)) == 1  # 0.7 * 0.75 > 0.5
    assert nucleus_sample(probs, 0.7, 25, _FixedUniforms(0.1)) == 3
    seen = {nucleus_sample(probs, 0.7, 25, np.random.default_rng(seed)) for seed in range(200)}
    assert seen == {1, 3}, f"nucleus kept {sorted(seen)}, expected the crossing token too: [1, 3]"


def test_nucleus_top_k_cap():
    probs = np.full(100, 0.01, np.float32)
    assert nucleus_sample(probs, 0.8, 5, _FixedUniforms(0.999)) == 4
    seen = {nucleus_sample(probs, 0.8, 5, np.random.default_rng(seed)) for seed in range(300)}
    assert seen == {0, 1, 2, 3, 4}, f"top_k=5 drew {sorted(seen)}"


def test_repetition_fallback_never_returns_masked_candidate():
    logp = np.log(np.array([0.97, 0.01, 0.01, 0.01], np.float32))
    before = logp.copy()
    sampler = RASSampler(np.random.default_rng(0), top_p=0.8, top_k=25, win_size=10, tau_r=0.1)
    draws = [sampler(logp, [3, 0]) for _ in range(300)]
    assert 0 not in draws and set(draws) == {1, 2, 3}, f"fallback drew {sorted(set(draws))}"
    np.testing.assert_array_equal(logp, before, err_msg="the sampler must not modify logp")
    # Outside the window (last 10) the candidate is not a repetition and is kept.
    assert sampler(logp, [0] + [1] * 10) == 0


def test_ras_same_seed_same_tokens(config: LLMConfig):
    logps = np.log(np.random.default_rng(3).dirichlet(np.full(50, 0.3), size=40)).astype(np.float32)

    def run(seed: int) -> list[int]:
        sampler = RASSampler.from_config(config, np.random.default_rng(seed))
        decoded: list[int] = []
        for logp in logps:
            decoded.append(sampler(logp, decoded))
        return decoded

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_greedy_sample_is_argmax():
    logp = np.array([-3.0, -0.5, -np.inf, -0.5], np.float32)
    assert greedy_sample(logp, [1, 1, 1]) == 1


# ---------------------------------------------------------------- ONNX export


def _random_feed(config: LLMConfig, new_len: int, past_len: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    qwen = config.qwen
    cache = (qwen.num_layers, 1, qwen.num_kv_heads, past_len, qwen.head_dim)
    return {
        "inputs_embeds": rng.standard_normal((1, new_len, config.llm_input_size)).astype(np.float32),
        "past_keys": rng.standard_normal(cache).astype(np.float32),
        "past_values": rng.standard_normal(cache).astype(np.float32),
    }


@pytest.mark.slow  # ~7-10 s: the dynamo export dominates
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:.*axis name:UserWarning")
def test_llm_graph_exports_with_dynamic_t_and_p(model, config: LLMConfig, tmp_path: Path):
    onnxruntime = pytest.importorskip("onnxruntime")
    graph = LLMGraph(model).eval()
    example = tuple(torch.from_numpy(a) for a in _random_feed(config, 3, 4, seed=0).values())
    new_len, past_len = torch.export.Dim("T", min=1, max=8192), torch.export.Dim("P", min=0, max=8192)
    path = tmp_path / "llm.onnx"
    torch.onnx.export(
        graph,
        example,
        str(path),
        dynamo=True,
        input_names=list(LLM.input_names),
        output_names=list(LLM.output_names),
        dynamic_shapes={
            "inputs_embeds": {1: new_len},
            "past_keys": {3: past_len},
            "past_values": {3: past_len},
        },
    )
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    torch_runner = TorchRunner(LLM, graph)
    for new, past in ((6, 0), (1, 9)):
        feed = _random_feed(config, new, past, seed=new * 100 + past)
        ort_out = dict(zip(LLM.output_names, session.run(None, feed), strict=True))
        ref_out = torch_runner.infer(feed)
        for name in LLM.output_names:
            err = _max_err(ort_out[name], ref_out[name])
            assert err <= TOL, f"ONNX {name} at T={new}, P={past}: max abs error {err:.3g} > {TOL}"
