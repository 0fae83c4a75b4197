"""Voice conversion speed: RTF of converting a source, and first audio when streamed.

    python scripts/vc_bench.py --engines ENGINES [--seconds 10] [--runs 3] [--threads 2]

The source is the espeak sentence of tests/data/features/audio/en_16k_mono.wav repeated to
``--seconds``; the target voice is ``vc_voice_from_wav`` of zh_16k_mono.wav (4.2 s: 105 prompt tokens).
One warm-up conversion of each kind, then ``--runs`` timed ones; medians (min-max) are printed. Timed
from the ``convert`` call (the source read, resampled and tokenised inside) to the last chunk (RTF =
that time / output seconds) or to the first chunk (``stream=True``, official schedule).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import soundfile

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig

AUDIO = Path(__file__).resolve().parents[1] / "tests" / "data" / "features" / "audio"


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", required=True)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=args.threads))
    target = tts.vc_voice_from_wav(AUDIO / "zh_16k_mono.wav")
    speech, rate = soundfile.read(AUDIO / "en_16k_mono.wav", dtype="float32")
    samples = int(args.seconds * rate)
    source = (np.tile(speech, samples // speech.size + 1)[:samples], rate)
    rtfs, totals, firsts = [], [], []
    for run in range(args.runs + 1):
        started = time.perf_counter()
        audio = sum(chunk.samples.size for chunk in tts.convert(source, target, seed=run)) / tts.sample_rate
        elapsed = time.perf_counter() - started
        started = time.perf_counter()
        chunks = tts.convert(source, target, seed=run, config=SynthesisConfig(stream=True))
        next(chunks)
        first = time.perf_counter() - started
        for _ in chunks:
            pass
        if run:  # run 0 warms up
            rtfs.append(elapsed / audio)
            totals.append(elapsed)
            firsts.append(first)
    print(f"{tts!r}, {args.threads} threads, source {args.seconds:g} s -> {audio:.2f} s of audio")
    print(f"convert: {_spread(totals)} s, RTF {_spread(rtfs)}; streamed: first audio {_spread(firsts)} s")


if __name__ == "__main__":
    main()
