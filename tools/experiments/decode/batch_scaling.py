"""Does batching pay on this CPU? (a) ``llm_batch`` decode step time against batch size (150 cached
positions per row); (b) flow estimator and HiFT time per mel frame against frames per call.

    python tools/experiments/decode/batch_scaling.py ENGINES [--threads 2] [--json out.json]

ENGINES must have ``llm_batch.onnx`` (``trt-cosy build`` writes it; see docs/benchmarks.md
"Continuous batching", where the results are).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from trt_cosy.runtime.backends.onnxruntime.batch import OrtBatchLLM
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.kv_slots import KVSlots, PrefillCache
from trt_cosy.runtime.manifest import model_config_from_dict


def _median_s(call: Callable[[], object], repeats: int) -> float:
    call()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _decode_steps(engines: Path, config, threads: int, rng: np.random.Generator) -> dict[str, float]:
    qwen = config.llm.qwen
    runner = OrtRunner.from_path(engines / "llm_batch.onnx", "llm_batch", threads, exported=True)
    model = OrtBatchLLM(runner, qwen.num_layers)
    out = {}
    for batch in (1, 2, 4, 8):
        slots = KVSlots(batch, qwen.num_layers, qwen.num_kv_heads, 512, qwen.head_dim)
        for _ in range(batch):
            cache = PrefillCache(qwen.num_layers, qwen.num_kv_heads, 150, qwen.head_dim)
            for part in (*cache.keys, *cache.values):
                part[:] = rng.standard_normal(part.shape)
            slots.add(cache)
        stepper = model.decoder(slots, config.llm.speech_vocab_size)
        inputs = rng.standard_normal((batch, 1, config.llm.llm_input_size)).astype(np.float32)  # [B, 1, D]

        def step(stepper=stepper, inputs=inputs, slots=slots, batch=batch) -> None:
            stepper.step(inputs)
            slots.lengths[:batch] -= 1  # stay at 150 cached positions

        seconds = _median_s(step, 10)
        out[f"llm_step_B{batch}_ms"] = seconds * 1e3
        print(f"llm_batch decode step, batch {batch}: {seconds * 1e3:.1f} ms ({batch / seconds:.1f} tok/s)", flush=True)
    return out


def _per_frame(engines: Path, threads: int, rng: np.random.Generator) -> dict[str, float]:
    out = {}
    estimator = OrtRunner.from_path(engines / "flow_estimator.onnx", "flow_estimator", threads, exported=True)
    for frames in (150, 300, 600, 1200):
        feed = {
            name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in (
                ("x", (2, 80, frames)),
                ("mu", (2, 80, frames)),
                ("cond", (2, 80, frames)),
                ("spks", (2, 80)),
                ("t", (2,)),
            )
        }
        feed["mask"] = np.ones((2, 1, frames), np.float32)
        seconds = _median_s(lambda feed=feed: estimator.infer(feed), 3)
        out[f"flow_F{frames}_ms"] = seconds * 1e3
        print(f"flow_estimator F={frames}: {seconds * 1e3:.1f} ms, {seconds / frames * 1e3:.3f} ms/frame", flush=True)
    hift = OrtRunner.from_path(engines / "hift.onnx", "hift", threads, exported=True)
    for frames in (50, 100, 200, 500):
        feed = {
            "mel": rng.standard_normal((1, 80, frames)).astype(np.float32),
            "sine_noise": rng.random((1, 480 * frames, 9)).astype(np.float32),
            "cache_source": np.zeros((1, 1, 0), np.float32),
        }
        seconds = _median_s(lambda feed=feed: hift.infer(feed), 3)
        out[f"hift_F{frames}_ms"] = seconds * 1e3
        print(f"hift F={frames}: {seconds * 1e3:.1f} ms, {seconds / frames * 1e3:.3f} ms/frame", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    config = model_config_from_dict(json.loads((args.engines / "model_config.json").read_text()))
    rng = np.random.default_rng(0)
    out = {**_decode_steps(args.engines, config, args.threads, rng), **_per_frame(args.engines, args.threads, rng)}
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
