"""Streaming chunks through the incremental estimator against the recomputed ones, on any engines
(test_mixed_engines, test_openvino): the golden ``streampad`` prompt, random tokens, a hop schedule."""

from __future__ import annotations

import numpy as np

from trt_cosy.runtime import graphs
from trt_cosy.runtime.model import LoadedModel
from trt_cosy.stages.flow import FlowStage
from trt_cosy.streaming import hop_schedule
from trt_cosy.verify.golden import GoldenSet

INCREMENTAL = graphs.FLOW_ESTIMATOR_INCREMENTAL.name


def flow_stage(model: LoadedModel, incremental: bool, voice_slots: int = 0, **options) -> FlowStage:
    """The flow stage of ``model``, with or without its incremental runner (default: no voice prefixes;
    ``options``: other ``FlowStage`` arguments, e.g. ``cache_limit_bytes``)."""
    runners = model.runners
    return FlowStage(
        runners[graphs.FLOW_ENCODER.name],
        runners[graphs.FLOW_ESTIMATOR.name],
        runners[graphs.FLOW_ESTIMATOR_STREAM.name],
        model.flow_noise,
        model.config.flow,
        incremental_runner=runners[INCREMENTAL] if incremental else None,
        voice_slots=voice_slots,
        **options,
    )


def chunk_errors(
    model: LoadedModel,
    golden: GoldenSet,
    schedule: str,
    reference: LoadedModel | None = None,
    tokens: int = 330,
) -> list[float]:
    """Max |incremental - recomputed| mel per chunk of one segment of ``tokens`` random tokens, the
    incremental chunks on ``model``, the recomputed ones on ``reference`` (default: ``model``); the
    final full-attention call recomputes in both."""
    meta = golden.meta["streampad"]
    prompt_tokens = meta["prompt_tokens"]
    prompt = (
        golden["in_prompt_speech_token"][:, :prompt_tokens].astype(np.int64),  # [1, P]
        golden["in_prompt_feat"][:, : meta["prompt_feat_frames"]],  # [1, 2P, 80]
        golden["in_spk_embedding"],  # [1, 192]
    )
    ids = np.random.default_rng(0).integers(0, model.config.flow.vocab_size, (1, tokens))  # [1, N]
    recompute, incremental = flow_stage(reference or model, False), flow_stage(model, True)
    cache = incremental.new_cache()
    assert cache is not None
    errors = []
    for plan in hop_schedule(prompt_tokens, True, 25, 3, schedule).plan_all(tokens):
        args = (ids[:, : plan.end], *prompt)
        want = recompute.token2mel(*args, streaming=plan.streaming, finalize=plan.final).mel
        got = incremental.token2mel(*args, streaming=plan.streaming, finalize=plan.final, cache=cache).mel
        assert got.shape == want.shape
        errors.append(float(np.abs(got - want).max()))
    assert cache.disabled is None
    return errors
