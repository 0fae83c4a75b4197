"""First audio through the Python API, A/B of ``Request.llm_yield`` policies, alternating runs.

    python tools/experiments/flow/first_audio_ab.py --engines /tmp/perf-full/int4 --threads 2 --ref-seconds 5 --runs 3 \\
        --policies never,first

A zero-shot voice from tests/data/features/audio/en_16k_mono.wav tiled to ``--ref-seconds``; one
warm-up request; then per run and policy one ``CosyVoice.synthesize(..., SynthesisConfig(stream=True))``
closed after its first chunk. Prints each run (with the first chunk's LLM wait, flow and vocoder
seconds and the load average) and the median first audio per policy.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig, pipeline

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
REFERENCE_TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox."
TEXT = "Streaming should cost about what the whole sentence costs, and the first audio should come fast."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ref-seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--policies", default="never,first")
    args = parser.parse_args()
    policies = args.policies.split(",")

    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=args.threads, normalizer="none"))
    audio, rate = soundfile.read(REFERENCE, dtype="float32")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "ref.wav"
        repeats = int(np.ceil(args.ref_seconds * rate / audio.shape[0]))
        soundfile.write(path, np.tile(audio, repeats)[: int(args.ref_seconds * rate)], rate)
        voice = tts.voice_from_wav(path, REFERENCE_TEXT)
    config = SynthesisConfig(stream=True, text_frontend=False)
    for _ in tts.synthesize("Warm up the engines.", voice, seed=0, config=config):
        pass
    results: dict[str, list[float]] = {policy: [] for policy in policies}
    for run in range(args.runs):
        for policy in policies:
            pipeline.Request.llm_yield = policy
            started = time.perf_counter()
            chunks = tts.synthesize(TEXT, voice, seed=run, config=config)
            first = next(chunks)
            elapsed = time.perf_counter() - started
            chunks.close()
            results[policy].append(elapsed)
            timings = first.timings
            print(
                f"{policy} run {run + 1}: first audio {elapsed:.2f} s (LLM wait {timings['llm_wait_s']:.2f}, "
                f"flow {timings['flow_s']:.2f}, vocoder {timings['vocoder_s']:.2f}), "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
    print(f"prompt {voice.speech_tokens.shape[0]} speech tokens, threads {args.threads}")
    for policy, values in results.items():
        print(f"{policy}: median first audio {statistics.median(values):.2f} s over {len(values)} runs")


if __name__ == "__main__":
    main()
