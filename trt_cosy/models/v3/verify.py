"""``trt-cosy verify`` for CosyVoice3 golden sets (golden README §8).

v3 draws nothing at inference: the fixed CFM noise (``flow_rand_noise``) and the causal HiFT's
uniform NSF buffer (``hift_sine_waves``, float16 and exact) are injected. The LLM stage and the
flow stage are the CosyVoice2 ones on the v3 graphs; the vocoder re-runs HiFT on the whole mel so
far on every chunk (``models.v3.stages.V3VocoderStage``), so the scenario waveforms are checked through
that bookkeeping, and each official HiFT call is also checked alone on the golden mel.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...runtime.model import LoadedModel
from ...stages.llm import LLMStage
from ...verify.golden import GoldenSet
from ...verify.stages import golden_flow_chunks, golden_flow_stage, greedy_outputs, teacher_forced_outputs
from . import graphs as graphs_v3
from .stages import V3VocoderCache, V3VocoderStage, cached_step_outputs

__all__ = ["run_llm_v3", "run_flow_v3", "run_hift_v3"]


def run_llm_v3(model: LoadedModel, golden: GoldenSet, skipped: dict[str, str]) -> dict[str, Any]:
    """Teacher-forced pass, KV-cached steps and the greedy decode (official ``ignore_eos`` rule)."""
    if "llm_tf_lm_input" not in golden:
        return {}
    text, prompt_text = golden.ids("in_text"), golden.ids("in_prompt_text")
    prompt_speech, target = golden.ids("in_prompt_speech_token"), golden.ids("in_target_speech_token")
    prefix_len = 1 + prompt_text.size + text.size + 1 + prompt_speech.size  # sos, text, task, speech
    n_forced = golden["llm_tf_lm_input"].shape[1] - prefix_len
    runner = model.runners[graphs_v3.LLM.name]
    stage = LLMStage(runner, model.llm_tables, model.config.llm)
    lm_input = stage.build_inputs(text, prompt_text, np.concatenate([prompt_speech, target[:n_forced]]))
    logits, hidden = stage.teacher_forced(lm_input)  # [1, L, V], [1, L, D]
    qwen = model.config.llm.qwen
    logp, cached_hidden = cached_step_outputs(
        runner,
        model.llm_tables["speech_embedding"],
        lm_input[:, :prefix_len],
        target[:n_forced],
        (qwen.num_layers, 1, qwen.num_kv_heads, 0, qwen.head_dim),
    )  # [N + 1, V], [N + 1, D]
    ours = teacher_forced_outputs(lm_input, hidden, logits, prefix_len, logp, cached_hidden)
    ours.update(greedy_outputs(model, golden, runner, text, prompt_text, prompt_speech))
    return ours


def _vocoder(model: LoadedModel, golden: GoldenSet) -> V3VocoderStage:
    """The v3 vocoder fed the golden NSF buffer (the model's own one when the file has none)."""
    noise = golden["hift_sine_waves"] if "hift_sine_waves" in golden else model.hift_noise
    runners = model.runners
    return V3VocoderStage(
        runners[graphs_v3.HIFT_V3.name],
        runners[graphs_v3.HIFT_V3_STREAM.name],
        np.asarray(noise, dtype=np.float32),  # stored float16: exactly the values the official model used
        model.config.hift,
    )


def run_flow_v3(model: LoadedModel, golden: GoldenSet, skipped: dict[str, str]) -> dict[str, Any]:
    """Flow per chunk from the golden tokens, then our mel through our streaming vocoder."""
    flow_graphs = (
        graphs_v3.FLOW_ENCODER_V3,
        graphs_v3.FLOW_ESTIMATOR,
        graphs_v3.FLOW_ESTIMATOR_STREAM,
        graphs_v3.FLOW_ESTIMATOR_INCREMENTAL_V3,
    )
    flow = golden_flow_stage(model, golden, flow_graphs)
    vocoder = _vocoder(model, golden)
    ratio = model.config.token_mel_ratio
    ours: dict[str, Any] = {}
    caches: dict[str, V3VocoderCache] = {}
    pieces: dict[str, list[np.ndarray]] = {}
    for name, prefix, chunk, output in golden_flow_chunks(golden, flow):
        mu = output.mu.transpose(0, 2, 1)  # [1, T, 80] as the golden stores it
        ours[prefix + "flow_h"] = mu[:, ::ratio]  # mu is h repeated token_mel_ratio times
        ours[prefix + "flow_mu"] = mu
        ours[prefix + "flow_mel"] = output.mel
        cache = caches.setdefault(name, V3VocoderCache())
        mel = output.mel[:, :, ratio * int(chunk["token_offset"]) :]  # [1, 80, new frames]
        pieces.setdefault(name, []).append(vocoder.render(mel, cache, final=bool(chunk["hift_finalize"])))
        ours[prefix + "hift_mel"] = cache.mel  # the whole mel so far, as HiFT got it
    for name, chunks in pieces.items():
        ours[f"{name}_wav"] = np.concatenate(chunks, axis=1)  # [1, N]
    return ours


def run_hift_v3(model: LoadedModel, golden: GoldenSet, skipped: dict[str, str]) -> dict[str, Any]:
    """Each official ``hift.inference(hift_mel, finalize)`` call alone, on the golden mel."""
    vocoder = _vocoder(model, golden)
    ours: dict[str, Any] = {}
    if "in_hift_synth_mel" in golden:
        out = vocoder.vocode(golden["in_hift_synth_mel"], final=True)
        ours.update(hift_synth_wav=out["wav"], hift_synth_source=out["source"], hift_synth_f0=out["f0"])
    for name, scenario in golden.flow_scenarios():
        for index, chunk in enumerate(scenario["chunks"]):
            prefix = f"{name}_c{index}_"
            out = vocoder.vocode(golden[prefix + "hift_mel"], final=bool(chunk["hift_finalize"]))
            ours[prefix + "hift_f0"] = out["f0"]
            ours[prefix + "hift_wav"] = out["wav"]  # streaming runs; the non-streaming one is <run>_wav
            ours[prefix + "hift_source"] = out["source"]  # stored for the non-streaming run only
    return ours
