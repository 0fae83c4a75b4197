"""Memory of the longest text the server accepts, one request against N at once, in a bounded run.

    python tools/experiments/memory/memory_longest.py --engines /work/fullsize/int4-030 --concurrency 8

The text is ``--chars`` characters (``ServerSettings.max_input_chars``, 4096) of ordinary sentences,
so the sentence splitter makes segments of its longest usual size (~80 text tokens, up to 1600
speech tokens each); every segment renders the same shapes, so the peak of a request is reached in
its first render. A full run of N such requests takes hours on a small CPU, so each phase is
bounded: the requests (non-streamed, as the server's library calls) run until ``--renders`` flow
encoder runs of the longest segment have finished in the phase (the flow encoder is the largest
working set of a render; docs/benchmarks.md, "Where the memory goes at full size"), then they
are cancelled and RSS is read 2 s later. One request first, then N at once, in one process with
the server's memory settings (glibc mmap threshold fixed, arena shrink after the vocoder, render
gate). Peaks are VmHWM (reset through /proc/self/clear_refs); RSS is also sampled every 0.5 s.
Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

from trt_cosy import CosyVoice
from trt_cosy.runtime.heap import return_large_blocks
from trt_cosy.runtime.work_gate import RENDER_GATE
from trt_cosy.synthesis import EngineConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_load import make_voice, reset_peak, status_mib  # noqa: E402

WORDS = "the quick brown fox jumps over the lazy dog near the river bank".split()


class CountingRunner:
    """A runner proxy that counts finished runs (the bench's progress signal)."""

    def __init__(self, runner: Any):
        self._runner = runner
        self.finished = 0
        self.largest = 0  # the most tokens of a finished run

    def infer(self, feed):
        outputs = self._runner.infer(feed)
        self.finished += 1
        self.largest = max(self.largest, feed["tokens"].shape[1])
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def longest_text(chars: int, words: int) -> str:
    """``chars`` characters at most of sentences of ``words`` words."""
    sentence = " ".join(WORDS[index % len(WORDS)] for index in range(words)).capitalize() + "."
    sentences, length = [], -1
    while length + 1 + len(sentence) <= chars:
        sentences.append(sentence)
        length += 1 + len(sentence)
    return " ".join(sentences)


def longest_segments(tts: CosyVoice, voice, chars: int, cap: int | None) -> tuple[str, list[int]]:
    """The text of ``chars`` characters whose first segment has the most text tokens, at most ``cap``
    (the sentence splitter packs whole sentences into segments of ~80 tokens, more when a sentence
    is long)."""
    best = ("", [0])
    for words in range(6, 40):
        text = longest_text(chars, words)
        sizes = [segment.ids.size for segment in tts._request(text, voice, 0, None).segments]
        if best[1][0] < sizes[0] <= (cap or sizes[0]):
            best = (text, sizes)
    return best


def phase(
    tts: CosyVoice,
    voice,
    text: str,
    count: int,
    renders: int,
    encoder: CountingRunner,
    limit_s: float,
    tokens: int,
):
    """Run ``count`` requests until ``renders`` encoder runs finished, one of them on ``tokens`` tokens
    or more; returns a summary dict."""
    requests, errors = [], []

    def consume(seed: int) -> None:
        chunks = tts.synthesize(text, voice, seed)
        requests.append(chunks.request)
        try:
            for _ in chunks:
                pass
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    start_runs, encoder.largest = encoder.finished, 0
    reset_peak()
    started = time.perf_counter()
    threads = [threading.Thread(target=consume, args=(seed,)) for seed in range(count)]
    for thread in threads:
        thread.start()
    sampled, first_render = 0.0, None
    while (
        encoder.finished - start_runs < renders or encoder.largest < tokens
    ) and time.perf_counter() - started < limit_s:
        time.sleep(0.5)
        sampled = max(sampled, status_mib("VmRSS"))
        if first_render is None and RENDER_GATE.in_flight:
            first_render = time.perf_counter() - started
    stopped = time.perf_counter() - started
    for request in list(requests):
        request.cancel()
    for thread in threads:
        thread.join()
    peak = status_mib("VmHWM")
    time.sleep(2.0)
    return {
        "peak": peak,
        "sampled": sampled,
        "after": status_mib("VmRSS"),
        "first_render_s": first_render,
        "stopped_s": stopped,
        "encoder_runs": encoder.finished - start_runs,
        "largest_render_tokens": encoder.largest,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", required=True)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--chars", type=int, default=4096, help="text length (the server's max_input_chars)")
    parser.add_argument("--renders", type=int, default=1, help="flow encoder runs to wait for per phase")
    parser.add_argument(
        "--llm-slots", type=int, default=None, help="KV slots (default: --concurrency, as serve)"
    )
    parser.add_argument(
        "--limit-s", type=float, default=420.0, help="stop a phase after this long regardless"
    )
    parser.add_argument(
        "--segment-tokens", type=int, default=None, help="cap on the first segment's text tokens"
    )
    parser.add_argument("--skip-one", action="store_true", help="only the concurrent phase")
    args = parser.parse_args(argv)
    return_large_blocks()
    slots = args.concurrency if args.llm_slots is None else args.llm_slots
    tts = CosyVoice.load(args.engines, config=EngineConfig(llm_slots=slots))
    voice = make_voice(tts)
    text, sizes = longest_segments(tts, voice, args.chars, args.segment_tokens)
    print(f"text: {len(text)} chars, {len(sizes)} segments of {sizes} text tokens; llm_slots {slots}")
    stages = tts._stages
    encoder = CountingRunner(stages.flow.encoder_runner)
    stages.flow.encoder_runner = encoder
    print(f"LLM: {type(stages.llm).__name__}")
    for _ in tts.synthesize("Hello.", voice, 0):  # warm-up
        pass
    base = status_mib("VmRSS")
    print(f"post-warm-up RSS {base:.0f} MiB (gate {RENDER_GATE.capacity} tokens)", flush=True)
    one = None
    if not args.skip_one:
        one = phase(tts, voice, text, 1, args.renders, encoder, args.limit_s, 0)
        print(f"one request: {one}", flush=True)
    target = 0 if one is None else one["largest_render_tokens"]
    many = phase(tts, voice, text, args.concurrency, args.renders, encoder, args.limit_s, target)
    print(f"{args.concurrency} concurrent: {many}", flush=True)
    for _ in tts.synthesize("Hello.", voice, 0):  # the next short request (its runs shrink the arena)
        pass
    time.sleep(1.0)
    print(f"after one more short request: RSS {status_mib('VmRSS'):.0f} MiB", flush=True)
    if one is not None:
        print(
            f"peak {many['peak']:.0f} MiB = {many['peak'] / one['peak']:.2f}x one ({one['peak']:.0f} MiB); "
            f"after the burst {many['after']:.0f} MiB = {many['after'] / base:.2f}x post-warm-up ({base:.0f} MiB)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
