"""What batch-invariant decoding costs: decode tokens/s of the shared decode loop's steps with
``EngineConfig.deterministic`` off (steps over the active rows) and on (every step over all slots),
at 1, 4 and 8 active rows, on an ONNX Runtime engines directory's ``llm_batch.onnx``.

    python bench/decode_determinism_cost.py ENGINES_DIR [--threads 2] [--slots 8] [--steps 40] [--rounds 3]

Without ``speech_embedding.npy`` beside the graph, random embeddings of its width are fed. Each
active row is prefilled with a prompt of 150 random speech-token embeddings (a typical voice
prompt plus text), then ``--steps`` steps are timed; tokens/s alone = 1 row, aggregate = rows x
steps / seconds. The two modes alternate within each round so machine noise hits both alike; the
best round of each is reported (a loaded machine only ever slows a round down). The step graph only:
sampling, the flow and the vocoder are not in these numbers.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np

from trt_cosy.runtime.backends.onnxruntime.batch import OrtBatchLLM
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.kv_slots import KVSlots, PrefillCache

PROMPT = 150


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args(argv)
    runner = OrtRunner.from_path(args.engines / "llm_batch.onnx", "llm_batch", threads=args.threads, exported=True)
    names = runner.input_names
    layers = sum(name.startswith("past_key_") for name in names)
    _, heads, _, head_dim = runner.input_specs()["past_key_0"][0]
    model = OrtBatchLLM(runner, layers)
    vocab = runner.session.get_outputs()[0].shape[2]
    rng = np.random.default_rng(0)
    if (args.engines / "speech_embedding.npy").is_file():
        table = np.load(args.engines / "speech_embedding.npy")  # [V_in, D]
    else:  # a bare llm_batch.onnx: random embeddings of the model's width
        width = runner.session.get_inputs()[0].shape[2]
        table = (rng.standard_normal((vocab, width)) * 0.02).astype(np.float32)
    prompt = table[rng.integers(0, table.shape[0], PROMPT)][None].astype(np.float32)  # [1, T, D]
    cache = PrefillCache(layers, heads, PROMPT, head_dim)
    model.prefill(prompt, cache)
    capacity = PROMPT + args.steps + 1
    best: dict[tuple[int, bool], float] = {}
    for _ in range(args.rounds):
        for rows in args.rows:
            for fixed in (False, True):
                slots = KVSlots(args.slots, layers, heads, capacity, head_dim)
                for _ in range(rows):
                    slots.add(cache)
                stepper = model.decoder(slots, vocab, fixed_shapes=fixed)
                tokens = rng.integers(0, table.shape[0], (args.steps, rows))
                stepper.step(table[tokens[0]][:, None].astype(np.float32))  # warm-up (binding, arena)
                started = time.perf_counter()
                for step in range(1, args.steps):
                    stepper.step(table[tokens[step]][:, None].astype(np.float32))
                rate = rows * (args.steps - 1) / (time.perf_counter() - started)
                best[rows, fixed] = max(best.get((rows, fixed), 0.0), rate)
    print(f"{args.engines} | {_cpu()} | {args.threads} threads | {args.slots} slots | best of {args.rounds} rounds")
    print("| active rows | tok/s, active rows only | tok/s, all slots (deterministic) | change |")
    print("|---|---|---|---|")
    for rows in args.rows:
        fast, fixed = best[rows, False], best[rows, True]
        print(f"| {rows} | {fast:.1f} | {fixed:.1f} | {100 * (fixed / fast - 1):+.0f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
