"""``trt-cosy bench --concurrency N``: N requests submitted together through one ``CosyVoice``.

Each round starts N threads at a barrier; each streams one request (the official streaming
schedule) of the same text in the same synthetic voice (random prompt tokens, mel and speaker
embedding: no frontend models needed) with its own seed. Per level of concurrency it reports

* per-request medians: seconds to the last chunk, speech tokens, RTF;
* aggregate decode tokens/s: all speech tokens of the round over the seconds until the last
  request's LLM finished, counting each request's LLM seconds (which leave out the time its own
  first chunk held it); and "over wall s": over the wall seconds from the start of the round until
  the last token arrived (nothing left out);
* audio seconds produced per wall second of the round;
* p50 / p95 time to first audio over every request of every round.

``compare_unbatched`` runs each round a second time on a ``CosyVoice`` that decodes every request
alone (``EngineConfig.llm_slots=0``), alternating the two so machine noise hits both alike.
The random-weight test checkpoints rarely sample the end token, so each request decodes close to
its ``max_len`` (20 speech tokens per text token).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..frontend.voice import Voice
from ..synthesis import AudioChunk, EngineConfig, SynthesisConfig

__all__ = ["ConcurrencyOptions", "run_concurrency_bench", "format_concurrency"]

_LOGGER = logging.getLogger(__name__)
_POLL_S = 0.005  # how often a round looks for finished LLMs
_DEFAULT_TEXT = "See you soon."  # 8 tokens with the test tokenizer: up to 160 speech tokens (6.4 s)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class ConcurrencyOptions:
    levels: tuple[int, ...] = (1, 4)
    """Concurrency levels, each run ``runs`` rounds (in order, after one warm-up round each)."""
    text: str = _DEFAULT_TEXT
    prompt_tokens: int = 50
    prompt_text_tokens: int = 16
    runs: int = 3
    warmup: int = 1
    threads: int | None = None
    compare_unbatched: bool = False
    seed: int = 0


def _synthetic_voice(tts: Any, options: ConcurrencyOptions) -> Voice:
    config = tts.model.config
    rng = np.random.default_rng(options.seed)
    tokens = options.prompt_tokens
    return Voice(
        prompt_text="synthetic",
        prompt_text_ids=rng.integers(0, min(2048, config.llm.qwen.vocab_size), options.prompt_text_tokens),
        speech_tokens=rng.integers(0, config.llm.speech_token_size, tokens),
        prompt_mel=rng.normal(-5.0, 2.0, (config.token_mel_ratio * tokens, config.flow.output_size)),
        speaker_embedding=rng.standard_normal(config.flow.spk_embed_dim),
        sample_rate=config.sample_rate,
        model_id=tts.model_id,
    )


def _one_request(chunks: Iterator[AudioChunk], barrier: threading.Barrier) -> dict[str, float]:
    barrier.wait()
    start = time.perf_counter()
    first, tokens, audio, llm_s = None, 0.0, 0.0, 0.0
    for chunk in chunks:
        if first is None:
            first = time.perf_counter() - start
        tokens += chunk.timings["tokens"]
        audio += chunk.timings["audio_s"]
        llm_s = chunk.timings["llm_s"]
    total = time.perf_counter() - start
    return {
        "start": start,
        "total_s": total,
        "first_audio_s": first if first is not None else total,
        "tokens": tokens,
        "audio_s": audio,
        "llm_s": llm_s,
        "rtf": total / audio if audio > 0 else float("inf"),
    }


def _round(tts: Any, voice: Voice, text: str, concurrency: int, seed: int) -> dict[str, Any]:
    barrier = threading.Barrier(concurrency + 1)
    config = SynthesisConfig(stream=True, text_frontend=False)
    iterators = [tts.synthesize(text, voice, seed=seed + i, config=config) for i in range(concurrency)]
    feeds = [getattr(getattr(it, "request", None), "feed", None) for it in iterators]
    results: list[dict[str, float] | None] = [None] * concurrency
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            results[index] = _one_request(iterators[index], barrier)
        except BaseException as exc:  # reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,), name=f"bench-{i}") for i in range(concurrency)]
    for thread in threads:
        thread.start()
    try:
        barrier.wait()
    except threading.BrokenBarrierError:
        pass
    start_wall = time.perf_counter()
    llm_done: list[float | None] = [None] * concurrency  # when each request's last token arrived
    while any(thread.is_alive() for thread in threads):
        now = time.perf_counter()
        for index, feed in enumerate(feeds):
            if llm_done[index] is None and feed is not None and feed.finished_all:
                llm_done[index] = now - start_wall
        time.sleep(_POLL_S)
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    requests = [r for r in results if r is not None]
    start = min(r["start"] for r in requests)
    wall = max(r["start"] + r["total_s"] for r in requests) - start
    llm_end = max(r["start"] + r["llm_s"] for r in requests) - start
    tokens = sum(r["tokens"] for r in requests)
    last_token = max((t for t in llm_done if t is not None), default=0.0)
    return {
        "wall_s": wall,
        "decode_tokens_per_s": tokens / llm_end if llm_end > 0 else 0.0,
        "decode_tokens_per_wall_s": tokens / last_token if last_token > 0 else 0.0,
        "audio_s_per_wall_s": sum(r["audio_s"] for r in requests) / wall,
        "requests": [{k: v for k, v in r.items() if k != "start"} for r in requests],
    }


def _level_summary(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    requests = [r for rnd in rounds for r in rnd["requests"]]
    first = np.asarray([r["first_audio_s"] for r in requests])
    return {
        "per_request_median": {
            key: float(np.median([r[key] for r in requests])) for key in ("total_s", "tokens", "rtf", "audio_s")
        },
        "aggregate_decode_tokens_per_s": float(np.median([rnd["decode_tokens_per_s"] for rnd in rounds])),
        "aggregate_decode_tokens_per_wall_s": float(np.median([rnd["decode_tokens_per_wall_s"] for rnd in rounds])),
        "audio_s_per_wall_s": float(np.median([rnd["audio_s_per_wall_s"] for rnd in rounds])),
        "first_audio_p50_s": float(np.percentile(first, 50)),
        "first_audio_p95_s": float(np.percentile(first, 95)),
        "rounds": list(rounds),
    }


def run_concurrency_bench(
    engines_dir: Path, options: ConcurrencyOptions | None = None, progress: Progress | None = None
) -> dict[str, Any]:
    """Measure ``options.levels`` of concurrency on ``engines_dir``; a JSON-ready dict."""
    from ..tts import CosyVoice

    options = options or ConcurrencyOptions()
    if not options.levels or min(options.levels) < 1 or options.runs < 1 or options.warmup < 0:
        raise InputError("--concurrency levels must be >= 1, --runs >= 1 and --warmup >= 0.")
    emit = progress or (lambda message: None)
    slots = max(options.levels)
    variants = {"batched": EngineConfig(threads=options.threads, llm_slots=slots)}
    if options.compare_unbatched:
        variants["unbatched"] = EngineConfig(threads=options.threads, llm_slots=0)
    engines = {name: CosyVoice.load(engines_dir, config=config) for name, config in variants.items()}
    batching = {name: type(tts._stages.llm).__name__ for name, tts in engines.items()}
    voice = _synthetic_voice(engines["batched"], options)
    report: dict[str, Any] = {
        "engines": str(engines_dir),
        "options": asdict(options),
        "llm_stage": batching,
        "text_tokens": len(engines["batched"].tokenizer.encode(options.text)),
        "levels": {},
    }
    for level in options.levels:
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in engines}
        for index in range(options.warmup + options.runs):
            for name, tts in engines.items():  # alternating: the same machine noise for both
                result = _round(tts, voice, options.text, level, options.seed + 100 * index)
                label = "warm-up" if index < options.warmup else f"run {index - options.warmup + 1}"
                emit(
                    f"c={level} {name} {label}: {result['decode_tokens_per_s']:.1f} decode tok/s "
                    f"({result['decode_tokens_per_wall_s']:.1f} over wall s), "
                    f"{result['audio_s_per_wall_s']:.2f} audio s/s, wall {result['wall_s']:.2f} s"
                )
                if index >= options.warmup:
                    rounds[name].append(result)
        report["levels"][str(level)] = {name: _level_summary(r) for name, r in rounds.items()}
    for name, tts in engines.items():
        scheduler = getattr(tts._stages.llm, "scheduler", None)
        if scheduler is not None:
            stats = scheduler.stats
            report.setdefault("scheduler", {})[name] = {
                "steps": stats.steps,
                "row_steps": stats.row_steps,
                "busy_s": stats.busy_s,
                "held_s": stats.held_s,
                "batch_sizes": {str(k): v for k, v in sorted(stats.batch_sizes.items())},
            }
    return report


def format_concurrency(report: dict[str, Any]) -> str:
    lines = [
        f"engines {report['engines']}, text of {report['text_tokens']} tokens, LLM stage {report['llm_stage']}",
        f"{'c':>3s} {'variant':10s} {'decode tok/s':>13s} {'(wall)':>7s} {'audio s/s':>10s} {'TTFA p50':>9s} {'TTFA p95':>9s} "
        f"{'req total':>10s} {'req tokens':>10s} {'req RTF':>8s}",
    ]
    for level, variants in report["levels"].items():
        for name, summary in variants.items():
            per = summary["per_request_median"]
            lines.append(
                f"{level:>3s} {name:10s} {summary['aggregate_decode_tokens_per_s']:13.1f} "
                f"{summary['aggregate_decode_tokens_per_wall_s']:7.1f} "
                f"{summary['audio_s_per_wall_s']:10.2f} {summary['first_audio_p50_s']:9.3f} "
                f"{summary['first_audio_p95_s']:9.3f} {per['total_s']:10.2f} {per['tokens']:10.0f} {per['rtf']:8.3f}"
            )
    return "\n".join(lines)
