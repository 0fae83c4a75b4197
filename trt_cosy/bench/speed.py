"""``trt-cosy bench``: per-stage timings of an engines directory on synthetic inputs (numpy only).

One run synthesises ``tokens`` speech tokens (250 = 10 s of audio) after a prefill of
``[sos, prompt text, text, task, prompt speech]`` (16 + 24 text tokens and a 2 s / 50-token prompt by
default: 92 positions, the scenario of the official figures in docs/benchmarks.md), then runs the flow
on prompt + tokens and HiFT on the resulting mel. The LLM sampler is greedy with the stop tokens
masked, so every run decodes exactly ``tokens`` tokens whatever the weights (random test models stop
at random places otherwise). After ``warmup`` runs, ``runs`` runs are timed; each figure is reported
as median, min and max.

``stream`` adds the time to first audio of the official CosyVoice2 streaming schedule (spec §6.1),
through the path ``CosyVoice.synthesize(..., SynthesisConfig(stream=True))`` takes (a
``pipeline.Request``: the LLM worker thread decoding beside the flow and the vocoder, with the same
policy for sharing the cores), for a voice of each of ``stream_references`` seconds (3, 5 and 10 s:
25 prompt speech tokens, 50 prompt mel frames and 8 prompt text tokens per second): from the start of
the request until its first chunk (prefill, ``25 + prompt_pad + 3`` tokens, a chunk-attention flow
call over prompt + those tokens, a non-final HiFT call). Each voice is timed twice: its first request
(``first_audio_new_voice_ref*``: the flow computes the voice's prompt prefix too) and a repeat
request (``first_audio_ref*``: the prefix comes from ``FlowStage.voice_prefixes``, as for every later
request of a known voice; engines without the incremental estimator recompute both times).
Cold start is a fresh ``python -m trt_cosy.bench.speed --ready`` process, from spawn until its engines
are loaded and its stages built.

Every measurement runs on one set of stages, the API's (``families.build_stages``: what
``CosyVoice``, ``trt-cosy say`` and ``serve`` hold; with the batched decode graph the LLM decodes in
the shared decode loop, which costs what the per-request graph does at batch 1), so the process holds
the sessions a user's process holds, once. The non-streaming runs (warm-up included) come first, then
the streaming rounds. ``peak_rss_gb`` is the process's peak resident set up to the end of the
non-streaming runs; ``peak_rss_stream_gb`` the peak during the streaming rounds (Linux: glibc's free
pages go back and the peak restarts from the resident set before each voice, ``rss_before_stream_gb``
at the first; elsewhere the process's peak), and ``stream_memory`` per reference length: the peak
(largest over the rounds; ONNX Runtime's arena growth of an earlier, longer voice stays resident), the
largest ``FlowCache.nbytes`` at a first chunk and ``VoicePrefixes.nbytes`` after the voice's two requests.

Never use these timings as test assertions: CI runs only a smoke run on the tiny model.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from ..errors import InputError
from ..families import build_stages, request_class
from ..frontend.voice import Voice
from ..runtime import heap
from ..runtime.cpu_budget import default_threads
from ..runtime.engines import TOKENIZER_DIR, load_engines
from ..runtime.manifest import Manifest
from ..runtime.model import LoadedModel
from ..stages.flow import FlowStage
from ..stages.llm import LLMStage
from ..stages.vocoder import VocoderStage
from . import process_memory
from .listening import BREAKDOWN_PARTS, Stalls, first_chunk_breakdown, playback_stalls

__all__ = ["BenchOptions", "run_bench", "format_bench", "main"]

_LOGGER = logging.getLogger(__name__)
_READY: Final = "ready"
_TOKEN_HOP: Final = 25  # official token_hop_len (spec §6.1)
_LOOKAHEAD: Final = 3
_TOKENS_PER_S: Final = 25  # speech tokens per second of audio

Progress = Callable[[str], None]


@dataclass(frozen=True)
class BenchOptions:
    """What ``run_bench`` measures."""

    tokens: int = 250
    """Speech tokens to decode per run (25 per second of audio)."""
    text: str | None = None
    """Text to tokenise with the engines' tokenizer instead of 24 random text tokens."""
    prompt_tokens: int = 50
    """Prompt speech tokens (2 s); the prompt mel has twice as many frames."""
    prompt_text_tokens: int = 16
    runs: int = 3
    warmup: int = 1
    stream: bool = False
    """Also measure the time to first audio of the streaming schedule."""
    stream_references: tuple[float, ...] = (3.0, 5.0, 10.0)
    """Reference recording lengths (seconds) of the voices the first audio is measured with."""
    listen_tokens: int = 375
    """Speech tokens of the streamed answer a real-time listener hears (375 = 15 s; 0: not measured)."""
    listen_reference: float = 5.0
    """Reference length (seconds) of the known voice that answer is spoken in."""
    cold_start: bool = True
    """Also time fresh processes from spawn to ready (one per run, at most 3)."""
    threads: int | None = None
    """Intra-op threads per session; None: physical cores."""
    seed: int = 0


@dataclass(frozen=True)
class _Inputs:
    text: np.ndarray  # [Nt]
    prompt_text: np.ndarray  # [Np]
    prompt_speech: np.ndarray  # [P]
    prompt_feat: np.ndarray  # [1, 2P, 80]
    embedding: np.ndarray  # [1, 192]


class _Stages:
    """The API's stages (``families.build_stages``, as ``CosyVoice`` holds them), timed one by one and
    through streaming requests: one set of sessions for every measurement, as in a user's process."""

    def __init__(self, model: LoadedModel):
        config = model.config
        self.config = config
        self.api = build_stages(model)  # the shared decode loop, the incremental flow, its voice prefixes
        if not hasattr(self.api, "flow"):
            raise InputError(
                f"trt-cosy bench times CosyVoice2/3 engines; {config.family} engines have no separate flow "
                "stage. Time them with `trt-cosy say` instead."
            )
        self.llm: LLMStage = self.api.llm
        self.flow: FlowStage = self.api.flow
        self.vocoder = self.api.vocoder  # VocoderStage (CosyVoice2) or V3VocoderStage
        self.sample_rate = config.sample_rate
        self.request_class = request_class(config.family)

    def render(self, mel: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """One-shot HiFT on ``mel`` [1, 80, F]: samples [1, 480 F] (CosyVoice3: the fixed NSF noise)."""
        if isinstance(self.vocoder, VocoderStage):
            return self.vocoder.render(mel, rng)
        return self.vocoder.render(mel)


def _no_stop_greedy(stop_tokens: Sequence[int]) -> Callable[[np.ndarray, Sequence[int]], int]:
    stops = np.asarray(sorted(stop_tokens), dtype=np.int64)

    def sample(logp: np.ndarray, decoded: Sequence[int]) -> int:
        masked = logp.copy()  # masked: [V]
        masked[stops[stops < masked.shape[0]]] = -np.inf
        return int(np.argmax(masked))

    return sample


def _inputs(model: LoadedModel, engines_dir: Path, options: BenchOptions) -> _Inputs:
    rng = np.random.default_rng(options.seed)
    config = model.config
    vocab = min(2048, config.llm.qwen.vocab_size)
    if options.text is not None:
        from ..families import load_text_tokenizer

        tokenizer = load_text_tokenizer(config.family, engines_dir / TOKENIZER_DIR)
        text = np.asarray(tokenizer.encode(options.text), np.int64)
    else:
        text = rng.integers(0, vocab, 24)
    feat = rng.normal(-5.0, 2.0, (1, 2 * options.prompt_tokens, config.flow.output_size))
    return _Inputs(
        text=text,
        prompt_text=rng.integers(0, vocab, options.prompt_text_tokens),
        prompt_speech=rng.integers(0, config.llm.speech_token_size, options.prompt_tokens),
        prompt_feat=feat.astype(np.float32),
        embedding=rng.standard_normal((1, config.flow.spk_embed_dim)).astype(np.float32),
    )


def _decode(stages: _Stages, inputs: _Inputs, tokens: int) -> tuple[np.ndarray, float, float]:
    """(tokens, prefill seconds (to the first token), total seconds)."""
    sampler = _no_stop_greedy(stages.llm.config.stop_tokens)
    start = time.perf_counter()
    stream = stages.llm.generate(inputs.text, inputs.prompt_text, inputs.prompt_speech, sampler, tokens)
    out, first = [], 0.0
    for token in stream:
        if not out:
            first = time.perf_counter() - start
        out.append(token)
    return np.asarray(out, np.int64), first, time.perf_counter() - start


def _one_run(
    stages: _Stages, inputs: _Inputs, options: BenchOptions, rng: np.random.Generator
) -> dict[str, float]:
    tokens, prefill, llm_s = _decode(stages, inputs, options.tokens)
    start = time.perf_counter()
    mel = stages.flow.token2mel(
        tokens[None],
        inputs.prompt_speech[None],
        inputs.prompt_feat,
        inputs.embedding,
        streaming=False,
        finalize=True,
    ).mel  # mel: [1, 80, 2n]
    flow_s = time.perf_counter() - start
    start = time.perf_counter()
    wav = stages.render(mel, rng)  # wav: [1, 480 * 2n]
    hift_s = time.perf_counter() - start
    audio_s = wav.shape[1] / stages.sample_rate
    decode_tokens = max(tokens.size - 1, 1)
    return {
        "tokens": float(tokens.size),
        "llm_prefill_s": prefill,
        "llm_decode_tokens_per_s": decode_tokens / max(llm_s - prefill, 1e-9),
        "llm_s": llm_s,
        "flow_s": flow_s,
        "hift_s": hift_s,
        "total_s": llm_s + flow_s + hift_s,
        "audio_s": audio_s,
        "rtf": (llm_s + flow_s + hift_s) / audio_s,
    }


def _stream_round(
    stages: _Stages, inputs: _Inputs, options: BenchOptions, memory: dict[str, dict[str, float]]
) -> dict[str, float]:
    """First audio of each reference voice: its first request, then a repeat. ``memory`` (per
    ``ref{s}s``) keeps the largest peak RSS, first-chunk flow cache and voice prefixes seen."""
    result = {}
    prefixes = stages.flow.voice_prefixes
    for seconds in options.stream_references:
        voice = _bench_voice(stages, inputs, seconds, options.seed)
        prefixes.clear()  # a voice's first request: it computes the voice's prompt prefix
        heap.release_free()  # the earlier voice's freed pages go back: this voice's peak starts from live memory
        process_memory.reset_peak_rss()
        first_new, cache_new, _ = _first_audio(stages, inputs, voice, options)
        first, cache, parts = _first_audio(stages, inputs, voice, options)
        result[f"first_audio_new_voice_ref{seconds:g}s"] = first_new
        result[f"first_audio_ref{seconds:g}s"] = first
        for part in BREAKDOWN_PARTS:  # the known voice's first chunk, part by part
            result[f"first_chunk_ref{seconds:g}s_{part}"] = parts[part]
        seen = {
            "peak_rss_gb": process_memory.peak_rss_gb(),
            "flow_cache_mib": max(cache_new, cache) / 2**20,
            "voice_prefixes_mib": prefixes.nbytes / 2**20,
        }
        entry = memory.setdefault(f"ref{seconds:g}s", {})
        for key, value in seen.items():
            entry[key] = max(entry.get(key, 0.0), value)
    if options.listen_tokens:
        voice = _bench_voice(stages, inputs, options.listen_reference, options.seed)
        _first_audio(stages, inputs, voice, options)  # the voice is known: its prefix is cached
        heard = _listen(stages, inputs, voice, options)
        name = f"listen_{options.listen_tokens / _TOKENS_PER_S:g}s_ref{options.listen_reference:g}s"
        result[f"{name}_first_audio_s"] = heard.first_audio_s
        result[f"{name}_stall_total_s"] = heard.total_s
        result[f"{name}_stall_longest_s"] = heard.longest_s
        result[f"{name}_stalls"] = float(heard.count)
    return result


def _bench_voice(stages: _Stages, inputs: _Inputs, seconds: float, seed: int) -> Voice:
    """A synthetic voice of a ``seconds``-long reference: 25 speech tokens, 50 mel frames, 8 text tokens a second."""
    rng = np.random.default_rng([seed, round(seconds * 1000)])
    config = stages.config
    tokens = max(1, round(seconds * 25))
    vocab = min(2048, config.llm.qwen.vocab_size)
    return Voice(
        prompt_text="synthetic",
        prompt_text_ids=rng.integers(0, vocab, max(1, round(seconds * 8))),
        speech_tokens=rng.integers(0, config.llm.speech_token_size, tokens),
        prompt_mel=rng.normal(-5.0, 2.0, (config.token_mel_ratio * tokens, config.flow.output_size)),
        speaker_embedding=inputs.embedding[0],
        sample_rate=config.sample_rate,
    )


def _streaming_request(stages: _Stages, inputs: _Inputs, voice: Voice, options: BenchOptions, tokens: int):
    """A streaming request of the API's path (spec §6.1) that decodes exactly ``tokens`` speech tokens."""
    from ..synthesis import Segment

    request = stages.request_class(
        stages.api, stages.config, [Segment("bench", inputs.text)], voice, options.seed, True, tokens
    )
    request.sampler = _no_stop_greedy(stages.llm.config.stop_tokens)  # every run decodes as many tokens
    return request


def _first_audio(
    stages: _Stages, inputs: _Inputs, voice: Voice, options: BenchOptions
) -> tuple[float, int, dict[str, float]]:
    """(seconds from the start of a streaming request to its first chunk (the API's path, spec §6.1),
    bytes of the segment's ``FlowCache`` then (0 without the incremental flow), that time part by part
    (``listening.first_chunk_breakdown``))."""
    request = _streaming_request(stages, inputs, voice, options, options.tokens)
    start = time.perf_counter()
    chunks = request.chunks()
    try:
        first = next(chunks)
        elapsed = time.perf_counter() - start
        cache = request.flow_cache
        cache_bytes = 0 if cache is None else cache.nbytes
        token_times = request.feed.token_times(0)
    finally:
        chunks.close()
    if first.samples.size == 0 or not token_times:
        raise InputError("the first streaming chunk produced no audio; use a longer --tokens.")
    began = start + elapsed - first.timings["elapsed_s"]  # the request's own clock started here
    parts = first_chunk_breakdown(token_times[0] - began, first.timings, first.timings["elapsed_s"])
    return elapsed, cache_bytes, parts


def _listen(stages: _Stages, inputs: _Inputs, voice: Voice, options: BenchOptions) -> Stalls:
    """A whole streamed answer of ``options.listen_tokens`` tokens as a real-time player hears it."""
    request = _streaming_request(stages, inputs, voice, options, options.listen_tokens)
    arrivals, durations = [], []
    start = time.perf_counter()
    for chunk in request.chunks():
        arrivals.append(time.perf_counter() - start)
        durations.append(chunk.samples.shape[0] / chunk.sample_rate)
    return playback_stalls(arrivals, durations)


def _summary(values: Sequence[float]) -> dict[str, float]:
    array = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(array)), "min": float(array.min()), "max": float(array.max())}


def _cold_start(engines_dir: Path, threads: int | None) -> dict[str, float]:
    """Spawn ``python -m trt_cosy.bench.speed --ready``; seconds until it reports ready, and its RSS."""
    command = [sys.executable, "-m", "trt_cosy.bench.speed", "--ready", str(engines_dir)]
    if threads is not None:
        command += ["--threads", str(threads)]
    start = time.perf_counter()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        line = child.stdout.readline()
        elapsed = time.perf_counter() - start
        _, stderr = child.communicate()
    if not line.startswith(_READY):
        raise InputError(f"the cold-start process failed: {stderr.strip()[-500:]}")
    return {"seconds": elapsed, "rss_gb": float(line.split()[1])}


def run_bench(
    engines_dir: Path, options: BenchOptions | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Benchmark an engines directory; returns a JSON-ready dict (see the module docstring)."""
    options = options or BenchOptions()
    if options.tokens < _TOKEN_HOP + _LOOKAHEAD + 1 or options.runs < 1 or options.warmup < 0:
        raise InputError(f"--tokens must be >= {_TOKEN_HOP + _LOOKAHEAD + 1}, --runs >= 1 and --warmup >= 0.")
    emit = progress or (lambda message: None)
    engines_dir = Path(engines_dir)
    manifest = Manifest.read(engines_dir)
    start = time.perf_counter()
    model = load_engines(engines_dir, threads=options.threads, backend="auto")
    stages = _Stages(model)
    load_s = time.perf_counter() - start
    inputs = _inputs(model, engines_dir, options)
    rng = np.random.default_rng(options.seed)
    runs = []
    for index in range(options.warmup + options.runs):
        result = _one_run(stages, inputs, options, rng)
        emit(f"{_label(index, options)}: " + ", ".join(f"{key} {value:.3g}" for key, value in result.items()))
        if index >= options.warmup:
            runs.append(result)
    peak_rss = process_memory.peak_rss_gb()
    stream_report: dict[str, Any] = {}
    if options.stream:
        heap.release_free()
        stream_report["rss_before_stream_gb"] = process_memory.rss_gb()
        restarted = process_memory.reset_peak_rss()
        memory: dict[str, dict[str, float]] = {}
        for index in range(options.warmup + options.runs):
            result = _stream_round(stages, inputs, options, memory)
            emit(
                f"streaming {_label(index, options)}: "
                + ", ".join(f"{key} {value:.3g}" for key, value in result.items())
            )
            if index >= options.warmup:
                runs[index - options.warmup].update(result)
        stream_report["peak_rss_stream_gb"] = max(entry["peak_rss_gb"] for entry in memory.values())
        stream_report["peak_rss_stream_scope"] = "streaming rounds" if restarted else "whole process"
        stream_report["stream_memory"] = memory
    report = {
        "engines": str(engines_dir),
        "precision": manifest.precision,
        "backend": manifest.backend,
        "options": asdict(options),
        "threads": options.threads or default_threads(),
        "machine": _machine(),
        "tuned": None if manifest.tuning is None else f"{manifest.tuning.summary()} (tuned on {manifest.tuning.cpu})",
        "prefill_positions": int(2 + inputs.prompt_text.size + inputs.text.size + inputs.prompt_speech.size),
        "load_in_process_s": load_s,
        "metrics": {key: _summary([run[key] for run in runs]) for key in runs[0]},
        "runs": runs,
        "peak_rss_gb": peak_rss,
        **stream_report,
    }
    if options.cold_start:
        cold = [_cold_start(engines_dir, options.threads) for _ in range(min(options.runs, 3))]
        report["cold_start_s"] = _summary([item["seconds"] for item in cold])
        report["cold_start_rss_gb"] = _summary([item["rss_gb"] for item in cold])
        emit(f"cold start: {report['cold_start_s']['median']:.2f} s")
    report["streaming"] = (
        "measured (official schedule, through a streaming request, LLM worker beside the flow)"
        if options.stream
        else "not measured"
    )
    return report


def _label(index: int, options: BenchOptions) -> str:
    return "warm-up" if index < options.warmup else f"run {index - options.warmup + 1}/{options.runs}"


def _machine() -> dict[str, Any]:
    import os
    import platform

    import onnxruntime

    from ..runtime.native_guard import machine

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    here = machine()  # the model name and ISA flags that decide the kernels (and a tuned build's choice)
    return {
        "gemm_gflops": _gemm_gflops(),
        "cpu": here.cpu or platform.processor() or platform.machine(),
        "isa_flags": list(here.flags),
        "logical_cpus": os.cpu_count(),
        "onnxruntime": onnxruntime.__version__,
        "load_average_1_5_15": [round(value, 2) for value in load],
    }


def _gemm_gflops(size: int = 1024, repeats: int = 5) -> float:
    """numpy fp32 GEMM rate (best of ``repeats``): a load indicator on a shared machine."""
    a = np.random.default_rng(0).standard_normal((size, size), dtype=np.float32)  # a: [n, n]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def format_bench(report: dict[str, Any]) -> str:
    """A plain-text table of the medians and spreads of ``run_bench``'s report."""
    machine = report["machine"]
    lines = [
        f"cpu {machine['cpu']}, {machine['logical_cpus']} logical CPUs, {report['threads']} threads; flags "
        f"{' '.join(machine.get('isa_flags', [])) or 'not read'}",
        *([f"engines chosen per stage: {report['tuned']}"] if report.get("tuned") else []),
        f"engines {report['engines']} ({report['backend']}/{report['precision']}), {report['threads']} threads, "
        f"load average {report['machine']['load_average_1_5_15']}, numpy GEMM "
        f"{report['machine']['gemm_gflops']:.0f} GFLOP/s",
        f"{'metric':36s} {'median':>10s} {'min':>10s} {'max':>10s}",
    ]
    for key, stats in report["metrics"].items():
        lines.append(f"{key:36s} {stats['median']:10.3f} {stats['min']:10.3f} {stats['max']:10.3f}")
    if "cold_start_s" in report:
        stats = report["cold_start_s"]
        lines.append(
            f"{'cold_start_s':36s} {stats['median']:10.3f} {stats['min']:10.3f} {stats['max']:10.3f}"
        )
    lines.append(f"{'peak_rss_gb':36s} {report['peak_rss_gb']:10.3f}   (load and non-streaming runs)")
    if "peak_rss_stream_gb" in report:
        lines.append(
            f"{'peak_rss_stream_gb':36s} {report['peak_rss_stream_gb']:10.3f}   "
            f"({report['peak_rss_stream_scope']}; {report['rss_before_stream_gb']:.3f} GB resident before them)"
        )
        for name, entry in report["stream_memory"].items():
            lines.append(
                f"  {name}: peak {entry['peak_rss_gb']:.3f} GB, flow cache at the first chunk "
                f"{entry['flow_cache_mib']:.0f} MiB, voice prefixes {entry['voice_prefixes_mib']:.0f} MiB"
            )
    lines.append(f"streaming: {report['streaming']}")
    return "\n".join(lines)


def _ready(engines_dir: Path, threads: int | None) -> None:
    """The cold-start child: load, build the stages, report ready with the RSS in GB."""
    _Stages(load_engines(engines_dir, threads=threads, backend="auto"))
    print(f"{_READY} {process_memory.peak_rss_gb():.3f}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trt_cosy.bench.speed ENGINES [--tokens N] [--runs N] [--stream] [--json OUT]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", type=Path)
    parser.add_argument("--ready", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=250)
    parser.add_argument("--text", default=None)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--listen-seconds", type=float, default=15.0)
    parser.add_argument("--no-cold-start", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.ready:
        _ready(args.engines, args.threads)
        return 0
    options = BenchOptions(
        tokens=args.tokens,
        text=args.text,
        runs=args.runs,
        warmup=args.warmup,
        stream=args.stream,
        listen_tokens=round(args.listen_seconds * _TOKENS_PER_S),
        cold_start=not args.no_cold_start,
        threads=args.threads,
    )
    report = run_bench(args.engines, options, progress=lambda message: print(message, file=sys.stderr))
    print(format_bench(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
