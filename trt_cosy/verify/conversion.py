"""The voice-conversion path in ``trt-cosy verify``.

Every golden set's token -> wav runs were made by the official
``CosyVoiceModel.tts(source_speech_token=...)``, the entry point of ``inference_vc`` (``vc_job``: the source tokens stand in for the LLM's). Here the same
tokens go through a conversion request (``conversion.conversion_request_class`` over the family's request:
its chunk schedule, flow and vocoder state, final call), with the golden prompt and the official random
draws injected; its audio is compared with ``<run>_wav`` under the key ``conversion:<run>_wav``.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from ..conversion import conversion_request_class
from ..frontend.voice import Voice
from ..runtime.model import LoadedModel
from ..synthesis import LLMPrompt, Segment
from .golden import GoldenSet

__all__ = ["CONVERSION_PREFIX", "RUNS", "run_conversion"]

CONVERSION_PREFIX: Final = "conversion:"
RUNS: Final = ("nonstream", "stream", "streampad")  # sft (CosyVoice 1) has no flow prompt: not a VC run


class _ReplayV1Draws:
    """The official CosyVoice 1 draws of one golden run, chunk after chunk (``V1Draws``)."""

    def __init__(self, golden: GoldenSet, run: str):
        self.golden, self.run, self.chunk = golden, run, -1

    def flow_noise(self, frames: int) -> np.ndarray:  # drawn first in every chunk
        self.chunk += 1
        return self.golden[f"{self.run}_c{self.chunk}_flow_z"].astype(np.float32)  # [1, 80, T]

    def hift_phase(self) -> np.ndarray:
        return self.golden[f"{self.run}_c{self.chunk}_hift_rand_phase"].astype(np.float32)[:, :, 0]  # [1, 9]

    def hift_noise(self, samples: int) -> np.ndarray:
        noise = self.golden[f"{self.run}_c{self.chunk}_hift_sine_noise"].astype(np.float32)  # [1, 9, S]
        return noise.transpose(0, 2, 1)  # [1, S, 9]


def _voices(golden: GoldenSet, run: str, sample_rate: int) -> tuple[np.ndarray, Voice]:
    """(source tokens int64 [n], target voice with the run's flow prompt)."""
    meta = golden.meta[run]
    tokens = golden.ids("in_target_speech_token")[: meta["target_tokens"]]
    target = Voice(
        "",
        np.zeros(0, np.int32),
        golden["in_prompt_speech_token"][0, : meta["prompt_tokens"]],
        golden["in_prompt_feat"][0, : meta["prompt_feat_frames"]],
        golden["in_spk_embedding"][0],
        sample_rate,
    )
    return tokens, target


def run_conversion(model: LoadedModel, golden: GoldenSet, skipped: dict[str, str]) -> dict[str, Any]:
    """``conversion:<run>_wav`` for each golden run with a flow prompt."""
    from ..family_lookup import family_of  # the families' drivers import this package

    family = family_of(model.config)
    stages = family.build_stages(model, 0)  # each request decodes alone (no LLM runs here anyway)
    request_class = conversion_request_class(family.request_class)
    ours: dict[str, Any] = {}
    for run in RUNS:
        meta = golden.meta.get(run)
        if not isinstance(meta, dict) or f"{run}_wav" not in golden or "prompt_tokens" not in meta:
            continue
        tokens, target = _voices(golden, run, model.config.sample_rate)
        stream = run != "nonstream"
        segments = [Segment("golden source tokens", np.zeros(0, np.int64))]
        empty = np.zeros(0, np.int64)
        request = request_class(
            stages, model.config, segments, target, 0, stream, tokens.size, LLMPrompt(empty, empty)
        )
        request.attach_source(lambda index, tokens=tokens: tokens, 1)
        _inject_draws(request, family, golden, run)
        chunks = list(request.chunks())
        ours[f"{CONVERSION_PREFIX}{run}_wav"] = np.concatenate([chunk.samples for chunk in chunks])[None]
    return ours


def _inject_draws(request: Any, family: Any, golden: GoldenSet, run: str) -> None:
    """The official random draws of the run: a family that draws fresh CFM noise per call (CosyVoice 1)
    replays the flow's and HiFT's draws; one with the fixed CFM noise but fresh HiFT noise (CosyVoice2)
    replays HiFT's sine noise; CosyVoice3's noise is all fixed, in the engines."""
    if not family.fixed_flow_noise:
        request.draws = _ReplayV1Draws(golden, run)
    elif not family.fixed_hift_noise:
        render, chunk = request._render, iter(range(1000))

        def render_with_official_noise(tokens, plan, state):
            request.vocoder_rng = golden[f"{run}_c{next(chunk)}_hift_sine_noise"].astype(np.float32)
            return render(tokens, plan, state)

        request._render = render_with_official_noise
