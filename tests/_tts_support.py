"""The CosyVoice of the API tests that synthesise nothing (the torch reference model of the golden tiny
checkpoint) and the stubbed models of the chunk tests (test_tts, test_cli_say, the server tests)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trt_cosy import CosyVoice, EngineConfig, pipeline
from trt_cosy.config import QWEN_DIR
from trt_cosy.frontend.text import TextNormalizer
from trt_cosy.frontend.tokenizer import QwenTextTokenizer
from trt_cosy.frontend.voice import VoiceBuilder
from trt_cosy.pipeline import Request
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.manifest import hash_checkpoint
from trt_cosy.streaming import ChunkPlan
from trt_cosy.tts import model_id_from_checkpoint


def make_torch_tts(release: Path) -> CosyVoice:
    """CosyVoice injected with the torch reference model (fast to load; used where nothing is synthesised)."""
    from trt_cosy.builder.reference import load_torch_model

    model = load_torch_model(release)
    tokenizer = QwenTextTokenizer.from_dir(release / QWEN_DIR)
    builder = VoiceBuilder(
        OrtRunner.from_path(release / "campplus.onnx", "campplus", threads=1),
        OrtRunner.from_path(release / "speech_tokenizer_v2.onnx", "speech_tokenizer", threads=1),
        model.config.mel,
        model.config.token_mel_ratio,
        model_id=model_id_from_checkpoint(model.config.family, hash_checkpoint(release)),
    )
    normalizer = TextNormalizer("none", count_tokens=tokenizer.count_tokens)
    return CosyVoice(model, tokenizer, builder, normalizer, EngineConfig(threads=1))


def stub_models(monkeypatch, render=None) -> list[tuple[int, ChunkPlan]]:
    """Replace the LLM (5 speech tokens per segment) and flow + vocoder (``render(plan) -> samples``,
    default 960 zeros per chunk) of every request; returns the (call, plan) log of the renders."""
    calls: list[tuple[int, ChunkPlan]] = []

    def fake_render(stages, voice, tokens, plan, cache, rng, token_mel_ratio, flow_cache=None, speed=1.0):
        calls.append((len(calls), plan))
        samples = np.zeros(960, np.float32) if render is None else render(len(calls) - 1, plan)
        return samples, 0.0, 0.0

    monkeypatch.setattr(Request, "_decode", lambda self, index: iter(range(1, 6)))
    monkeypatch.setattr(pipeline, "render_chunk", fake_render)
    return calls
