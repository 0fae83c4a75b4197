"""CosyVoice3 incremental streaming flow: the DiT over new frames only (``models.v3.export.dit_incremental``)
through the CosyVoice2 runtime (``stages.flow_incremental``).

The torch tests check the premise (the streaming DiT is chunk-causal: completed chunks come out the
same in a later, longer call) and the graph's maths against the chunk-attention DiT; the others use
the tiny v3 ONNX Runtime engines (built once per session, tests/_support.py).
"""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
from _streaming_support import counting
from _support import GOLDEN, REF_TEXT, family_engines, reference_wavs

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig
from trt_cosy.models.v3 import graphs as graphs_v3
from trt_cosy.models.v3.config import v3_config_from_release_dir
from trt_cosy.pipeline import Request
from trt_cosy.runtime.engines import load_engines
from trt_cosy.runtime.manifest import Manifest
from trt_cosy.stages.flow import FlowStage
from trt_cosy.stages.flow_incremental import FlowCache, cache_layout, cache_tail
from trt_cosy.streaming import FAST_SCHEDULE, hop_schedule
from trt_cosy.verify.golden import GoldenSet

V3_TINY = GOLDEN["v3"]
MEL_TOLERANCE = 5e-5  # incremental vs recomputed mel (the golden mel tolerance is 2e-4)
INCREMENTAL = graphs_v3.FLOW_ESTIMATOR_INCREMENTAL_V3.name
STREAM = graphs_v3.FLOW_ESTIMATOR_STREAM.name


def _tiny_dit():
    pytest.importorskip("torch", reason="the torch reference needs torch (the [build] extra)")
    from trt_cosy.models.v3.export.flow import load_flow_v3

    config = v3_config_from_release_dir(V3_TINY)
    return config, load_flow_v3(V3_TINY, config.flow).decoder.estimator


def test_the_streaming_dit_is_chunk_causal():
    """The premise: with the chunk mask, frames of completed 50-frame chunks are the same in a longer
    call (causal conv position embedding, per-frame norms, RoPE at absolute positions); a frame of an
    unfinished chunk is not (it sees the rest of its chunk), nor is any frame with full attention."""
    import torch

    _, dit = _tiny_dit()
    generator = torch.Generator().manual_seed(1)
    frames = 230
    x, mu, cond = (torch.randn(2, 80, frames, generator=generator) for _ in range(3))  # [2, 80, F]
    t, spks = torch.rand(2, generator=generator), torch.randn(2, 80, generator=generator)
    mu[1], cond[1], spks[1] = 0.0, 0.0, 0.0  # the unconditional CFG row, as the solver feeds it

    def run(length: int, streaming: bool) -> torch.Tensor:
        part = slice(0, length)
        with torch.no_grad():
            return dit(
                x[..., part], torch.ones(2, 1, length), mu[..., part], t, spks, cond[..., part], streaming
            )

    whole = run(frames, True)  # [2, 80, F]
    for length in (50, 100, 200):  # chunk boundaries
        assert float((run(length, True) - whole[..., :length]).abs().max()) < 1e-5, length
    partial = (run(120, True) - whole[..., :120]).abs().amax(dim=(0, 1))  # [120]
    assert float(partial[:100].max()) < 1e-5 and float(partial[100:].max()) > 1e-3
    full = run(frames, False)
    assert float((run(100, False) - full[..., :100]).abs().max()) > 1e-3


def test_the_graph_on_new_frames_equals_the_chunk_attention_dit():
    import torch

    from trt_cosy.models.v3.export.dit_incremental import (
        V3IncrementalEstimatorGraph,
        v3_incremental_cache_layout,
    )

    config, dit = _tiny_dit()
    blocks, width, channels, tail = v3_incremental_cache_layout(config.flow.estimator)
    estimator = config.flow.estimator
    assert (blocks, width, channels) == cache_layout(estimator) and tail == cache_tail(estimator) == 30
    graph = V3IncrementalEstimatorGraph(dit).eval()
    generator = torch.Generator().manual_seed(0)
    for pieces in (((0, 100), (100, 150), (150, 170)), ((0, 50), (50, 60))):  # new T below the 30-frame tail
        frames = pieces[-1][1]
        x, mu, cond = (torch.randn(2, 80, frames, generator=generator) for _ in range(3))  # [2, 80, F]
        t, spks = torch.rand(2, generator=generator), torch.randn(2, 80, generator=generator)
        with torch.no_grad():
            whole = dit(x, torch.ones(2, 1, frames), mu, t, spks, cond, streaming=True)  # [2, 80, F]
            past, tails, outs = torch.zeros(0, blocks, 2, width), torch.zeros(2, channels, tail), []
            for start, end in pieces:  # chunk-aligned starts, any length
                part = slice(start, end)
                out, new_blocks, tails = graph(
                    x[..., part], mu[..., part], t, spks, cond[..., part], past, tails
                )
                past = torch.cat([past, new_blocks])
                outs.append(out)
        error = float((torch.cat(outs, dim=-1) - whole).abs().max())
        assert error < 1e-5, (pieces, error)
        assert past.shape == (frames, blocks, 2, width)


# ----------------------------------------------------------------------------- tiny ONNX Runtime engines


@pytest.fixture(scope="module")
def v3_engines(tmp_path_factory):
    return family_engines(tmp_path_factory, "v3")


@pytest.fixture(scope="module")
def v3_model(v3_engines):
    return load_engines(v3_engines, threads=1)


@pytest.fixture(scope="module")
def golden() -> GoldenSet:
    return GoldenSet.load(V3_TINY / "reference.npz")


def _flow(model, incremental: bool, limit: int | None = None) -> FlowStage:
    runners = model.runners
    extra = {"voice_slots": 0} | ({} if limit is None else {"cache_limit_bytes": limit})
    return FlowStage(
        runners[graphs_v3.FLOW_ENCODER_V3.name],
        runners[graphs_v3.FLOW_ESTIMATOR.name],
        runners[STREAM],
        model.flow_noise,
        model.config.flow,
        incremental_runner=runners[INCREMENTAL] if incremental else None,
        **extra,
    )


def _prompt(golden: GoldenSet):
    meta = golden.meta["stream"]
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
def test_incremental_chunks_equal_recomputed_chunks(v3_model, golden, schedule):
    model = v3_model
    assert INCREMENTAL in model.runners  # built with the engines
    recompute, incremental = _flow(model, False), _flow(model, True)
    prompt_tokens, prompt = _prompt(golden)
    tokens = np.random.default_rng(0).integers(0, model.config.flow.vocab_size, (1, 330))  # [1, 330]
    plans = hop_schedule(prompt_tokens, True, 25, 3, schedule).plan_all(tokens.shape[1])
    assert sum(not plan.final for plan in plans) >= 3
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
    frames = [2 * (prompt_tokens + plan.end - 3) for plan in plans[:-1]]
    assert held[:-1] == frames and held[-1] == 0 and cache.nbytes < 2**20


@pytest.mark.slow
def test_past_the_limit_the_segment_recomputes(v3_model, golden, caplog):
    model = v3_model
    prompt_tokens, prompt = _prompt(golden)
    steps = model.config.flow.cfm.n_timesteps
    per_frame = FlowCache(model.config.flow.estimator, steps).bytes_per_frame
    dit = model.config.flow.estimator
    assert per_frame == steps * dit.depth * 2 * dit.dim * 4
    tokens = np.random.default_rng(1).integers(0, model.config.flow.vocab_size, (1, 200))
    plans = hop_schedule(prompt_tokens, True, 25, 3, "official").plan_all(tokens.shape[1])[:2]
    first = 2 * (prompt_tokens + plans[0].end - 3)  # the first chunk's frames fit, the second's do not
    flow, reference = _flow(model, True, limit=(first + 10) * per_frame), _flow(model, False)
    cache = flow.new_cache()
    with caplog.at_level(logging.INFO, logger="trt_cosy.stages.flow_incremental"):
        for plan in plans:
            args = (tokens[:, : plan.end], *prompt)
            got = flow.token2mel(*args, streaming=True, finalize=False, cache=cache).mel
            want = reference.token2mel(*args, streaming=True, finalize=False).mel
            assert float(np.abs(got - want).max()) <= MEL_TOLERANCE, plan
    assert cache.disabled is not None and "limit" in cache.disabled and cache.nbytes < 2**20
    assert "incremental flow off" in caplog.text


@pytest.mark.slow
def test_verify_stream_rows_pass_through_the_incremental_flow(v3_model, golden):
    """`trt-cosy verify --backend onnxruntime` on the v3 golden set: the second streaming chunk of
    ``stream`` now runs the incremental DiT (one cache per scenario, as a request); rows stay ok."""
    from trt_cosy.verify import run_verify

    assert INCREMENTAL in v3_model.runners
    rows = [row for row in run_verify(v3_model, golden) if row.key.startswith(("stream_", "streampad_"))]
    assert any(row.key == "stream_c1_flow_mel" for row in rows)
    failed = [f"{row.key} {row.max_abs_err}" for row in rows if row.status not in ("ok", "skipped")]
    assert not failed, failed


@pytest.mark.slow
def test_streaming_requests_use_the_incremental_dit_and_match_recomputation(
    v3_engines, tmp_path_factory, monkeypatch
):
    tts = CosyVoice.load(v3_engines, config=EngineConfig(threads=1, normalizer="none"))
    voice = tts.voice_from_wav(reference_wavs(tmp_path_factory.mktemp("v3inc-wavs"))["ref"], REF_TEXT)
    tokens = [int(t) for t in np.random.default_rng(1).integers(3000, 6000, 130)]  # no silent ids
    monkeypatch.setattr(Request, "_decode", lambda self, index: iter(tokens))  # V3Request filters this
    config = SynthesisConfig(stream=True)
    tts, counters = counting(tts)
    chunks = list(tts.synthesize("Hi.", voice, seed=0, config=config))
    steps = tts.model.config.flow.cfm.n_timesteps
    streamed = len(chunks) - 1  # every chunk but the official final full-attention one
    assert streamed >= 2
    incremental_calls = counters[INCREMENTAL].calls
    assert incremental_calls >= streamed * steps and counters[STREAM].calls == 0
    flow = tts._stages.flow
    runner, flow.incremental_runner = flow.incremental_runner, None  # as engines without the graph
    try:
        recomputed = list(tts.synthesize("Hi.", voice, seed=0, config=config))
    finally:
        flow.incremental_runner = runner
    assert counters[INCREMENTAL].calls == incremental_calls and counters[STREAM].calls == streamed * steps
    for ours, theirs in zip(chunks, recomputed, strict=True):
        assert ours.samples.shape == theirs.samples.shape
        assert float(np.abs(ours.samples - theirs.samples).max()) <= 1e-4, ours.index  # wav: golden 1e-3


@pytest.mark.slow
def test_v3_engines_without_the_graph_load_and_recompute(v3_engines, tmp_path, caplog):
    from trt_cosy.models.v3.family import V3Family

    engines = tmp_path / "engines"
    shutil.copytree(v3_engines, engines, ignore=shutil.ignore_patterns("flow_estimator_incremental.onnx"))
    manifest = Manifest.read(engines)
    del manifest.graphs[INCREMENTAL]
    del manifest.files["flow_estimator_incremental.onnx"]
    manifest.write(engines)
    model = load_engines(engines, threads=1)
    assert INCREMENTAL not in model.runners
    with caplog.at_level(logging.INFO, logger="trt_cosy.models.v2.family"):
        stages = V3Family().build_stages(model)
    assert stages.flow.new_cache() is None
    assert "streaming chunks recompute" in caplog.text
