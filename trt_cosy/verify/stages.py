"""Drive each stage on a golden file's inputs; return our outputs under the golden key names.

Each stage is fed the golden inputs (and the recorded noise) so its error is its own; the
streaming assembly chains our own flow output into our vocoder, as a request
does (``run_flow``), and checks the chunk bookkeeping end to end.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..runtime import graphs
from ..runtime.model import LoadedModel
from ..stages.flow import FlowStage
from ..stages.llm import LLMStage
from ..stages.sampling import greedy_sample
from ..stages.vocoder import VocoderCache, VocoderStage
from .golden import GoldenSet
from .recording import RecordingRunner

__all__ = [
    "run_llm",
    "run_flow",
    "run_hift",
    "golden_flow_stage",
    "golden_flow_chunks",
    "greedy_outputs",
    "scenario_prompt",
    "teacher_forced_outputs",
]


def run_llm(model: LoadedModel, golden: GoldenSet, skipped: dict[str, str]) -> dict[str, Any]:
    if "llm_tf_lm_input" not in golden:
        return {}
    text, prompt_text = golden.ids("in_text"), golden.ids("in_prompt_text")
    prompt_speech, target = golden.ids("in_prompt_speech_token"), golden.ids("in_target_speech_token")
    prefix_len = 1 + prompt_text.size + text.size + 1 + prompt_speech.size
    n_forced = golden["llm_tf_lm_input"].shape[1] - prefix_len
    stage = LLMStage(model.runners[graphs.LLM.name], model.llm_tables, model.config.llm)
    lm_input = stage.build_inputs(text, prompt_text, np.concatenate([prompt_speech, target[:n_forced]]))
    logits, hidden = stage.teacher_forced(lm_input)  # [1, L, V], [1, L, D]
    ours: dict[str, Any] = {"llm_tf_lm_input": lm_input, "llm_tf_hidden": hidden, "llm_tf_logits": logits}
    ours["llm_tf_cached_logp"] = stage.cached_logp(lm_input[:, :prefix_len], target[:n_forced])
    ours.update(
        greedy_outputs(model, golden, model.runners[graphs.LLM.name], text, prompt_text, prompt_speech)
    )
    return ours


def teacher_forced_outputs(
    lm_input: np.ndarray,
    hidden: np.ndarray,
    logits: np.ndarray,
    prefix_len: int,
    logp: np.ndarray,
    cached_hidden: np.ndarray,
) -> dict[str, Any]:
    """The teacher-forced and KV-cached LLM outputs under their golden keys (logits from the row that
    predicts the first target token)."""
    return {
        "llm_tf_lm_input": lm_input,
        "llm_tf_hidden": hidden,
        "llm_tf_logits": logits[:, prefix_len - 1 :],  # the rows that predict target tokens
        "llm_tf_cached_logp": logp,
        "llm_tf_cached_hidden": cached_hidden,
    }


def greedy_outputs(
    model: LoadedModel,
    golden: GoldenSet,
    runner: Any,
    text: np.ndarray,
    prompt_text: np.ndarray,
    prompt_speech: np.ndarray,
) -> dict[str, Any]:
    """The greedy decode of the golden's length through ``LLMStage`` on ``runner`` (its tokens and each
    step's logits), or {} where the golden has none."""
    if "llm_greedy_tokens" not in golden:
        return {}
    steps = golden["llm_greedy_tokens"].size
    recorder = RecordingRunner(runner)
    greedy = LLMStage(recorder, model.llm_tables, model.config.llm)
    tokens = list(greedy.generate(text, prompt_text, prompt_speech, greedy_sample, max_new_tokens=steps))
    return {
        "llm_greedy_tokens": np.asarray(tokens, dtype=np.int32),
        "llm_greedy_logits": np.stack(recorder.last_logits[:steps]),  # [steps, V]
    }


def golden_flow_stage(
    model: LoadedModel,
    golden: GoldenSet,
    flow_graphs: tuple[graphs.GraphSpec, ...] = (
        graphs.FLOW_ENCODER,
        graphs.FLOW_ESTIMATOR,
        graphs.FLOW_ESTIMATOR_STREAM,
        graphs.FLOW_ESTIMATOR_INCREMENTAL,
    ),
) -> FlowStage:
    """``FlowStage`` over the model's ``flow_graphs`` (encoder, estimator, streaming estimator,
    incremental estimator where the engines have it), fed the golden CFM noise (the model's own
    where the file has none)."""
    noise = golden["flow_rand_noise"] if "flow_rand_noise" in golden else model.flow_noise
    runners = model.runners
    encoder, estimator, stream, incremental = flow_graphs
    return FlowStage(
        runners[encoder.name],
        runners[estimator.name],
        runners[stream.name],
        np.asarray(noise, dtype=np.float32),
        model.config.flow,
        incremental_runner=runners.get(incremental.name),
    )


def scenario_prompt(golden: GoldenSet, scenario: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    n_prompt = int(scenario["prompt_tokens"])
    tokens = golden["in_prompt_speech_token"][:, :n_prompt].astype(np.int64)  # [1, P]
    feat = golden["in_prompt_feat"][:, : int(scenario["prompt_feat_frames"])]  # [1, 2P, 80]
    return tokens, feat


def golden_flow_chunks(golden: GoldenSet, stage: FlowStage):
    """Yield (scenario name, prefix, chunk meta, FlowOutput) for every chunk of every scenario through
    ``stage`` (a ``golden_flow_stage``), the chunks of a scenario through one flow cache."""
    embedding = golden["in_spk_embedding"]
    for name, scenario in golden.flow_scenarios():
        prompt_tokens, prompt_feat = scenario_prompt(golden, scenario)
        cache = stage.new_cache()  # incremental chunks where the engines have the graph, as a request
        for index, chunk in enumerate(scenario["chunks"]):
            prefix = f"{name}_c{index}_"
            output = stage.token2mel(
                golden[prefix + "flow_tokens"].astype(np.int64),
                prompt_tokens,
                prompt_feat,
                embedding,
                streaming=bool(chunk["flow_streaming"]),
                finalize=bool(chunk["flow_finalize"]),
                cache=cache,
            )
            yield name, prefix, chunk, output


def run_flow(model: LoadedModel, golden: GoldenSet, skipped: dict[str, str]) -> dict[str, Any]:
    """Flow per chunk from the golden tokens, then our mel through our streaming vocoder."""
    ours: dict[str, Any] = {}
    vocoder = VocoderStage(model.runners[graphs.HIFT.name], model.config.hift)
    ratio = model.config.token_mel_ratio
    caches: dict[str, VocoderCache] = {}
    pieces: dict[str, list[np.ndarray]] = {}
    for name, prefix, chunk, output in golden_flow_chunks(golden, golden_flow_stage(model, golden)):
        ours[prefix + "flow_mu"] = output.mu.transpose(0, 2, 1)  # [1, T, 80] as the golden stores it
        ours[prefix + "flow_mel"] = output.mel
        cache = caches.setdefault(name, VocoderCache())
        mel = output.mel[:, :, ratio * int(chunk["token_offset"]) :]  # [1, 80, F]
        empty_source = np.zeros((1, 1, 0), dtype=np.float32)
        ours[prefix + "hift_cache_source"] = empty_source if cache.empty else cache.source
        ours[prefix + "hift_mel"] = mel if cache.empty else np.concatenate([cache.mel, mel], axis=2)
        samples = vocoder.render(
            mel,
            golden[prefix + "hift_sine_noise"].astype(np.float32),
            cache,
            final=bool(chunk["flow_finalize"]),
        )  # samples: [1, N]
        ours[prefix + "out_speech"] = samples
        pieces.setdefault(name, []).append(samples)
    for name, chunks in pieces.items():
        ours[f"{name}_wav"] = np.concatenate(chunks, axis=1)
    return ours


def _hift(
    model: LoadedModel, mel: np.ndarray, noise: np.ndarray, cache_source: np.ndarray
) -> dict[str, np.ndarray]:
    feed = {
        "mel": mel,
        "sine_noise": noise.astype(np.float32),
        "cache_source": cache_source.astype(np.float32),
    }
    return model.runners[graphs.HIFT.name].infer(feed)


def run_hift(model: LoadedModel, golden: GoldenSet, skipped: dict[str, str]) -> dict[str, Any]:
    ours: dict[str, Any] = {}
    if "in_hift_synth_mel" in golden:
        empty = np.zeros((1, 1, 0), dtype=np.float32)
        out = _hift(model, golden["in_hift_synth_mel"], golden["hift_synth_sine_noise"], empty)
        ours.update(hift_synth_wav=out["wav"], hift_synth_source=out["source"], hift_synth_f0=out["f0"])
    for name, scenario in golden.flow_scenarios():
        for index in range(len(scenario["chunks"])):
            prefix = f"{name}_c{index}_"
            out = _hift(
                model,
                golden[prefix + "hift_mel"],
                golden[prefix + "hift_sine_noise"],
                golden[prefix + "hift_cache_source"],
            )
            ours[prefix + "hift_wav"], ours[prefix + "hift_source"] = out["wav"], out["source"]
            ours[prefix + "hift_f0"] = out["f0"]
    return ours
