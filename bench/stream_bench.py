"""Time to first audio and RTF, streaming vs non-streaming, on an engines directory.

    python bench/stream_bench.py --engines /tmp/perf-full/fp32 --threads 1 --runs 2

Builds a zero-shot voice from the first 3 s of tests/data/features/audio/en_16k_mono.wav, warms up
once, then runs each mode ``--runs`` times with the same seed and prints the median of: time to
first audio, total time, audio seconds, RTF (total / audio), and per chunk the tokens and flow /
vocoder / LLM-wait seconds (the flow cost per chunk grows with the tokens so far: it re-encodes
prompt + all tokens at every hop, as the official code does).

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

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
REFERENCE_TEXT = "The quick brown fox jumps over the lazy dog."
TEXT = "Hello there, hello there."  # 9 text tokens -> 180 speech tokens (7.2 s) on a random model


def _voice(tts: CosyVoice, seconds: float):
    speech, rate = soundfile.read(REFERENCE, dtype="float32")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ref.wav"
        soundfile.write(path, speech[: int(seconds * rate)], rate)
        return tts.voice_from_wav(path, REFERENCE_TEXT)


def _run(tts: CosyVoice, voice, text: str, stream: bool, seed: int) -> dict:
    config = SynthesisConfig(stream=stream, text_frontend=False)
    started = time.perf_counter()
    first = None
    chunks = []
    for chunk in tts.synthesize(text, voice, seed=seed, config=config):
        if first is None:
            first = time.perf_counter() - started
        chunks.append({key: round(float(value), 4) for key, value in chunk.timings.items()})
    total = time.perf_counter() - started
    audio = sum(chunk["audio_s"] for chunk in chunks)
    return {"ttfa_s": first, "total_s": total, "audio_s": audio, "rtf": total / audio, "chunks": chunks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--ref-seconds", type=float, default=3.0)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--json", type=Path, default=None, help="Also write all runs here.")
    parser.add_argument(
        "--incremental-ab",
        action="store_true",
        help="Alternate non-streaming, streaming (incremental flow) and streaming (recomputed flow) per round.",
    )
    args = parser.parse_args()
    if args.incremental_ab:
        _incremental_ab(args)
        return

    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=args.threads, normalizer="none"))
    voice = _voice(tts, args.ref_seconds)
    text_tokens = len(tts.tokenizer.encode(args.text))
    print(
        f"prompt {voice.speech_tokens.shape[0]} speech tokens, text {text_tokens} tokens, threads {args.threads}"
    )
    _run(tts, voice, "Warm up.", stream=True, seed=0)
    results = {}
    for stream in (False, True):
        results["stream" if stream else "non-stream"] = [
            _run(tts, voice, args.text, stream, seed=1) for _ in range(args.runs)
        ]
    _report(results)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")


def _report(results: dict[str, list[dict]]) -> None:
    """Print each mode's medians (against non-streaming) and the chunks of its last run."""
    base = statistics.median(run["total_s"] for run in results["non-stream"])
    for name, runs in results.items():
        keys = ("ttfa_s", "total_s", "audio_s") + (("flow_s",) if "flow_s" in runs[0] else ())
        median = {key: statistics.median(run[key] for run in runs) for key in keys}
        flow = f", flow {median['flow_s']:.2f} s" if "flow_s" in median else ""
        print(
            f"{name:>18}: first audio {median['ttfa_s']:.2f} s, total {median['total_s']:.2f} s "
            f"({median['total_s'] / base:.2f}x non-stream){flow}, audio {median['audio_s']:.2f} s, "
            f"RTF {median['total_s'] / median['audio_s']:.2f}"
        )
        for index, chunk in enumerate(runs[-1]["chunks"]):
            print(
                f"{'':>20}chunk {index}: {chunk['tokens']:.0f} tokens, llm wait {chunk['llm_wait_s']:.2f} s, "
                f"flow {chunk['flow_s']:.2f} s, vocoder {chunk['vocoder_s']:.2f} s"
            )


def _incremental_ab(args: argparse.Namespace) -> None:
    from trt_cosy.stages.flow_incremental import FlowCache

    peak = {"bytes": 0, "frames": 0}
    finish = FlowCache.finish

    def tracked(cache: FlowCache, mel):  # the largest cache any segment held (read after each chunk)
        whole = finish(cache, mel)
        peak["bytes"], peak["frames"] = max(peak["bytes"], cache.nbytes), max(peak["frames"], cache.frames)
        return whole

    FlowCache.finish = tracked
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
    _run(tts, voice, "Warm up.", stream=True, seed=0)
    flow.incremental_runner = None
    _run(tts, voice, "Warm up.", stream=True, seed=0)
    modes = {
        "non-stream": (False, None),
        "stream-incremental": (True, incremental),
        "stream-recompute": (True, None),
    }
    results: dict[str, list[dict]] = {name: [] for name in modes}
    for _ in range(args.runs):
        for name, (stream, runner) in modes.items():
            flow.incremental_runner = runner
            run = _run(tts, voice, args.text, stream, seed=1)
            run["flow_s"] = sum(chunk["flow_s"] for chunk in run["chunks"])
            results[name].append(run)
            print(
                f"  {name}: first audio {run['ttfa_s']:.2f} s, total {run['total_s']:.2f} s, flow {run['flow_s']:.2f} s",
                flush=True,
            )
    _report(results)
    print(f"largest flow cache of a segment: {peak['bytes'] / 2**20:.0f} MiB for {peak['frames']} mel frames")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
