"""Memory under load: peak RSS of one vs N concurrent long requests, RSS after the burst, and the
speed cost of ONNX Runtime's arena shrinkage (A/B, alternating, one process).

    python tools/experiments/memory/memory_load.py --engines /tmp/tiny-engines
    python tools/experiments/memory/memory_load.py --engines /tmp/perf-full/int4 --concurrency 8

The text is one sentence of ``--words`` words: one segment, as long as the sentence splitter makes
them, so the flow and the vocoder run on the longest shapes a request reaches (a longer text only
adds segments of the same size). Peaks are VmHWM (reset through /proc/self/clear_refs), Linux only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import soundfile

from trt_cosy import CosyVoice
from trt_cosy.runtime.heap import return_large_blocks
from trt_cosy.runtime.work_gate import RENDER_GATE

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
WORDS = "the quick brown fox jumps over the lazy dog near the river bank".split()


def status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def make_voice(tts: CosyVoice):
    speech, rate = soundfile.read(REFERENCE, dtype="float32")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ref.wav"
        soundfile.write(path, speech[rate // 2 : 2 * rate], rate)
        return tts.voice_from_wav(path, "Hello, this is me.")


def long_text(words: int) -> str:
    return " ".join(WORDS[index % len(WORDS)] for index in range(words)).capitalize() + "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--words", type=int, default=40, help="words of the one-sentence text")
    parser.add_argument(
        "--ab-runs", type=int, default=3, help="sequential runs per arm of the shrink A/B (0: skip)"
    )
    parser.add_argument("--no-heap-return", action="store_true", help="keep glibc's dynamic mmap threshold")
    parser.add_argument(
        "--gate-tokens", type=int, default=None, help="render gate capacity (default: the library's)"
    )
    parser.add_argument("--llm-only", action="store_true", help="decode speech tokens only (LLM memory)")
    args = parser.parse_args(argv)
    if not args.no_heap_return:
        return_large_blocks()
    if args.gate_tokens is not None:
        RENDER_GATE.capacity = args.gate_tokens
    tts = CosyVoice.load(args.engines)
    voice = make_voice(tts)
    text = long_text(args.words)
    segments = tts._request(text, voice, 0, None).segments
    print(
        f"text: {len(text)} chars, {len(segments)} segment(s) of {[s.ids.size for s in segments]} text tokens"
    )

    def run(seed: int) -> tuple[float, float]:
        started, samples = time.perf_counter(), 0
        if args.llm_only:  # the speech tokens of every segment, no flow or vocoder
            chunks = tts.synthesize(text, voice, seed)
            feed = chunks.request.feed
            tokens = sum(feed.wait(index, None)[0].size for index in range(len(segments)))
            chunks.close()
            return tokens / 25, time.perf_counter() - started
        for chunk in tts.synthesize(text, voice, seed):
            samples += chunk.samples.size
        return samples / tts.sample_rate, time.perf_counter() - started

    for _ in tts.synthesize("Hello.", voice, 0):  # warm-up
        pass
    base = status_mib("VmRSS")
    print(
        f"post-warm-up RSS {base:.0f} MiB (gate {RENDER_GATE.capacity} tokens, "
        f"shrink {os.environ.get('TRT_COSY_ARENA_SHRINK', '1')}, heap return {not args.no_heap_return})"
    )
    reset_peak()
    audio_s, seconds = run(1)
    one_peak = status_mib("VmHWM")
    print(
        f"one request: peak {one_peak:.0f} MiB, after {status_mib('VmRSS'):.0f} MiB ({audio_s:.1f} s audio, {seconds:.1f} s)"
    )
    reset_peak()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(run, range(args.concurrency)))
    burst_peak = status_mib("VmHWM")
    time.sleep(1.0)
    after = status_mib("VmRSS")

    print(
        f"{args.concurrency} concurrent: peak {burst_peak:.0f} MiB ({burst_peak / one_peak:.2f}x one), "
        f"after {after:.0f} MiB ({after / base:.2f}x post-warm-up); wall {max(r[1] for r in results):.1f} s"
    )
    if args.ab_runs:
        # TRT_COSY_ARENA_SHRINK
        arms = {
            "after-encoder-and-vocoder": "1",
            "after-vocoder": "vocoder",
            "never": "0",
            "every-run": "all",
        }
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(args.ab_runs):
            for arm, mode in arms.items():
                os.environ["TRT_COSY_ARENA_SHRINK"] = mode
                times[arm].append(run(2)[1])
        os.environ.pop("TRT_COSY_ARENA_SHRINK", None)
        for arm, values in times.items():
            print(
                f"arena shrink {arm}: median {statistics.median(values):.2f} s over {[round(v, 2) for v in values]}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
