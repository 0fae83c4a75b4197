"""Soak: hundreds of requests on one CosyVoice from several threads; RSS must settle.

    trt-cosy make-test-model --size tiny --out /tmp/tiny && trt-cosy build --model-dir /tmp/tiny --out /tmp/tiny-engines
    python bench/soak.py --engines /tmp/tiny-engines --requests 300 --workers 4

The mix: streaming and non-streaming requests, a quarter of them closed after their first chunk
(cancellation path), a tenth through ``asynthesize``. Prints RSS (MiB) every ``--every`` requests,
then the growth from the first sample after warm-up to the end and the live thread count (it must
return to the baseline: no leaked LLM workers). Exit status 1 when the growth exceeds ``--max-growth-mib``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import soundfile

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
TEXTS = ("Hi.", "Hello there.", "Good day.", "Hi there.")


def rss_mib() -> float:
    """Resident set size of this process (Linux /proc), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _voice(tts: CosyVoice):
    speech, rate = soundfile.read(REFERENCE, dtype="float32")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ref.wav"
        soundfile.write(path, speech[rate // 2 : 2 * rate], rate)
        return tts.voice_from_wav(path, "Hello, this is me.")


async def _first_async_chunk(tts: CosyVoice, text: str, voice, seed: int) -> int:
    total = 0
    async for chunk in tts.asynthesize(text, voice, seed=seed, config=SynthesisConfig(stream=True)):
        total += chunk.samples.shape[0]
    return total


def one_request(tts: CosyVoice, voice, number: int) -> int:
    """Run request ``number`` of the mix; returns the samples it produced."""
    text = TEXTS[number % len(TEXTS)]
    if number % 10 == 9:
        return asyncio.run(_first_async_chunk(tts, text, voice, number))
    config = SynthesisConfig(stream=number % 2 == 0, text_frontend=False)
    chunks = tts.synthesize(text, voice, seed=number, config=config)
    if number % 4 == 3:  # the consumer leaves after the first chunk
        first = next(chunks)
        chunks.close()
        return first.samples.shape[0]
    return int(sum(chunk.samples.shape[0] for chunk in chunks))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--every", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=25, help="Requests before the RSS baseline.")
    parser.add_argument("--max-growth-mib", type=float, default=50.0)
    args = parser.parse_args()

    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=1, normalizer="none"))
    voice = _voice(tts)
    threads_before = threading.active_count()
    samples: list[tuple[int, float, float]] = []
    started = time.perf_counter()
    print(f"start: RSS {rss_mib():.1f} MiB, {threads_before} threads")
    with ThreadPoolExecutor(args.workers) as pool:
        for start in range(0, args.requests, args.every):
            numbers = range(start, min(start + args.every, args.requests))
            produced = sum(pool.map(lambda n: one_request(tts, voice, n), numbers))
            done = numbers[-1] + 1
            samples.append((done, time.perf_counter() - started, rss_mib()))
            print(
                f"{done:5d} requests  {samples[-1][1]:7.1f} s  RSS {samples[-1][2]:7.1f} MiB  ({produced} samples)"
            )
    time.sleep(0.5)
    threads_after = threading.active_count()
    after_warmup = [rss for done, _, rss in samples if done >= args.warmup]
    growth = after_warmup[-1] - after_warmup[0]
    peak = max(rss for _, _, rss in samples)
    slope = (
        np.polyfit([d for d, _, _ in samples if d >= args.warmup], after_warmup, 1)[0]
        if len(after_warmup) > 1
        else 0.0
    )
    print(
        f"RSS after warm-up {after_warmup[0]:.1f} MiB -> end {after_warmup[-1]:.1f} MiB "
        f"(growth {growth:+.1f} MiB, peak {peak:.1f} MiB, trend {slope * 100:+.2f} MiB per 100 requests); "
        f"threads {threads_before} before, {threads_after} after"
    )
    ok = growth <= args.max_growth_mib and threads_after <= threads_before + args.workers
    print("ok" if ok else "FAILED: RSS grew or threads leaked")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
