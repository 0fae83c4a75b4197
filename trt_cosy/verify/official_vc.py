"""``trt-cosy verify`` on a golden set of the official ``inference_vc`` run end to end.

``tests/data/vc/<family>.npz`` was made by ``tools/golden/make_vc_golden.py``: the official
``CosyVoice*.inference_vc(source wav, target wav)`` (``frontend_vc``, then ``tts(source_speech_token=...)``),
streamed and not, with reproducible random draws (``official_draws``). Here the same wavs go through
trt-cosy's frontend (``conversion.read_source``, the speech tokenizer, ``conversion.vc_voice``) and a
conversion request with the official draws; one row per official output, under ``vc:``:

* ``vc:source_tokens``, ``vc:prompt_tokens`` (exact), ``vc:prompt_feat`` (2e-3, golden README §4.3),
  ``vc:embedding`` (1e-3);
* per run (``nonstream``, ``stream``, ``speed0.5``, ``speed2``: the official speed path):
  ``vc:<run>_calls`` (tokens given to the flow and finalize of each official token2wav call, exact),
  ``vc:<run>_c<k>_flow_mel`` (2e-4; not stored for the speed runs), ``vc:<run>_wav`` (1e-3).

CosyVoice 1: the official frontend loads the target at 24 kHz for its 22.05 kHz mel settings (golden
README §8.5 quirk 5) where trt-cosy resamples to 22.05 kHz on purpose (``models/v1/family.py``); the prompt
mel used and compared here is trt-cosy's mel of the 24 kHz samples, as the official frontend computes it.
The golden's input wavs are slices of ``tests/data/features/audio`` files, found from the golden's own
place in a trt-cosy checkout (or the working directory).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any, Final

import numpy as np

from ..audio import load_audio
from ..conversion import conversion_request_class, read_source, vc_voice
from ..errors import InputError
from ..frontend.features import flow_prompt_mel
from ..runtime.model import LoadedModel
from ..synthesis import LLMPrompt, Segment
from .golden import Comparison, GoldenSet, compare
from .official_draws import OfficialDraws

__all__ = ["VC_PREFIX", "is_vc_golden", "run_official_vc"]

VC_PREFIX: Final = "vc:"
KIND: Final = "inference_vc"
OFFICIAL_PROMPT_RATE: Final = 24000  # official _extract_speech_feat loads every prompt at 24 kHz
_TOLERANCES: Final = {"prompt_feat": 2e-3, "embedding": 1e-3, "flow_mel": 2e-4, "wav": 1e-3}


def is_vc_golden(golden: GoldenSet) -> bool:
    return golden.meta.get("kind") == KIND


def _input_wav(golden: GoldenSet, spec: dict, out: Path) -> Path:
    """Samples [start, end) of the golden's features wav, written as 16-bit PCM (as the script did)."""
    import soundfile

    roots = [Path(golden.source).resolve().parents[index] for index in (3, 2)] + [Path.cwd()]
    found = [root / spec["file"] for root in roots if (root / spec["file"]).is_file()]
    if not found:
        raise InputError(
            f"{spec['file']} (an input of {golden.source}) was not found; run verify from a trt-cosy "
            "checkout."
        )
    data, rate = soundfile.read(found[0], dtype="int16", always_2d=True)  # [N, C]
    soundfile.write(out, data[spec["start"] : spec["end"]], rate, subtype="PCM_16")
    return out


def run_official_vc(
    model: LoadedModel, golden: GoldenSet, model_dir: Path, threads: int | None = None
) -> list[Comparison]:
    """The ``vc:`` rows of one golden (``model_dir``: the release with the frontend ONNX files)."""
    from ..family_lookup import family_of
    from ..runtime.backends.onnxruntime.runner import LazyOrtRunner

    family = family_of(model.config)
    if golden.meta.get("family") != family.name:
        raise InputError(
            f"{golden.source} is a voice-conversion golden of {golden.meta.get('family')}, but the model is "
            f"{family.title}; pass tests/data/vc/{family.name}.npz."
        )
    builder = family.make_voice_builder(
        model, lambda name, graph: LazyOrtRunner(Path(model_dir) / name, graph, threads, check_now=False), ""
    )
    meta, rows = golden.meta, []
    with tempfile.TemporaryDirectory(prefix="trt-cosy-vc-") as tmp:
        source = read_source(_input_wav(golden, meta["source"], Path(tmp) / "source.wav"))  # [N16]
        target_path = _input_wav(golden, meta["target"], Path(tmp) / "target.wav")
        target = vc_voice(builder, target_path)
        if family.name == "v1":
            mel = flow_prompt_mel(load_audio(target_path, OFFICIAL_PROMPT_RATE), builder.mel_config)
            target = dataclasses.replace(target, prompt_mel=mel[0])  # [T, 80]
    tokens = builder.speech_tokens(source)[0].astype(np.int64)  # [n]
    stride = meta["mel_stride"]
    rows.append(compare(f"{VC_PREFIX}source_tokens", tokens, golden["source_tokens"], 0.0))
    rows.append(compare(f"{VC_PREFIX}prompt_tokens", target.speech_tokens, golden["prompt_tokens"], 0.0))
    rows.append(
        compare(
            f"{VC_PREFIX}prompt_feat",
            target.prompt_mel[::stride],
            golden["prompt_feat"],
            _TOLERANCES["prompt_feat"],
        )
    )
    rows.append(
        compare(
            f"{VC_PREFIX}embedding", target.speaker_embedding, golden["embedding"], _TOLERANCES["embedding"]
        )
    )
    for run in meta["runs"]:
        rows.extend(_run_rows(model, family, golden, run, tokens, target))
    return rows


def _run_rows(
    model: LoadedModel, family: Any, golden: GoldenSet, run: str, tokens: np.ndarray, target
) -> list[Comparison]:
    """Convert ``tokens`` into ``target``'s voice as the golden run did (its draws) and compare."""
    meta = golden.meta[run]
    draws = OfficialDraws(golden.meta["draw_seed"], meta["draws"])
    stages = family.build_stages(model, 0)
    flow = stages.synthesizer.flow if family.name == "v1" else stages.flow
    mels, plans, token2mel = [], [], flow.token2mel

    def recording_token2mel(*args, **kwargs):
        out = token2mel(*args, **kwargs)
        mels.append(out.mel)  # [1, 80, F]
        return out

    flow.token2mel = recording_token2mel
    empty = np.zeros(0, np.int64)
    request = conversion_request_class(family.request_class)(
        stages,
        model.config,
        [Segment("golden source", empty)],
        target,
        0,
        meta["stream"],
        tokens.size,
        LLMPrompt(empty, empty),
    )
    request.attach_source(lambda index: tokens, 1)
    request.speed = meta["speed"]
    if not family.fixed_flow_noise:  # CosyVoice 1: flow and HiFT draws
        request.draws = draws
    render = request._render

    def render_recorded(chunk_tokens, plan, state):
        plans.append(plan)
        if family.fixed_flow_noise and not family.fixed_hift_noise:  # CosyVoice2: HiFT noise
            request.vocoder_rng = draws.sine_noise(len(plans) - 1)
        return render(chunk_tokens, plan, state)

    request._render = render_recorded
    wav = np.concatenate([chunk.samples for chunk in request.chunks()])  # [N]
    given = [plan.end - plan.offset if family.name == "v1" else plan.end for plan in plans]
    ours_calls = np.array([[count, plan.final] for count, plan in zip(given, plans, strict=True)], np.int64)
    official_calls = np.array([[call["tokens"], call["finalize"]] for call in meta["calls"]], np.int64)
    rows = [compare(f"{VC_PREFIX}{run}_calls", ours_calls, official_calls, 0.0)]
    stride = golden.meta["mel_stride"]
    for index in range(len(meta["calls"])):
        key = f"{run}_c{index}_flow_mel"
        if key not in golden.arrays:  # a speed run: its flow runs as the nonstream one's, compared there
            continue
        ours = mels[index][:, :, ::stride] if index < len(mels) else np.zeros(0)
        rows.append(compare(VC_PREFIX + key, ours, golden[key], _TOLERANCES["flow_mel"]))
    official = golden[f"{run}_wav"].astype(np.float32) * np.float32(golden.meta["wav_scale"])
    ours = wav[:: meta["wav_stride"]] if wav.shape[0] == meta["samples"] else wav
    rows.append(compare(f"{VC_PREFIX}{run}_wav", ours, official, _TOLERANCES["wav"]))
    return rows
