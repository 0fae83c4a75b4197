"""Tiny engines of the three families and the golden VC runs of their official reference sets
(test_convert_parity, test_convert)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from _support import family_engines, tiny_engines

from trt_cosy import CosyVoice, EngineConfig
from trt_cosy.frontend.voice import Voice

DATA = Path(__file__).parent / "data"
GOLDEN_DIRS = {"v1": DATA / "cosyvoice1-tiny", "v2": DATA / "cosyvoice2-tiny", "v3": DATA / "cosyvoice3-tiny"}


def load_family(factory, family: str) -> CosyVoice:
    """CosyVoice on the session's tiny ONNX Runtime engines of ``family`` (built once per session)."""
    engines = tiny_engines(factory, GOLDEN_DIRS["v2"]) if family == "v2" else family_engines(factory, family)
    return CosyVoice.load(engines, config=EngineConfig(threads=1))


def load_golden(family: str) -> dict:
    with np.load(GOLDEN_DIRS[family] / "reference.npz") as data:
        golden = {key: data[key] for key in data.files}
    golden["meta"] = json.loads(str(golden.pop("meta_json")))
    return golden


def golden_run_voices(golden: dict, run: str, sample_rate: int) -> tuple[Voice, Voice]:
    """(source, target) of one golden ``tts(source_speech_token=...)`` run: the source as a ``Voice``
    whose speech tokens are the run's target tokens, the target with the run's flow prompt."""
    meta = golden["meta"][run]
    tokens = golden["in_target_speech_token"][0, : meta["target_tokens"]]
    empty_mel = np.zeros((0, golden["in_prompt_feat"].shape[2]), np.float32)
    embedding = golden["in_spk_embedding"][0]
    source = Voice("", np.zeros(0, np.int32), tokens, empty_mel, embedding, sample_rate)
    target = Voice(
        "",
        np.zeros(0, np.int32),
        golden["in_prompt_speech_token"][0, : meta["prompt_tokens"]],
        golden["in_prompt_feat"][0, : meta["prompt_feat_frames"]],
        embedding,
        sample_rate,
    )
    return source, target
