"""Text-in streaming: time from the first text piece to the first audio, and whether the audio stalls.

    python bench/text_stream_bench.py --engines ENGINES --threads 2 --words-per-second 15 --runs 3

A zero-shot voice from the first ``--ref-seconds`` (5) s of tests/data/features/audio/en_16k_mono.wav;
``--text`` is sent ``--words`` (3) words per piece at ``--words-per-second`` into a ``TextStream`` by a
thread while ``CosyVoice.synthesize(stream, voice, config=SynthesisConfig(stream=True))`` is iterated
(the official bistream decoding, ``stages.bistream``). Per run: first audio after the first piece, the
longest gap between chunks, and the stall a listener playing the audio as it arrives would hear after
the first audio (total and longest); then the medians, as JSON with ``--json``. ``--max-ratio`` caps
the speech per text id (random-weight models never say eos).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import soundfile

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig, TextStream

AUDIO = Path(__file__).resolve().parents[1] / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"
REF_TEXT = "The quick brown fox jumps over the lazy dog, then rests quietly by the river."
TEXT = (
    "Thanks for calling. I have looked at your order, and the parcel left our warehouse this morning. "
    "It should reach you on Thursday before noon. If nobody is home, the driver will leave a note with a "
    "number to call, and you can pick it up at the post office the next day."
)


def run_once(tts: CosyVoice, voice, words: list[str], per_piece: int, rate: float, seed: int) -> dict:
    stream = TextStream(tts.tokenizer.encode)

    def send() -> None:
        for start in range(0, len(words), per_piece):
            stream.put(" ".join(words[start : start + per_piece]) + " ")
            time.sleep(per_piece / rate)
        stream.end()

    chunks = tts.synthesize(stream, voice, seed=seed, config=SynthesisConfig(stream=True))
    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    arrivals, durations = [], []
    for chunk in chunks:
        arrivals.append(time.perf_counter())
        durations.append(chunk.duration)
    sender.join()
    first_piece = stream.first_piece_at or arrivals[0]
    played_until, stall, longest_stall = arrivals[0], 0.0, 0.0
    for arrived, seconds in zip(arrivals, durations, strict=True):
        gap = max(0.0, arrived - played_until)
        stall, longest_stall = stall + gap, max(longest_stall, gap)
        played_until = max(played_until, arrived) + seconds
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {
        "first_audio_s": arrivals[0] - first_piece,
        "text_sent_s": (stream.last_piece_at or first_piece) - first_piece,
        "audio_s": sum(durations),
        "chunks": len(arrivals),
        "longest_gap_s": max(gaps, default=0.0),
        "stall_s": stall,
        "longest_stall_s": longest_stall,
        "text_tokens": stream.ids_received,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--words-per-second", type=float, default=15.0)
    parser.add_argument("--words", type=int, default=3, help="words per piece")
    parser.add_argument("--ref-seconds", type=float, default=5.0)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--max-ratio",
        type=float,
        help="speech tokens per text id at most (a random-weight model never says eos: "
        "it would speak 20 per id); default: the model's",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=args.threads))
    if args.max_ratio is not None:
        config = tts.model.config
        llm = dataclasses.replace(config.llm, max_token_text_ratio=args.max_ratio)
        model = dataclasses.replace(tts.model, config=dataclasses.replace(config, llm=llm))
        tts = CosyVoice(model, tts.tokenizer, tts.voice_builder, tts.normalizer, tts.engine_config)
    speech, rate = soundfile.read(AUDIO, dtype="float32")
    with tempfile.TemporaryDirectory() as folder:
        ref = Path(folder) / "ref.wav"
        soundfile.write(ref, speech[: int(args.ref_seconds * rate)], rate)
        voice = tts.voice_from_wav(ref, REF_TEXT)
    words = args.text.split()
    run_once(tts, voice, words, args.words, args.words_per_second, seed=0)  # warm-up
    runs = [
        run_once(tts, voice, words, args.words, args.words_per_second, seed=i + 1) for i in range(args.runs)
    ]
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    worst_stall = max(run["longest_stall_s"] for run in runs)
    result = {
        "runs": runs,
        "median": medians,
        "worst_longest_stall_s": worst_stall,
        "args": vars(args) | {"engines": str(args.engines), "json": str(args.json)},
    }
    for index, run in enumerate(runs):
        print(f"run {index}: " + ", ".join(f"{key} {value:.3f}" for key, value in run.items()))
    print("median: " + ", ".join(f"{key} {value:.3f}" for key, value in medians.items()))
    print(f"worst longest stall: {worst_stall:.3f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
