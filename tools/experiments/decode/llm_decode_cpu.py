"""The TensorRT batched decode graph (``llm_decode``) on ONNX Runtime's CPU provider against the
per-request ``llm`` graph of the same engines directory: greedy tokens of a batch of mixed prompt
lengths (slot padding NaN) and the largest logit difference while the tokens agree.

    python tools/experiments/decode/llm_decode_cpu.py ENGINES_DIR [--precision fp16|fp32] [--steps 40]

ENGINES_DIR: written by ``trt-cosy build --backend tensorrt --onnx-only``. With fp16 this runs the
strongly typed ``*.fp16.onnx`` graphs; ONNX Runtime computes most fp16 ops in fp32, so it
approximates, not measures, TensorRT's fp16 kernels (bench/trt_llm_decode.py does that on a GPU).
Exit status 1 when a row's tokens differ from the request decoded alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner

PROMPTS = (37, 151, 88, 12)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engines", type=Path)
    parser.add_argument("--precision", choices=("fp16", "fp32"), default="fp16")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args(argv)
    suffix = ".fp16.onnx" if args.precision == "fp16" else ".onnx"
    llm = OrtRunner.from_path(args.engines / f"llm{suffix}", "llm", threads=1, exported=True)
    decode = OrtRunner.from_path(args.engines / f"llm_decode{suffix}", "llm_decode", threads=1, exported=True)
    table = np.load(args.engines / "speech_embedding.npy")  # [V_in, D]
    layers, _, heads, _, head_dim = llm.input_specs()["past_keys"][0]
    empty = np.zeros((layers, 1, heads, 0, head_dim), np.float32)  # [L, 1, H, 0, Dh]
    rng = np.random.default_rng(0)
    prompts = [table[rng.integers(0, table.shape[0], n)][None].astype(np.float32) for n in PROMPTS]
    caches = [llm.infer({"inputs_embeds": p, "past_keys": empty, "past_values": empty}) for p in prompts]

    alone_tokens, alone_logits = [], []
    for cache in caches:  # each request alone, on llm
        out, tokens, logits = cache, [], []
        for _ in range(args.steps):
            tokens.append(int(np.argmax(out["logits"][0, -1])))
            feed = {"inputs_embeds": table[tokens[-1]][None, None]}
            out = llm.infer({**feed, "past_keys": out["present_keys"], "past_values": out["present_values"]})
            logits.append(out["logits"][0, -1])
        alone_tokens.append(tokens)
        alone_logits.append(logits)

    capacity = max(PROMPTS) + args.steps + 1
    slots = {}
    for layer in range(layers):
        for kind in ("key", "value"):
            buffer = np.full((len(prompts), heads, capacity, head_dim), np.nan, np.float32)  # [B, H, C, Dh]
            for row, cache in enumerate(caches):
                part = cache[f"present_{kind}s"][layer, 0]  # [H, T, Dh]
                buffer[row, :, : part.shape[1]] = part
            slots[f"past_{kind}_{layer}"] = buffer
    lengths = np.asarray(PROMPTS, np.int32)
    tokens = [[int(np.argmax(c["logits"][0, -1]))] for c in caches]
    error = 0.0
    for step in range(args.steps - 1):
        embeds = np.stack([table[t[-1]] for t in tokens])[:, None]  # [B, 1, D]
        window = np.arange(int(lengths.max()), dtype=np.int32)
        got = decode.infer(
            {"inputs_embeds": embeds, "past_lengths": lengths, "key_positions": window, **slots}
        )
        for layer in range(layers):
            for row, length in enumerate(lengths):
                slots[f"past_key_{layer}"][row, :, length] = got["new_kv"][row, layer]
                slots[f"past_value_{layer}"][row, :, length] = got["new_kv"][row, layers + layer]
        lengths = lengths + 1
        for row in range(len(prompts)):
            if tokens[row] == alone_tokens[row][: step + 1]:
                error = max(error, float(np.abs(got["logits"][row, 0] - alone_logits[row][step]).max()))
            tokens[row].append(int(np.argmax(got["logits"][row, 0])))
    equal = [tokens[row] == alone_tokens[row][: len(tokens[row])] for row in range(len(prompts))]
    print(
        f"{args.precision}: prompts {PROMPTS}, {args.steps} greedy tokens each: rows equal to decoding alone "
        f"{sum(equal)}/{len(equal)}; max |logit difference| while equal {error:.2e}"
    )
    return 0 if all(equal) else 1


if __name__ == "__main__":
    sys.exit(main())
