"""Time to first audio and RTF, streaming vs non-streaming, on an engines directory.

    python bench/stream_bench.py --engines /tmp/perf-full/fp32 --threads 1 --runs 2

Builds a zero-shot voice from the first ``--ref-seconds`` (3) s of
tests/data/features/audio/en_16k_mono.wav and synthesises ``--text`` through the Python API
(``CosyVoice.synthesize``: the LLM worker decoding beside the flow) in three modes that alternate in
each of ``--runs`` rounds, same seed, after one warm-up of each: non-streaming, streaming on the
official schedule (``SynthesisConfig(stream=True)``) and on trt-cosy's cheaper ``fast`` schedule
(``SynthesisConfig(stream=True, stream_schedule="fast")``); ``--modes`` picks some of them. Printed per
mode, medians: time to first audio, total time and its ratio to the non-streaming total, audio
seconds, RTF (total / audio); the peak resident set of a request (VmHWM restarted before it, Linux)
against the resident set before it, the largest ``FlowCache.nbytes`` of a segment and
``VoicePrefixes.nbytes`` after it; and per chunk of the last run the tokens and flow / vocoder /
LLM-wait seconds.

``--incremental-ab`` (engines with ``flow_estimator_incremental.onnx``): three modes alternate in
each round, non-streaming, streaming with the incremental flow (``stages.flow_incremental``) and
streaming with the recomputation it replaces, and the largest flow cache of a segment is printed:

    python bench/stream_bench.py --engines DIR --threads 2 --runs 2 --ref-seconds 5 --incremental-ab \
        --text "..."
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import soundfile

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig
from trt_cosy.bench import process_memory
from trt_cosy.runtime import heap
from trt_cosy.stages.flow_incremental import FlowCache
from trt_cosy.streaming import FAST_SCHEDULE, OFFICIAL_SCHEDULE

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
REFERENCE_TEXT = "The quick brown fox jumps over the lazy dog."
TEXT = "Hello there, hello there."  # 9 text tokens -> 180 speech tokens (7.2 s) on a random model
MODES = {
    "non-stream": SynthesisConfig(stream=False, text_frontend=False),
    "stream-official": SynthesisConfig(stream=True, stream_schedule=OFFICIAL_SCHEDULE, text_frontend=False),
    "stream-fast": SynthesisConfig(stream=True, stream_schedule=FAST_SCHEDULE, text_frontend=False),
}


class _CacheWatch:
    """The largest ``FlowCache.nbytes`` any segment held since ``reset`` (read after each chunk's mel)."""

    def __init__(self):
        self.bytes = self.frames = 0
        finish = FlowCache.finish

        def tracked(cache: FlowCache, mel):
            whole = finish(cache, mel)
            self.bytes, self.frames = max(self.bytes, cache.nbytes), max(self.frames, cache.frames)
            return whole

        FlowCache.finish = tracked

    def reset(self) -> None:
        self.bytes = self.frames = 0


def _voice(tts: CosyVoice, seconds: float):
    speech, rate = soundfile.read(REFERENCE, dtype="float32")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ref.wav"
        soundfile.write(path, speech[: int(seconds * rate)], rate)
        return tts.voice_from_wav(path, REFERENCE_TEXT)


def _run(tts: CosyVoice, voice, text: str, config: SynthesisConfig, seed: int, watch: _CacheWatch) -> dict:
    heap.release_free()  # freed pages of the earlier runs go back: the request's peak starts from live memory
    rss_before = process_memory.rss_gb()
    process_memory.reset_peak_rss()  # the peak restarts from the current RSS: the request's own peak
    watch.reset()
    started = time.perf_counter()
    first = None
    chunks = []
    for chunk in tts.synthesize(text, voice, seed=seed, config=config):
        if first is None:
            first = time.perf_counter() - started
        chunks.append({key: round(float(value), 4) for key, value in chunk.timings.items()})
    total = time.perf_counter() - started
    audio = sum(chunk["audio_s"] for chunk in chunks)
    return {
        "ttfa_s": first,
        "total_s": total,
        "audio_s": audio,
        "rtf": total / audio,
        "flow_s": sum(chunk["flow_s"] for chunk in chunks),
        "rss_before_gb": rss_before,
        "peak_rss_gb": process_memory.peak_rss_gb(),
        "flow_cache_mib": watch.bytes / 2**20,
        "flow_cache_frames": watch.frames,
        "voice_prefixes_mib": tts._stages.flow.voice_prefixes.nbytes / 2**20,
        "chunks": chunks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--ref-seconds", type=float, default=3.0)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--json", type=Path, default=None, help="Also write all runs here.")
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"Comma-separated modes to alternate (default: all of {', '.join(MODES)}).",
    )
    parser.add_argument(
        "--incremental-ab",
        action="store_true",
        help="Alternate non-streaming, streaming (incremental flow) and streaming (recomputed flow) per round.",
    )
    args = parser.parse_args()
    if args.incremental_ab:
        _incremental_ab(args)
        return

    modes = [name.strip() for name in args.modes.split(",") if name.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        parser.error(f"--modes takes some of {', '.join(MODES)}; got {args.modes!r}")
    watch = _CacheWatch()
    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=args.threads, normalizer="none"))
    voice = _voice(tts, args.ref_seconds)
    text_tokens = len(tts.tokenizer.encode(args.text))
    print(
        f"prompt {voice.speech_tokens.shape[0]} speech tokens, text {text_tokens} tokens, threads {args.threads}"
    )
    for name in modes:
        _run(tts, voice, "Warm up.", MODES[name], seed=0, watch=watch)
    results: dict[str, list[dict]] = {name: [] for name in modes}
    for round_index in range(args.runs):
        for name in modes:
            run = _run(tts, voice, args.text, MODES[name], seed=1, watch=watch)
            results[name].append(run)
            print(
                f"  round {round_index + 1} {name}: first audio {run['ttfa_s']:.2f} s, "
                f"total {run['total_s']:.2f} s, flow {run['flow_s']:.2f} s, peak RSS {run['peak_rss_gb']:.3f} GB",
                flush=True,
            )
    _report(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")


def _report(results: dict[str, list[dict]]) -> None:
    """Print each mode's medians (against non-streaming, when measured) and the chunks of its last run.

    The ratio is of the median totals; ``per round`` is the median of each round's ratio to that round's
    non-streaming total (the modes alternate, so a round shares the machine's load)."""
    base_runs = results.get("non-stream")
    base = statistics.median(run["total_s"] for run in base_runs) if base_runs else None
    for name, runs in results.items():
        keys = ("ttfa_s", "total_s", "audio_s") + (("flow_s",) if "flow_s" in runs[0] else ())
        median = {key: statistics.median(run[key] for run in runs) for key in keys}
        flow = f", flow {median['flow_s']:.2f} s" if "flow_s" in median else ""
        ratio = ""
        if base is not None:
            per_round = statistics.median(
                run["total_s"] / other["total_s"] for run, other in zip(runs, base_runs, strict=True)
            )
            ratio = f" ({median['total_s'] / base:.2f}x non-stream, per round {per_round:.2f}x)"
        print(
            f"{name:>18}: first audio {median['ttfa_s']:.2f} s, total {median['total_s']:.2f} s"
            f"{ratio}{flow}, audio {median['audio_s']:.2f} s, RTF {median['total_s'] / median['audio_s']:.2f}"
        )
        if "peak_rss_gb" in runs[0]:
            memory = {
                key: statistics.median(run[key] for run in runs)
                for key in ("rss_before_gb", "peak_rss_gb", "flow_cache_mib", "voice_prefixes_mib")
            }
            frames = max(run["flow_cache_frames"] for run in runs)
            added = memory["peak_rss_gb"] - memory["rss_before_gb"]
            print(
                f"{'':>20}peak RSS {memory['peak_rss_gb']:.3f} GB (+{added:.3f} over "
                f"{memory['rss_before_gb']:.3f} before the request), largest flow cache "
                f"{memory['flow_cache_mib']:.0f} MiB ({frames} frames), "
                f"voice prefixes {memory['voice_prefixes_mib']:.0f} MiB"
            )
        for index, chunk in enumerate(runs[-1]["chunks"]):
            print(
                f"{'':>20}chunk {index}: {chunk['tokens']:.0f} tokens, llm wait {chunk['llm_wait_s']:.2f} s, "
                f"flow {chunk['flow_s']:.2f} s, vocoder {chunk['vocoder_s']:.2f} s"
            )


def _incremental_ab(args: argparse.Namespace) -> None:
    watch = _CacheWatch()
    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=args.threads, normalizer="none"))
    voice = _voice(tts, args.ref_seconds)
    flow = tts._stages.flow
    incremental = flow.incremental_runner
    if incremental is None:
        raise SystemExit(f"{args.engines} has no flow_estimator_incremental graph")
    print(
        f"prompt {voice.speech_tokens.shape[0]} speech tokens, text {len(tts.tokenizer.encode(args.text))} "
        f"tokens, threads {args.threads}"
    )
    official = MODES["stream-official"]
    _run(tts, voice, "Warm up.", official, seed=0, watch=watch)
    flow.incremental_runner = None
    _run(tts, voice, "Warm up.", official, seed=0, watch=watch)
    modes = {
        "non-stream": (MODES["non-stream"], None),
        "stream-incremental": (official, incremental),
        "stream-recompute": (official, None),
    }
    results: dict[str, list[dict]] = {name: [] for name in modes}
    largest = {"bytes": 0, "frames": 0}
    for _ in range(args.runs):
        for name, (config, runner) in modes.items():
            flow.incremental_runner = runner
            run = _run(tts, voice, args.text, config, seed=1, watch=watch)
            largest["bytes"] = max(largest["bytes"], watch.bytes)
            largest["frames"] = max(largest["frames"], watch.frames)
            results[name].append(run)
            print(
                f"  {name}: first audio {run['ttfa_s']:.2f} s, total {run['total_s']:.2f} s, flow {run['flow_s']:.2f} s",
                flush=True,
            )
    _report(results)
    print(
        f"largest flow cache of a segment: {largest['bytes'] / 2**20:.0f} MiB for {largest['frames']} mel frames"
    )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
