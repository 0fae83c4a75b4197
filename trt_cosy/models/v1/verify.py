"""``trt-cosy verify`` for CosyVoice 1 golden sets (golden README §7).

The official v1 draws fresh random numbers on every call; the golden file recorded them
(``<prefix>flow_z`` [1, 80, T], ``<prefix>hift_rand_phase`` [1, 9, 1], ``<prefix>hift_sine_noise``
[1, 9, L], float16 and exact) and ``_GoldenDraws`` replays them in our graph layouts. The LLM is
checked teacher-forced, KV-cached and greedy (zero-shot and SFT); every run goes through our
``V1Synthesizer`` chunk by chunk (flow cache, mel overlap, HiFT cache and cross-fades as a request
does), while each HiFT call is also checked alone on the golden mel and source cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import InputError
from ...runtime.backends.base import Runner
from ...runtime.model import LoadedModel
from ...stages.sampling import greedy_sample
from ...verify.golden import GoldenSet
from ...verify.recording import RecordingRunner
from . import graphs as graphs_v1
from .stages import V1FlowOutput, V1FlowStage, V1LLMStage, V1StreamState, V1Synthesizer

__all__ = ["run_llm_v1", "run_flow_v1", "run_hift_v1"]

_RUNS = ("nonstream", "stream", "sft")
_SFT_RUN = "sft"  # the run that uses the preset-speaker embedding (in_sft_spk_embedding)


class _GoldenDraws:
    """``models.v1.stages.V1Draws`` replaying the official draws recorded under one key prefix."""

    def __init__(self, golden: GoldenSet, flow_prefix: str, hift_prefix: str):
        self.golden = golden
        self.flow_prefix = flow_prefix
        self.hift_prefix = hift_prefix

    def flow_noise(self, frames: int) -> np.ndarray:
        z = self.golden[self.flow_prefix + "flow_z"].astype(np.float32)  # [1, 80, T]
        if z.shape[2] != frames:
            raise InputError(
                f"golden {self.flow_prefix}flow_z has {z.shape[2]} frames, this call needs {frames}: "
                "the golden file does not belong to this model."
            )
        return z

    def hift_phase(self) -> np.ndarray:
        return self.golden[self.hift_prefix + "rand_phase"].astype(np.float32)[:, :, 0]  # [1, 9, 1] -> [1, 9]

    def hift_noise(self, samples: int) -> np.ndarray:
        noise = self.golden[self.hift_prefix + "sine_noise"].astype(np.float32)  # [1, 9, L]
        if noise.shape[2] != samples:
            raise InputError(
                f"golden {self.hift_prefix}sine_noise has {noise.shape[2]} samples, this call needs "
                f"{samples}: the golden file does not belong to this model."
            )
        return np.ascontiguousarray(noise.transpose(0, 2, 1))  # [1, L, 9] as the graph takes it


class _RecordingFlow(V1FlowStage):
    """``V1FlowStage`` keeping its last output (h, mu and mel of the chunk)."""

    last: V1FlowOutput | None = None

    def token2mel(self, *args: Any) -> V1FlowOutput:
        self.last = super().token2mel(*args)
        return self.last


def _llm_stage(model: LoadedModel, llm: Runner | None = None) -> V1LLMStage:
    runners = model.runners
    llm = llm or runners[graphs_v1.V1_LLM.name]
    return V1LLMStage(runners[graphs_v1.V1_TEXT_ENCODER.name], llm, model.llm_tables, model.config.llm)


def run_llm_v1(model: LoadedModel, golden: GoldenSet, skipped: dict[str, str]) -> dict[str, Any]:
    """Teacher-forced and cached passes (zero-shot layout with the speaker row), greedy decodes."""
    if "llm_tf_lm_input" not in golden:
        return {}
    text, prompt_text = golden.ids("in_text"), golden.ids("in_prompt_text")
    prompt_speech, target = golden.ids("in_prompt_speech_token"), golden.ids("in_target_speech_token")
    prefix_len = 1 + 1 + prompt_text.size + text.size + 1 + prompt_speech.size  # sos, spk, text, task, speech
    n_forced = golden["llm_tf_lm_input"].shape[1] - prefix_len
    stage = _llm_stage(model)
    embedding = golden["in_spk_embedding"]
    lm_input = stage.build_inputs(
        text, prompt_text, np.concatenate([prompt_speech, target[:n_forced]]), embedding
    )  # [1, L, D]
    logits, hidden = stage.teacher_forced(lm_input)  # [1, L, V], [1, L, D]
    logp, cached_hidden = stage.cached_steps(lm_input[:, :prefix_len], target[:n_forced])
    ours: dict[str, Any] = {
        "llm_tf_lm_input": lm_input,
        "llm_tf_hidden": hidden,
        "llm_tf_logits": logits[:, prefix_len - 1 :],  # the rows that predict target tokens
        "llm_tf_cached_logp": logp,
        "llm_tf_cached_hidden": cached_hidden,
    }
    no_prompt = np.zeros(0, np.int64)
    modes = [("", prompt_text, prompt_speech, embedding)]  # zero-shot
    if "in_sft_spk_embedding" in golden:  # SFT: preset speaker, no prompt text or speech
        modes.append(("sft_", no_prompt, no_prompt, golden["in_sft_spk_embedding"]))
    for prefix, p_text, p_speech, spk in modes:
        key = prefix + "llm_greedy_tokens"
        if key not in golden:
            continue
        steps = golden[key].size
        recorder = RecordingRunner(model.runners[graphs_v1.V1_LLM.name])
        tokens = _llm_stage(model, recorder).generate(
            text, p_text, p_speech, spk, greedy_sample, max_new_tokens=steps
        )
        ours[key] = np.asarray(list(tokens), dtype=np.int32)
        ours[prefix + "llm_greedy_logits"] = np.stack(recorder.last_logits[:steps])  # [steps, V]
    return ours


def _runs(golden: GoldenSet):
    for name in _RUNS:
        run = golden.meta.get(name)
        if isinstance(run, dict) and run.get("chunks") and f"{name}_c0_flow_tokens" in golden:
            yield name, run


def _synthesize(model: LoadedModel, golden: GoldenSet, name: str, run: dict[str, Any]) -> dict[str, Any]:
    """One golden run through ``V1Synthesizer``: the state entering each call and what it made."""
    runners = model.runners
    flow = _RecordingFlow(
        runners[graphs_v1.V1_FLOW_ENCODER.name], runners[graphs_v1.V1_FLOW_ESTIMATOR.name], model.config.flow
    )
    hift = RecordingRunner(runners[graphs_v1.V1_HIFT.name])
    synth = V1Synthesizer(flow, hift, model.config)
    prompt_tokens = golden["in_prompt_speech_token"][:, : int(run["prompt_tokens"])]  # [1, P]
    prompt_feat = golden["in_prompt_feat"][:, : int(run["prompt_feat_frames"])]  # [1, P_mel, 80]
    embedding = golden["in_sft_spk_embedding" if name == _SFT_RUN else "in_spk_embedding"]
    state, ours, pieces = V1StreamState(), {}, []
    for index, chunk in enumerate(run["chunks"]):
        prefix = f"{name}_c{index}_"
        ours[prefix + "flow_cache_in"] = state.flow_cache
        ours[prefix + "mel_overlap_in"] = _or_empty(state.mel_overlap, (1, 80, 0))
        ours[prefix + "hift_cache_source"] = _or_empty(state.hift_source, (1, 1, 0))
        ours[prefix + "hift_speech_cache_in"] = _or_empty(state.hift_speech, (1, 0))
        draws = _GoldenDraws(golden, prefix, prefix + "hift_")
        tokens = golden[prefix + "flow_tokens"]
        pieces.append(
            synth.token2wav(
                tokens, prompt_tokens, prompt_feat, embedding, state, draws, bool(chunk["finalize"])
            )
        )  # [1, S]
        ours[prefix + "flow_h"] = flow.last.h
        ours[prefix + "flow_mu"] = flow.last.mu.transpose(0, 2, 1)  # [1, T, 80] as the golden stores it
        ours[prefix + "flow_mel"] = flow.last.mel
        ours[prefix + "hift_mel"] = hift.feed["mel"]
    ours[f"{name}_wav"] = np.concatenate(pieces, axis=1)
    return ours


def _or_empty(value: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
    return np.zeros(shape, np.float32) if value is None else value


def run_flow_v1(model: LoadedModel, golden: GoldenSet, skipped: dict[str, str]) -> dict[str, Any]:
    """Every run end to end through our flow and streaming vocoder bookkeeping."""
    ours: dict[str, Any] = {}
    for name, run in _runs(golden):
        ours.update(_synthesize(model, golden, name, run))
    return ours


def _vocode(
    model: LoadedModel, golden: GoldenSet, hift_prefix: str, mel: np.ndarray, cache_source: np.ndarray
) -> dict[str, np.ndarray]:
    draws = _GoldenDraws(golden, "", hift_prefix)
    samples = mel.shape[2] * model.config.hift.samples_per_frame
    feed = {
        "mel": np.ascontiguousarray(mel, np.float32),
        "sine_noise": draws.hift_noise(samples),
        "rand_phase": draws.hift_phase(),
        "cache_source": np.ascontiguousarray(cache_source, np.float32),
    }
    return model.runners[graphs_v1.V1_HIFT.name].infer(feed)


def run_hift_v1(model: LoadedModel, golden: GoldenSet, skipped: dict[str, str]) -> dict[str, Any]:
    """Each official HiFT call alone, on the golden mel, source cache and draws."""
    ours: dict[str, Any] = {}
    if "in_hift_synth_mel" in golden:
        out = _vocode(
            model, golden, "hift_synth_", golden["in_hift_synth_mel"], np.zeros((1, 1, 0), np.float32)
        )
        ours.update(hift_synth_wav=out["wav"], hift_synth_source=out["source"], hift_synth_f0=out["f0"])
    for name, run in _runs(golden):
        for index in range(len(run["chunks"])):
            prefix = f"{name}_c{index}_"
            out = _vocode(
                model,
                golden,
                prefix + "hift_",
                golden[prefix + "hift_mel"],
                golden[prefix + "hift_cache_source"],
            )
            ours[prefix + "hift_f0"] = out["f0"]
            ours[prefix + "hift_wav"] = out["wav"]  # stored for the streaming runs only
            ours[prefix + "hift_source"] = out["source"]  # stored for the non-streaming runs only
    return ours
