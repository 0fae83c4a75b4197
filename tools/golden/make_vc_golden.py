"""Golden data for voice conversion: the official ``inference_vc`` on the tiny v1 / v2 / v3 checkpoints.

Command (from the repository root; the official environment of tools/golden/official_env.py)::

    for f in v1 v2 v3; do trt-cosy make-test-model --family $f --size tiny --seed 0 --out /tmp/extras-$f; done
    /work/official-venv/bin/python tools/golden/make_vc_golden.py --extras /tmp/extras-{family}

Official code: FunAudioLLM/CosyVoice ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40, Matcha-TTS
dd9105b34bf2be2230f4aa1e4769fb586a3c824e; torch 2.13.0 CPU, fp32, 2 threads. For each family the
official object (``CosyVoice`` / ``CosyVoice2`` / ``CosyVoice3``, official constructor) runs
``inference_vc(source, target, stream=False)``, ``(..., stream=True)`` and ``(..., stream=False, speed=0.5
/ 2.0)`` (the official speed path: the whole mel stretched before HiFT) on:

* source: ``tests/data/features/audio/en_44k1_stereo.wav`` samples [0.5 s, 0.5 s + SOURCE_SECONDS)
  (44.1 kHz stereo: the official ``load_wav`` mixes down and resamples), written as 16-bit PCM;
* target: ``zh_16k_mono.wav`` samples [0.8 s, 1.8 s), 16-bit PCM.

Random draws: ``official_runs.Draws`` (seed ``DRAW_SEED``; v1 flow noise and v1/v2 HiFT noise are
regenerated from the stored log); v3 uses its construction-time buffers rounded to float16 (golden
README §8.3; checked equal to ``reference.npz``). ``token_hop_len`` is reset to 25 before each streamed
run (the official model never resets it). Stand-in frontend ONNX files: hashed into ``meta_json``.

Output ``tests/data/vc/<family>.npz`` (tens of KB): ``source_tokens`` [n] int32 (frontend_vc), the target
``prompt_tokens`` [P] int32, ``prompt_feat`` [T/MEL_STRIDE, 80] (every MEL_STRIDE-th frame),
``embedding`` [192], and per run (``RUNS``): ``<run>_c<k>_flow_mel`` [1, 80, F/MEL_STRIDE] (the flow output
of official token2wav call k, every MEL_STRIDE-th frame; not for the speed runs, whose flow runs as the
nonstream one), ``<run>_wav`` int16 (the yielded audio, every
``wav_stride``-th sample, in steps of 2^-15). ``meta_json``: inputs, runs, calls, draw logs.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import official_env as env  # noqa: E402
from official_runs import DRAW_SEED, Draws, pcm16, round_v3_buffers, run_official  # noqa: E402

AUDIO = env.DATA / "features" / "audio"
SOURCE = ("en_44k1_stereo.wav", 0.5)  # file, start (s)
SOURCE_SECONDS = {"v1": 2.5, "v2": 1.2, "v3": 1.2}  # v1 streams only from 120 tokens (2.4 s at 50 Hz)
TARGET = ("zh_16k_mono.wav", 0.8, 1.0)  # file, start (s), seconds
RUNS = (  # name, stream, speed, stride of the stored audio
    ("nonstream", False, 1.0, 2),
    ("stream", True, 1.0, 2),
    ("speed0.5", False, 0.5, 4),
    ("speed2", False, 2.0, 2),
)
MEL_STRIDE = {"v1": 4, "v2": 2, "v3": 2}  # v1's 50 Hz tokens make 2.5x the frames
THREADS = 2
OUT = env.DATA / "vc"


def cut(name: str, start_s: float, seconds: float, out: Path) -> dict:
    """Samples [start, start + seconds) of a features wav, written as 16-bit PCM (exact copy)."""
    import soundfile

    data, rate = soundfile.read(AUDIO / name, dtype="int16", always_2d=True)  # [N, C]
    start, end = int(round(start_s * rate)), int(round((start_s + seconds) * rate))
    soundfile.write(out, data[start:end], rate, subtype="PCM_16")
    return {"file": f"tests/data/features/audio/{name}", "start": start, "end": end, "rate": rate}


def make(family: str, extras: Path, work: Path) -> Path:
    import torch

    torch.set_num_threads(THREADS)
    model_dir = env.official_model_dir(family, extras, work / f"official-{family}")
    cosy = env.load_official(family, model_dir)
    meta = {
        "kind": "inference_vc",  # trt_cosy.verify.official_vc
        "official_commit": env.OFFICIAL_COMMIT,
        "matcha_commit": env.MATCHA_COMMIT,
        "torch": torch.__version__,
        "threads": THREADS,
        "family": family,
        "standins_sha256": env.standin_hashes(family, model_dir),
        "mel_stride": MEL_STRIDE[family],
        "runs": [name for name, *_ in RUNS],
        "wav_scale": 1 / 32768,
        "draw_seed": DRAW_SEED,
    }
    if family == "v3":
        round_v3_buffers(cosy)
        with np.load(env.GOLDEN_DIRS["v3"] / "reference.npz") as golden:
            sines = golden["hift_sine_waves"].astype(np.float32)
        ours = cosy.model.hift.m_source.l_sin_gen.sine_waves[:, : sines.shape[1]].numpy()
        assert np.array_equal(ours, sines), "v3 HiFT noise buffer differs from the golden reference"
    source_wav, target_wav = work / f"source-{family}.wav", work / f"target-{family}.wav"
    meta["source"] = cut(SOURCE[0], SOURCE[1], SOURCE_SECONDS[family], source_wav)
    meta["target"] = cut(TARGET[0], TARGET[1], TARGET[2], target_wav)
    arrays: dict[str, np.ndarray] = {}
    for run, stream, speed, wav_stride in RUNS:
        draws = Draws()
        record = run_official(
            cosy,
            lambda stream, speed=speed: cosy.inference_vc(
                str(source_wav), str(target_wav), stream=stream, speed=speed
            ),
            draws,
            stream,
        )
        inputs = record.model_input
        if run == "nonstream":
            arrays["source_tokens"] = inputs["source_speech_token"][0].astype(np.int32)
            arrays["prompt_tokens"] = inputs["flow_prompt_speech_token"][0].astype(np.int32)
            arrays["prompt_feat"] = inputs["prompt_speech_feat"][0, :: MEL_STRIDE[family]].astype(np.float32)
            arrays["embedding"] = inputs["flow_embedding"][0].astype(np.float32)
            meta["prompt_feat_frames"] = int(inputs["prompt_speech_feat"].shape[1])
        else:  # the frontend is deterministic: the streamed run got the same inputs
            assert np.array_equal(inputs["source_speech_token"][0], arrays["source_tokens"])
        for index, mel in enumerate(record.flow_mels if speed == 1.0 else []):  # speed: the nonstream mel
            arrays[f"{run}_c{index}_flow_mel"] = mel[:, :, :: MEL_STRIDE[family]]
        wav = record.wav
        arrays[f"{run}_wav"] = pcm16(wav[::wav_stride])
        meta[run] = {
            "stream": stream,
            "speed": speed,
            "wav_stride": wav_stride,
            "calls": record.calls,
            "flow_mel_frames": [int(mel.shape[2]) for mel in record.flow_mels],
            "chunk_samples": [int(chunk.shape[0]) for chunk in record.chunks],
            "samples": int(wav.shape[0]),
            "draws": draws.log,
        }
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"{family}.npz"
    np.savez_compressed(out, meta_json=np.array(json.dumps(meta)), **arrays)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--extras", required=True, help="make-test-model release per family, '{family}' in it"
    )
    parser.add_argument("--families", default="v1,v2,v3")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families.split(","):
            out = make(family, Path(args.extras.format(family=family)), Path(tmp))
            print(f"{out}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
