"""CosyVoice3's incremental DiT against the chunk-attention DiT (torch): exactness and cost per chunk.

    python tools/experiments/flow/incremental_flow_v3.py --model-dir tests/data/cosyvoice3-tiny
    python tools/experiments/flow/incremental_flow_v3.py --full-size-random [--ref-seconds 5 --segment-seconds 15]

``--model-dir`` loads a release's DiT; ``--full-size-random`` makes the Fun-CosyVoice3-0.5B DiT
(dim 1024, depth 22, 16 heads of 64) with random weights (no checkpoint needed: the question is the
arithmetic, not the voice). Two measurements:

1. Exactness: the 10 cosine Euler steps with classifier-free guidance (batch 2, the unconditional
   row zeroed) over 170 random frames with the chunk-attention DiT, then chunk by chunk (100, 50
   and 20 new frames) through ``V3IncrementalEstimatorGraph`` with float32 caches: the largest
   difference of the mel.
2. Cost: one Euler step (one CFG-batched estimator call; all 10 steps cost the same) for every
   chunk of the official schedule of a ``--segment-seconds`` segment after a ``--ref-seconds``
   prompt: the chunk-attention DiT over all frames so far (what the official streaming recomputes)
   against the incremental graph over the new frames with the earlier ones cached, plus the final
   full-attention call both make; and the cache's bytes per frame (all steps), measured on the
   arrays. Torch CPU seconds: read the ratios, not the absolute times (the engines run ONNX Runtime).
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

import torch

from trt_cosy.models.v3.config import DiTConfig, v3_config_from_release_dir
from trt_cosy.models.v3.export.dit import DiT
from trt_cosy.models.v3.export.dit_incremental import (
    V3IncrementalEstimatorGraph,
    v3_incremental_cache_layout,
)
from trt_cosy.stages.flow import cosine_t_span
from trt_cosy.streaming import hop_schedule

CHUNKS = ((0, 100), (100, 150), (150, 170))  # chunk-aligned starts (50 frames), any lengths
STEPS = 10
CFG_RATE = 0.7
FULL_SIZE = DiTConfig(dim=1024, depth=22, heads=16, dim_head=64)  # Fun-CosyVoice3-0.5B cosyvoice3.yaml


def _euler(velocity, x0: torch.Tensor) -> torch.Tensor:
    t_span = cosine_t_span(STEPS)
    x = x0.clone()  # [1, 80, T]
    for step in range(1, STEPS + 1):
        dt = float(t_span[step] - t_span[step - 1])
        v = velocity(step - 1, x, torch.full((2,), float(t_span[step - 1])))  # [2, 80, T]
        x = x + dt * ((1.0 + CFG_RATE) * v[0:1] - CFG_RATE * v[1:2])
    return x


def _inputs(frames: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    mu, cond = (torch.randn(2, 80, frames, generator=generator) for _ in range(2))  # [2, 80, F]
    spks = torch.randn(2, 80, generator=generator)
    mu[1], cond[1], spks[1] = 0.0, 0.0, 0.0  # the unconditional CFG row
    return torch.randn(1, 80, frames, generator=generator), mu, cond, spks


def exactness(dit: DiT) -> float:
    blocks, width, channels, tail = v3_incremental_cache_layout(dit.config)
    frames = CHUNKS[-1][1]
    x0, mu, cond, spks = _inputs(frames, torch.Generator().manual_seed(0))
    mask = torch.ones(2, 1, frames)
    whole = _euler(lambda _, x, t: dit(x.expand(2, -1, -1), mask, mu, t, spks, cond, streaming=True), x0)
    graph = V3IncrementalEstimatorGraph(dit).eval()
    caches = [[torch.zeros(0, blocks, 2, width), torch.zeros(2, channels, tail)] for _ in range(STEPS)]
    pieces = []
    for begin, end in CHUNKS:

        def velocity(step, x, t, begin=begin, end=end):
            out, new_blocks, tails = graph(
                x.expand(2, -1, -1), mu[..., begin:end], t, spks, cond[..., begin:end], *caches[step]
            )
            caches[step] = [torch.cat([caches[step][0], new_blocks]), tails]
            return out

        pieces.append(_euler(velocity, x0[..., begin:end]))
    error = float((torch.cat(pieces, dim=-1) - whole).abs().max())
    print(
        f"exactness: {blocks} blocks, width {width}: incremental vs recomputed mel over {len(CHUNKS)} chunks, "
        f"{STEPS} Euler steps with CFG: max |difference| {error:.3g} (mel scale {float(whole.abs().max()):.3g})",
        flush=True,
    )
    return error


def _timed(call) -> tuple[float, object]:
    start = time.perf_counter()
    result = call()
    return time.perf_counter() - start, result


def cost(dit: DiT, prompt_tokens: int, segment_tokens: int) -> None:
    blocks, width, channels, tail = v3_incremental_cache_layout(dit.config)
    plans = hop_schedule(prompt_tokens, True, 25, 3, "official").plan_all(segment_tokens)
    total = 2 * (prompt_tokens + segment_tokens)
    x0, mu, cond, spks = _inputs(total, torch.Generator().manual_seed(1))
    x = x0.expand(2, -1, -1)
    t = torch.full((2,), 0.3)
    graph = V3IncrementalEstimatorGraph(dit).eval()
    past, tails = torch.zeros(0, blocks, 2, width), torch.zeros(2, channels, tail)
    recomputed, incremental = [], []
    for plan in plans:
        frames = 2 * (prompt_tokens + plan.end - (0 if plan.final else 3))
        part, mask = slice(0, frames), torch.ones(2, 1, frames)
        if plan.final:  # the official final call: full attention over everything, in both modes
            seconds, _ = _timed(partial(dit, x, mask, mu, t, spks, cond, streaming=False))
            recomputed.append(("final", frames, seconds))
            incremental.append(("final", frames, seconds))
            break
        chunk = partial(dit, x[..., part], mask, mu[..., part], t, spks, cond[..., part], streaming=True)
        seconds, _ = _timed(chunk)
        recomputed.append(("chunk", frames, seconds))
        new = slice(past.shape[0], frames)
        seconds, (_, new_blocks, tails) = _timed(
            partial(graph, x[..., new], mu[..., new], t, spks, cond[..., new], past, tails)
        )
        incremental.append(("chunk", frames - past.shape[0], seconds))
        past = torch.cat([past, new_blocks])
    per_frame = STEPS * past[:1].nbytes  # float32 block inputs of one frame, all steps
    print(
        f"cost: prompt {prompt_tokens} tokens, segment {segment_tokens} tokens, official chunk ends "
        f"{[plan.end for plan in plans]}, one Euler step per call (x{STEPS} for a chunk), torch "
        f"{torch.get_num_threads()} threads"
    )
    for name, rows in (("recomputed", recomputed), ("incremental", incremental)):
        chunks = sum(seconds for kind, _, seconds in rows if kind == "chunk")
        detail = ", ".join(f"{frames} fr {seconds:.2f} s" for _, frames, seconds in rows)
        print(
            f"  {name:>11}: non-final chunks {chunks:.2f} s, with the final full-attention call "
            f"{chunks + rows[-1][2]:.2f} s ({detail})"
        )
    print(
        f"  cache: {per_frame / 2**20:.2f} MiB per mel frame ({STEPS} steps); the last non-final chunk "
        f"held {past.shape[0]} frames = {past.shape[0] * per_frame / 2**20:.0f} MiB, tails "
        f"{STEPS * tails.nbytes / 2**20:.1f} MiB",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-dir", type=Path)
    source.add_argument("--full-size-random", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ref-seconds", type=float, default=5.0)
    parser.add_argument("--segment-seconds", type=float, default=15.0)
    parser.add_argument("--skip-cost", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.full_size_random:
        torch.manual_seed(0)
        dit = DiT(FULL_SIZE).eval()
    else:
        from trt_cosy.models.v3.export.flow import load_flow_v3

        config = v3_config_from_release_dir(args.model_dir)
        dit = load_flow_v3(args.model_dir, config.flow).decoder.estimator
    with torch.no_grad():
        exactness(dit)
        if not args.skip_cost:
            cost(dit, round(25 * args.ref_seconds), round(25 * args.segment_seconds))


if __name__ == "__main__":
    main()
