"""Does a row's logits depend on the other rows? An ``llm_batch.onnx`` decoded alone and in batches.

    python bench/decode_invariance_probe.py DIR [--threads 2]

DIR holds ``llm_batch.onnx`` (an ONNX Runtime engines directory, or a bare derived graph). Six rows
with prompts of 12..201 random embeddings are decoded 8 forced steps alone, then in batches of 2, 3,
4 and 6 of 8 KV slots (a row leaving after step 3 in two of them), with steps over the active rows
(``fixed_shapes=False``, the default) and over all slots (``fixed_shapes=True``,
``EngineConfig.deterministic``); prints per mode how many row-steps are bit-identical to alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from trt_cosy.runtime.backends.onnxruntime.batch import OrtBatchLLM
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.kv_slots import KVSlots, PrefillCache

LENGTHS = (150, 37, 90, 12, 201, 64)
BATCHES = (([0, 1], None), ([0, 1, 2, 3], 1), ([0, 1, 2, 3, 4, 5], 4), ([5, 3, 0], None))  # (rows, leaves)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    runner = OrtRunner.from_path(args.directory / "llm_batch.onnx", "llm_batch", threads=args.threads, exported=True)
    layers = sum(name.startswith("past_key_") for name in runner.input_names)
    _, heads, _, head_dim = runner.input_specs()["past_key_0"][0]
    model = OrtBatchLLM(runner, layers)
    vocab, width = runner.session.get_outputs()[0].shape[2], runner.session.get_inputs()[0].shape[2]
    rng = np.random.default_rng(0)
    table = (rng.standard_normal((vocab, width)) * 0.02).astype(np.float32)  # [V, D]
    caches = []
    for length in LENGTHS:
        cache = PrefillCache(layers, heads, length, head_dim)
        model.prefill(table[rng.integers(0, vocab, length)][None], cache)
        caches.append(cache)
    forced = rng.integers(0, vocab, 8)

    def run(members: list[int], fixed: bool, leaves: int | None = None) -> dict[int, list[np.ndarray]]:
        slots = KVSlots(8, layers, heads, 256, head_dim)
        stepper = model.decoder(slots, vocab, fixed_shapes=fixed)
        rows, out = list(members), {m: [] for m in members}
        for member in members:
            slots.add(caches[member])
        for step, token in enumerate(forced):
            logits = stepper.step(np.stack([table[token] for _ in rows])[:, None])  # [B, V]
            for row, member in enumerate(rows):
                out[member].append(logits[row].copy())
            if leaves is not None and step == 3:
                row = rows.index(leaves)
                moved = slots.remove(row)
                if moved is not None:
                    rows[row] = rows[moved]
                rows.pop()
        return out

    for fixed in (False, True):
        alone = {member: run([member], fixed)[member] for member in range(len(LENGTHS))}
        worst, equal, total = 0.0, 0, 0
        for members, leaves in BATCHES:
            for member, rows in run(members, fixed, leaves).items():
                for got, want in zip(rows, alone[member], strict=False):
                    total += 1
                    equal += bool(np.array_equal(got, want))
                    worst = max(worst, float(np.abs(got - want).max()))
        print(f"fixed_shapes={fixed}: {equal}/{total} row-steps bit-identical to alone, max |diff| {worst:.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
