"""What the server's streaming encoders cost (trt_cosy.server.streaming_encoders): per second of audio, and
for the first chunk (the delay they add to a stream's first bytes), on a speech-like 24 kHz test signal fed
in 1 s chunks as the engine feeds them. The minimum of ``--rounds`` runs is reported.

    python bench/encoder_bench.py [--seconds 10] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from trt_cosy.server.streaming_encoders import open_encoder

RATE = 24000


def test_signal(seconds: int) -> np.ndarray:
    """A 180 Hz voiced buzz with a 3 Hz syllable envelope and a little noise, float32 [seconds * RATE]."""
    rng = np.random.default_rng(0)
    time_axis = np.arange(seconds * RATE) / RATE  # [N]
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3 * time_axis)
    voiced = 0.3 * envelope * np.sin(2 * np.pi * 180 * time_axis)
    return (voiced + 0.03 * rng.standard_normal(time_axis.size)).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    signal = test_signal(args.seconds)
    print("| format | encode ms per s of audio | first 1 s chunk: ms (bytes out) | kbit/s |")
    print("|---|---|---|---|")
    for name in ("pcm", "wav", "mp3", "opus", "aac", "flac"):
        totals, firsts, size, first_size = [], [], 0, 0
        for _ in range(args.rounds):
            started = time.perf_counter()
            encoder = open_encoder(name, RATE)
            first = encoder.encode(signal[:RATE])
            first_done = time.perf_counter()
            size = len(first)
            for second in range(1, args.seconds):
                size += len(encoder.encode(signal[second * RATE : (second + 1) * RATE]))
            size += len(encoder.finish())
            totals.append(time.perf_counter() - started)
            firsts.append(first_done - started)
            first_size = len(first)
        print(
            f"| {name} | {min(totals) / args.seconds * 1000:.2f} | {min(firsts) * 1000:.2f} ({first_size}) "
            f"| {size * 8 / args.seconds / 1000:.0f} |"
        )


if __name__ == "__main__":
    main()
