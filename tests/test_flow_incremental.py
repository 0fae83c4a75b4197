"""Incremental streaming flow (``stages.flow_incremental``): each chunk computes its new frames only
and gives the mel the official recomputation gives, chunk by chunk; past its memory limit, or on
engines without the graph, the flow recomputes as before.

The torch test checks the graph's maths against the chunk-attention estimator; the others use the
tiny ONNX Runtime engines (built once per session, tests/_support.py).
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
from _incremental_support import flow_stage
from _streaming_support import counting, load_tiny_ort, make_tiny_voice

from trt_cosy import SynthesisConfig
from trt_cosy.runtime import graphs
from trt_cosy.runtime.engines import load_engines
from trt_cosy.runtime.manifest import Manifest
from trt_cosy.stages.flow import FlowStage
from trt_cosy.stages.flow_incremental import FlowCache, cache_layout
from trt_cosy.streaming import FAST_SCHEDULE, hop_schedule
from trt_cosy.verify.golden import GoldenSet

# Incremental vs recomputed mel: the same float32 maths in another order (measured ~1e-5 on the
# tiny engines); the golden mel tolerance is 2e-4.
MEL_TOLERANCE = 5e-5
ONE_SEGMENT = SynthesisConfig(stream=True, text_frontend=False)
TEXT_100 = "Hi there."  # 5 text tokens -> 100 speech tokens on the tiny model


def test_the_graph_on_new_frames_equals_the_chunk_attention_estimator(v2_tiny_dir):
    torch = pytest.importorskip("torch", reason="the torch reference needs torch (the [build] extra)")
    from trt_cosy.builder.modules.flow import load_flow
    from trt_cosy.builder.modules.flow_estimator_incremental import (
        IncrementalEstimatorGraph,
        incremental_cache_layout,
    )
    from trt_cosy.models.v2.config import v2_config_from_release_dir

    config = v2_config_from_release_dir(v2_tiny_dir)
    estimator = load_flow(v2_tiny_dir, config.flow).decoder.estimator
    layout = incremental_cache_layout(estimator)
    assert layout == cache_layout(config.flow.estimator)  # the runtime's layout, without torch
    blocks, width, channels = layout
    generator = torch.Generator().manual_seed(0)
    frames = 170
    x, mu, cond = (torch.randn(2, 80, frames, generator=generator) for _ in range(3))  # [2, 80, F]
    t, spks = torch.rand(2, generator=generator), torch.randn(2, 80, generator=generator)
    graph = IncrementalEstimatorGraph(estimator).eval()
    with torch.no_grad():
        whole = estimator(x, torch.ones(2, 1, frames), mu, t, spks, cond, streaming=True)  # [2, 80, F]
        past, tails, pieces = torch.zeros(0, blocks, 2, width), torch.zeros(2, channels, 2), []
        for start, end in ((0, 100), (100, 150), (150, 170)):  # chunk-aligned starts, any length
            part = slice(start, end)
            out, new_blocks, tails = graph(x[..., part], mu[..., part], t, spks, cond[..., part], past, tails)
            past = torch.cat([past, new_blocks])
            pieces.append(out)
    error = float((torch.cat(pieces, dim=-1) - whole).abs().max())
    assert error < 1e-5, error
    assert past.shape == (frames, blocks, 2, width)


# ----------------------------------------------------------------------------- tiny ONNX Runtime engines


@pytest.fixture(scope="module")
def tiny_ort(tmp_path_factory, v2_tiny_dir):
    return load_tiny_ort(tmp_path_factory, v2_tiny_dir)


@pytest.fixture(scope="module")
def golden(v2_tiny_dir) -> GoldenSet:
    return GoldenSet.load(v2_tiny_dir / "reference.npz")


def _flow(model, incremental: bool, limit: int | None = None, voice_slots: int = 0) -> FlowStage:
    return flow_stage(model, incremental, voice_slots, **({} if limit is None else {"cache_limit_bytes": limit}))


def _prompt(golden: GoldenSet):
    meta = golden.meta["streampad"]
    return (
        meta["prompt_tokens"],
        (
            golden["in_prompt_speech_token"][:, : meta["prompt_tokens"]].astype(np.int64),  # [1, P]
            golden["in_prompt_feat"][:, : meta["prompt_feat_frames"]],  # [1, 2P, 80]
            golden["in_spk_embedding"],  # [1, 192]
        ),
    )


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["official", FAST_SCHEDULE])
def test_incremental_chunks_equal_recomputed_chunks(tiny_ort, golden, schedule):
    model = tiny_ort.model
    assert graphs.FLOW_ESTIMATOR_INCREMENTAL.name in model.runners  # built with the engines
    recompute, incremental = _flow(model, False), _flow(model, True)
    prompt_tokens, prompt = _prompt(golden)
    tokens = np.random.default_rng(0).integers(0, model.config.flow.vocab_size, (1, 330))  # [1, 330]
    plans = hop_schedule(prompt_tokens, True, 25, 3, schedule).plan_all(tokens.shape[1])
    assert sum(not plan.final for plan in plans) >= 3  # hops 25 + pad, 50, 100, ...
    cache = incremental.new_cache()
    held = []
    for plan in plans:
        args = (tokens[:, : plan.end], *prompt)
        want = recompute.token2mel(*args, streaming=plan.streaming, finalize=plan.final).mel
        got = incremental.token2mel(*args, streaming=plan.streaming, finalize=plan.final, cache=cache).mel
        assert got.shape == want.shape
        error = float(np.abs(got - want).max())
        assert error <= MEL_TOLERANCE, (plan, error)
        held.append(cache.frames)
    assert cache.disabled is None
    # Every non-final chunk extended the cache by its new frames; the final call released it.
    frames = [2 * (prompt_tokens + plan.end - 3) for plan in plans[:-1]]
    assert held[:-1] == frames and held[-1] == 0 and cache.nbytes < 2**20


class _Recording:
    """Records the new-frame count T of every call."""

    def __init__(self, inner):
        self.inner, self.frames = inner, []

    @property
    def input_names(self):
        return self.inner.input_names

    @property
    def output_names(self):
        return self.inner.output_names

    def infer(self, feed):
        self.frames.append(feed["x"].shape[2])
        return self.inner.infer(feed)


@pytest.mark.slow
def test_a_voice_prefix_spares_later_first_chunks_the_prompt_frames(tiny_ort):
    model = tiny_ort.model
    rng = np.random.default_rng(2)
    prompt_tokens = 60  # the golden prompts (12, 25 tokens) hold no chunk with its look-ahead
    prompt = (
        rng.integers(0, model.config.flow.vocab_size, (1, prompt_tokens)),  # [1, P]
        rng.normal(-5.0, 2.0, (1, 2 * prompt_tokens, 80)).astype(np.float32),  # [1, 2P, 80]
        rng.standard_normal((1, 192)).astype(np.float32),  # [1, 192]
    )
    tokens = rng.integers(0, model.config.flow.vocab_size, (1, 120))
    first = hop_schedule(prompt_tokens, True, 25, 3, "official").plan_all(tokens.shape[1])[0]
    flow, reference = _flow(model, True, voice_slots=1), _flow(model, False)
    flow.incremental_runner = recording = _Recording(flow.incremental_runner)
    steps = model.config.flow.cfm.n_timesteps
    args = (tokens[:, : first.end], *prompt)
    want = reference.token2mel(*args, streaming=True, finalize=False).mel
    frames = 2 * (prompt_tokens + first.end - 3)
    prefix = 50 * ((prompt_tokens - 3) // 25)  # completed prompt chunks whose look-ahead is prompt: 100
    for request in range(2):
        got = flow.token2mel(*args, streaming=True, finalize=False, cache=flow.new_cache()).mel
        assert float(np.abs(got - want).max()) <= MEL_TOLERANCE, request
    # Request 1: the prefix (once per voice), then the new frames; request 2: the new frames only.
    assert recording.frames == [prefix] * steps + [frames - prefix] * (2 * steps)
    assert (
        flow.voice_prefixes.nbytes >= prefix * FlowCache(model.config.flow.estimator, steps).bytes_per_frame
    )
    other = (prompt[0][:, ::-1].copy(), *prompt[1:])  # another voice: the slot is replaced
    flow.token2mel(tokens[:, : first.end], *other, streaming=True, finalize=False, cache=flow.new_cache())
    assert len(flow.voice_prefixes._entries) == 1


def test_a_request_cache_shares_its_voice_prefix_instead_of_copying_it(v2_tiny_dir):
    """``load`` keeps the prefix's arrays (never written) and the request's own frames apart; each call
    still sees prefix ++ own frames."""
    from trt_cosy.models.registry import read_release_config

    config = read_release_config(v2_tiny_dir).flow.estimator
    rng = np.random.default_rng(0)
    prefix = FlowCache(config, steps=2)
    layout = (prefix.blocks, 2, prefix.width)
    for step in range(2):
        prefix.extend(step, rng.standard_normal((4, *layout)).astype(np.float32), prefix.past(step)[1])
    prefix.finish(np.zeros((1, 80, 4), np.float32))
    before = [prefix.past(step)[0].copy() for step in range(2)]

    cache = FlowCache(config, steps=2)
    cache.load(prefix)
    assert cache.past(0)[0] is prefix.past(0)[0]  # the first chunk reads the prefix itself
    new = [rng.standard_normal((3, *layout)).astype(np.float32) for _ in range(2)]
    for step in range(2):
        cache.extend(step, new[step], cache.past(step)[1])
    for step in range(2):
        assert np.array_equal(cache.past(step)[0], np.concatenate([before[step], new[step]]))
        assert np.array_equal(prefix.past(step)[0], before[step])  # the prefix is not written
    own = sum(block.nbytes for block in cache._blocks)
    assert own == sum(block.nbytes for block in new)  # the request holds only its own frames
    assert cache.nbytes > own  # and still counts the prefix frames it refers to


@pytest.mark.slow
def test_past_the_limit_the_segment_recomputes(tiny_ort, golden, caplog):
    model = tiny_ort.model
    prompt_tokens, prompt = _prompt(golden)
    per_frame = FlowCache(model.config.flow.estimator, model.config.flow.cfm.n_timesteps).bytes_per_frame
    blocks, width, _ = cache_layout(model.config.flow.estimator)
    assert per_frame == model.config.flow.cfm.n_timesteps * blocks * 2 * width * 4
    tokens = np.random.default_rng(1).integers(0, model.config.flow.vocab_size, (1, 260))
    plans = hop_schedule(prompt_tokens, True, 25, 3, "official").plan_all(tokens.shape[1])
    assert not any(plan.final for plan in plans[:3])
    first = 2 * (prompt_tokens + plans[0].end - 3)  # frames of the first chunk: they fit, the second's do not
    flow = _flow(tiny_ort.model, True, limit=(first + 10) * per_frame)
    tts, counters = counting(tiny_ort)
    flow.incremental_runner = counters[graphs.FLOW_ESTIMATOR_INCREMENTAL.name]
    flow.estimator_stream_runner = counters[graphs.FLOW_ESTIMATOR_STREAM.name]
    reference = _flow(model, False)
    cache = flow.new_cache()
    steps = model.config.flow.cfm.n_timesteps
    with caplog.at_level(logging.INFO, logger="trt_cosy.stages.flow_incremental"):
        for index, plan in enumerate(plans[:3]):
            args = (tokens[:, : plan.end], *prompt)
            got = flow.token2mel(*args, streaming=True, finalize=False, cache=cache).mel
            want = reference.token2mel(*args, streaming=True, finalize=False).mel
            assert float(np.abs(got - want).max()) <= MEL_TOLERANCE, index
    assert counters[graphs.FLOW_ESTIMATOR_INCREMENTAL.name].calls == steps  # the first chunk only
    assert counters[graphs.FLOW_ESTIMATOR_STREAM.name].calls == 2 * steps  # the later ones recomputed
    assert cache.disabled is not None and "limit" in cache.disabled and cache.nbytes < 2**20  # freed
    assert "incremental flow off" in caplog.text


@pytest.mark.slow
def test_streaming_requests_use_the_incremental_graph_and_match_recomputation(tiny_ort, tmp_path_factory):
    voice = make_tiny_voice(tiny_ort, tmp_path_factory)
    tts, counters = counting(tiny_ort)
    chunks = list(tts.synthesize(TEXT_100, voice, seed=3, config=ONE_SEGMENT))
    steps = tiny_ort.model.config.flow.cfm.n_timesteps
    assert [chunk.timings["tokens"] for chunk in chunks] == [38, 50, 12]
    # The voice's prompt prefix (37 prompt tokens: one chunk), then the two streaming chunks.
    assert counters[graphs.FLOW_ESTIMATOR_INCREMENTAL.name].calls == 3 * steps
    assert counters[graphs.FLOW_ESTIMATOR_STREAM.name].calls == 0
    assert counters[graphs.FLOW_ESTIMATOR.name].calls == steps  # the official final full-attention call
    flow = tts._stages.flow
    runner, flow.incremental_runner = flow.incremental_runner, None  # as engines without the graph
    try:
        recomputed = list(tts.synthesize(TEXT_100, voice, seed=3, config=ONE_SEGMENT))
    finally:
        flow.incremental_runner = runner
    assert counters[graphs.FLOW_ESTIMATOR_STREAM.name].calls == 2 * steps
    for ours, theirs in zip(chunks, recomputed, strict=True):
        assert ours.samples.shape == theirs.samples.shape
        assert float(np.abs(ours.samples - theirs.samples).max()) <= 1e-4, ours.index  # wav: golden 1e-3


@pytest.mark.slow
def test_engines_without_the_graph_load_and_recompute(tmp_path_factory, v2_tiny_dir, tmp_path, caplog):
    from _support import tiny_engines

    from trt_cosy.models.v2.family import V2Family

    engines = tmp_path / "engines"
    shutil.copytree(
        tiny_engines(tmp_path_factory, v2_tiny_dir),
        engines,
        ignore=shutil.ignore_patterns("flow_estimator_incremental.onnx"),
    )
    manifest = Manifest.read(engines)
    del manifest.graphs[graphs.FLOW_ESTIMATOR_INCREMENTAL.name]
    del manifest.files["flow_estimator_incremental.onnx"]
    manifest.write(engines)
    model = load_engines(engines, threads=1)
    assert graphs.FLOW_ESTIMATOR_INCREMENTAL.name not in model.runners
    with caplog.at_level(logging.INFO, logger="trt_cosy.models.v2.family"):
        stages = V2Family().build_stages(model)
    assert stages.flow.new_cache() is None
    assert "streaming chunks recompute" in caplog.text


@pytest.mark.slow
def test_verify_stream_rows_pass_through_the_incremental_flow(tiny_ort, golden):
    """`trt-cosy verify --backend onnxruntime` on the tiny golden set: its streaming chunks now run
    the incremental estimator (one cache per scenario, as a request), and every row stays ok."""
    from trt_cosy.verify import run_verify

    model = tiny_ort.model
    assert graphs.FLOW_ESTIMATOR_INCREMENTAL.name in model.runners
    rows = [row for row in run_verify(model, golden) if row.key.startswith(("stream_", "streampad_"))]
    assert len(rows) >= 30 and any(row.key == "stream_c1_flow_mel" for row in rows)
    failed = [f"{row.key} {row.max_abs_err}" for row in rows if row.status not in ("ok", "skipped")]
    assert not failed, failed


def test_the_onnxruntime_graph_fuses_its_attention(tiny_ort, tmp_path_factory, v2_tiny_dir):
    """Each block's attention over cached ++ new keys is one MultiHeadAttention whose bias is the
    new frames' chunk mask (``ort_passes.INCREMENTAL_REWRITES``): no Softmax or score tensor is left."""
    onnx = pytest.importorskip("onnx", reason="reading the graph needs onnx (the [build] extra)")
    from _support import tiny_engines

    path = tiny_engines(tmp_path_factory, v2_tiny_dir) / "flow_estimator_incremental.onnx"
    nodes = onnx.load(str(path), load_external_data=False).graph.node
    fused = [node for node in nodes if node.op_type == "MultiHeadAttention"]
    blocks = cache_layout(tiny_ort.model.config.flow.estimator)[0]
    assert len(fused) == blocks and not any(node.op_type == "Softmax" for node in nodes)
    assert all(len(node.input) == 6 and node.input[5] for node in fused)  # attention_bias: the chunk mask


@pytest.mark.slow
def test_derived_int4_engines_quantise_the_incremental_graph(
    tiny_ort, tmp_path_factory, v2_tiny_dir, tmp_path
):
    """int4 engines derived from fp32 ones give the incremental graph the estimators' int8 MatMuls;
    its chunks then differ from the recomputed int8 ones only by the per-call activation scales."""
    onnx = pytest.importorskip("onnx", reason="reading the graph needs onnx (the [build] extra)")
    from _support import tiny_engines

    from trt_cosy.builder.quantize.engines import derive_engines

    int4 = derive_engines(tiny_engines(tmp_path_factory, v2_tiny_dir), tmp_path / "int4", "int4")
    graph = onnx.load(str(int4 / "flow_estimator_incremental.onnx"), load_external_data=False).graph
    assert sum(node.op_type == "MatMulInteger" for node in graph.node) > 0
    model = load_engines(int4, threads=1)
    prompt_tokens, prompt = _prompt(GoldenSet.load(v2_tiny_dir / "reference.npz"))
    tokens = np.random.default_rng(4).integers(0, model.config.flow.vocab_size, (1, 120))
    recompute, incremental = _flow(model, False), _flow(model, True)
    cache = incremental.new_cache()
    for plan in hop_schedule(prompt_tokens, True, 25, 3, "official").plan_all(tokens.shape[1])[:2]:
        args = (tokens[:, : plan.end], *prompt)
        want = recompute.token2mel(*args, streaming=True, finalize=False).mel
        got = incremental.token2mel(*args, streaming=True, finalize=False, cache=cache).mel
        assert float(np.abs(got - want).max()) <= 0.1, plan  # int8 activation scales per call
