"""Batched LLM decoding on TensorRT (``llm_decode`` plan, ``runtime.backends.tensorrt.batch``): per-step latency
against the batch size and greedy-token equality with batch 1 (called by scripts/gpu_check.sh; needs a
GPU, TensorRT and built plans).

For each batch size B (1, 2, 4, 8, up to the plan's profiles), B requests with prompts of mixed
lengths are prefilled on the ``llm`` plan, joined to device KV slots and decoded greedily for
``--steps`` batched steps. Printed per B: median and p90 seconds per step, decode tokens/s (B / step
time), and whether every row's tokens equal that request decoded alone at B = 1 through the same
plan. Also the first step's logits of B = 1 against the per-request ``llm`` plan (same weights, fp16
kernels of another graph: a difference within the fp16 budget is expected, the tokens are reported).

    python bench/trt_llm_decode.py ENGINES_DIR [--steps 64] [--json out.json]

Exit status 1 when a batched row's tokens differ from its batch-1 tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from trt_cosy.runtime.backends.tensorrt.batch import DeviceKVSlots, TrtBatchLLM, decode_limits
from trt_cosy.runtime.engines import load_engines
from trt_cosy.runtime.kv_slots import PrefillCache

PROMPTS = (151, 37, 260, 88, 203, 64, 119, 180)  # prompt positions of requests 0..7 (mixed)


def _decode(model: TrtBatchLLM, slots: DeviceKVSlots, prompts: list[np.ndarray], table: np.ndarray,
            vocab: int, steps: int) -> tuple[list[list[int]], list[float], np.ndarray]:  # fmt: skip
    """Greedy tokens per request, seconds per batched step, the first step's logits [B, V]."""
    qwen_layers, heads, head_dim = slots.layers, slots.kv_heads, slots.head_dim
    tokens = []
    for prompt in prompts:
        cache = PrefillCache(qwen_layers, heads, prompt.shape[1], head_dim)
        tokens.append([int(np.argmax(model.prefill(prompt, cache)))])
        slots.add(cache)
    stepper = model.decoder(slots, vocab)
    times, first = [], None
    for _ in range(steps):
        embeds = np.stack([table[row[-1]] for row in tokens])[:, None]  # [B, 1, D]
        start = time.perf_counter()
        logits = stepper.step(embeds)  # [B, V]
        times.append(time.perf_counter() - start)
        first = logits.copy() if first is None else first
        for row, values in zip(tokens, logits, strict=True):
            row.append(int(np.argmax(values)))
    while slots.count:
        slots.remove(slots.count - 1)
    return tokens, times, first


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", type=Path)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    model = load_engines(args.engines, backend="tensorrt")
    runners, qwen = model.runners, model.config.llm.qwen
    if "llm_decode" not in runners:
        print(f"{args.engines} has no llm_decode plan: rebuild with `trt-cosy build --backend tensorrt`")
        return 2
    decode = runners["llm_decode"]
    max_batch, max_window = decode_limits(decode)
    table = model.llm_tables["speech_embedding"]  # [V_in, D]
    rng = np.random.default_rng(0)
    prompts = [table[rng.integers(0, table.shape[0], n)][None].astype(np.float32) for n in PROMPTS]
    capacity = min(max_window, max(PROMPTS) + args.steps + 1)
    batched = TrtBatchLLM(runners["llm"], decode, qwen.num_layers)
    empty = np.zeros(
        (qwen.num_layers, 1, qwen.num_kv_heads, 0, qwen.head_dim), np.float32
    )  # [L, 1, H, 0, Dh]
    prefill = runners["llm"].infer({"inputs_embeds": prompts[0], "past_keys": empty, "past_values": empty})
    vocab = prefill["logits"].shape[2]
    token = int(np.argmax(prefill["logits"][0, -1]))
    reference = runners["llm"].infer({  # request 0's first decode step on the per-request llm plan
        "inputs_embeds": table[token][None, None],
        "past_keys": prefill["present_keys"],
        "past_values": prefill["present_values"],
    })["logits"][0, 0]  # fmt: skip
    alone: dict[int, list[int]] = {}
    rows, status = [], 0
    for batch in [b for b in (1, 2, 4, 8) if b <= max_batch]:
        slots = DeviceKVSlots(batch, qwen.num_layers, qwen.num_kv_heads, capacity, qwen.head_dim)
        _decode(batched, slots, prompts[:batch], table, vocab, 4)  # warm-up: profiles, activation memory
        tokens, times, first = _decode(batched, slots, prompts[:batch], table, vocab, args.steps)
        if batch == 1:
            for index in range(len(PROMPTS)):
                alone[index] = _decode(batched, slots, [prompts[index]], table, vocab, args.steps)[0][0]
            error = float(np.abs(first[0] - reference).max()) / max(1.0, float(np.abs(reference).max()))
            print(
                f"request 0, first decode step: llm_decode vs llm plan max error {error:.2e} (fp16 kernels of two graphs)"
            )
        equal = [tokens[i] == alone[i] for i in range(batch)]
        status |= 0 if all(equal) else 1
        step = float(np.median(times))
        row = {"batch": batch, "step_ms": 1e3 * step, "step_p90_ms": 1e3 * float(np.percentile(times, 90)),
               "tokens_per_s": batch / step, "rows_equal_to_batch_1": sum(equal)}  # fmt: skip
        rows.append(row)
        slots.free()
        print(f"B={batch}: {row['step_ms']:.2f} ms/step (p90 {row['step_p90_ms']:.2f}), "
              f"{row['tokens_per_s']:.0f} tokens/s, rows equal to batch 1: {sum(equal)}/{batch}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return status


if __name__ == "__main__":
    sys.exit(main())
