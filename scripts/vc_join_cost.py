"""What a window join costs: one <= 30 s source converted whole vs cut at a pause into two windows.

    python scripts/vc_join_cost.py --engines ENGINES --source speech.wav --ref target.wav [--cut-after 15]

The same words go through ``CosyVoice.convert`` twice: whole (one tokenizer call, one flow call) and
split (``conversion.pause_windows`` with windows of at most ``--cut-after`` seconds, so the source is
cut at its quietest stretch before that). Printed: where the cut fell, how many source tokens differ
(and how far from the join the differences are), and the waveform SNR of split vs whole, overall and
outside +-1 s around the join, per window, and (the yardstick) whole vs whole with another vocoder seed.
Both conversions use the same seed, not streamed. Each window's flow starts from the same fixed CFM
noise as every official flow call does, so a later window is rendered from other noise than the same
seconds of the whole source.
"""

from __future__ import annotations

import argparse
from unittest import mock

import numpy as np

from trt_cosy import CosyVoice, EngineConfig, conversion
from trt_cosy.audio import load_audio


def _snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    noise = np.sum((reference - other) ** 2)
    return float("inf") if noise == 0 else 10 * np.log10(np.sum(reference**2) / noise)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engines", required=True)
    parser.add_argument("--source", required=True, help="speech of at most 30 s")
    parser.add_argument("--ref", required=True, help="the target voice's reference")
    parser.add_argument("--cut-after", type=float, default=15.0, help="longest window of the split run, s")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    tts = CosyVoice.load(args.engines, config=EngineConfig(threads=args.threads))
    target = tts.vc_voice_from_wav(args.ref)
    wav16k = load_audio(args.source, conversion.SOURCE_RATE, min_sr=conversion.MIN_SOURCE_RATE)
    assert wav16k.size <= conversion.WINDOW_SECONDS * conversion.SOURCE_RATE, "use a source of <= 30 s"
    whole = np.concatenate([c.samples for c in tts.convert(args.source, target, seed=0)])
    windows = conversion.pause_windows(wav16k, args.cut_after, args.cut_after / 2)
    split_windows = mock.patch.object(conversion, "pause_windows", lambda wav, *rest: windows)
    with split_windows:
        chunks = list(tts.convert(args.source, target, seed=0))
    split = np.concatenate([c.samples for c in chunks])
    tokens_whole = tts.voice_builder.speech_tokens(wav16k)[0]
    pieces = [tts.voice_builder.speech_tokens(wav16k[w.start : w.end])[0] for w in windows]
    tokens_split = np.concatenate(pieces)
    joins = [w.start / conversion.SOURCE_RATE for w in windows[1:]]
    print(f"source {wav16k.size / conversion.SOURCE_RATE:.2f} s, windows: {[w.label() for w in windows]}")
    print(f"tokens: whole {tokens_whole.size}, split {tokens_split.size}")
    if tokens_whole.size == tokens_split.size:
        differ = np.flatnonzero(tokens_whole != tokens_split)
        rate = tts.model.config.token_frame_rate
        where = ", ".join(f"{index / rate:.2f} s" for index in differ[:12])
        print(f"tokens that differ: {differ.size} ({where})")
    length = min(whole.size, split.size)
    rate = tts.sample_rate
    away = np.ones(length, bool)
    for join in joins:
        away[max(0, int((join - 1) * rate)) : int((join + 1) * rate)] = False
    print(f"audio: whole {whole.size / rate:.2f} s, split {split.size / rate:.2f} s")
    print(f"SNR split vs whole: overall {_snr_db(whole[:length], split[:length]):.1f} dB, "
          f"outside +-1 s of the joins {_snr_db(whole[:length][away], split[:length][away]):.1f} dB")
    edges = [0, *[int(join * rate) for join in joins], length]
    per_window = [_snr_db(whole[a:b], split[a:b]) for a, b in zip(edges[:-1], edges[1:])]
    print("SNR split vs whole per window: " + ", ".join(f"{snr:.1f} dB" for snr in per_window))
    other_seed = np.concatenate([c.samples for c in tts.convert(args.source, target, seed=1)])
    baseline = _snr_db(whole, other_seed[: whole.size])
    print(f"baseline, whole with another vocoder seed vs whole: {baseline:.1f} dB")


if __name__ == "__main__":
    main()
