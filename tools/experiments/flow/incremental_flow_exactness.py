"""The incremental estimator against the chunk-attention estimator over a whole Euler solve (torch).

    python tools/experiments/flow/incremental_flow_exactness.py --model-dir /work/fullsize/model

Loads the release's CosyVoice2 estimator, solves the 10 cosine Euler steps with classifier-free
guidance (batch 2, the unconditional row zeroed) over 170 random frames with the chunk-attention
estimator, then again chunk by chunk (100, 50 and 20 new frames) through
``IncrementalEstimatorGraph`` with float32 caches, and prints the largest difference of the mel.
The tiny model's check is tests/test_flow_incremental.py; this one runs any size (the full-size
estimator takes ~20 s on one thread).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from trt_cosy.builder.modules.flow import load_flow
from trt_cosy.builder.modules.flow_estimator_incremental import (
    IncrementalEstimatorGraph,
    incremental_cache_layout,
)
from trt_cosy.models.v2.config import v2_config_from_release_dir
from trt_cosy.stages.flow import cosine_t_span

CHUNKS = ((0, 100), (100, 150), (150, 170))  # chunk-aligned starts (50 frames), any lengths


def _euler(velocity, x0: torch.Tensor, cfg_rate: float) -> torch.Tensor:
    t_span = cosine_t_span(10)
    x = x0.clone()  # [1, 80, T]
    for step in range(1, 11):
        dt = float(t_span[step] - t_span[step - 1])
        v = velocity(step - 1, x, torch.full((2,), float(t_span[step - 1])))  # [2, 80, T]
        x = x + dt * ((1.0 + cfg_rate) * v[0:1] - cfg_rate * v[1:2])
    return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = v2_config_from_release_dir(args.model_dir)
    estimator = load_flow(args.model_dir, config.flow).decoder.estimator
    blocks, width, channels = incremental_cache_layout(estimator)
    generator = torch.Generator().manual_seed(0)
    frames = CHUNKS[-1][1]
    mu, cond = (
        torch.randn(2, 80, frames, generator=generator),
        torch.randn(2, 80, frames, generator=generator),
    )
    spks = torch.randn(2, 80, generator=generator)
    mu[1], cond[1], spks[1] = 0.0, 0.0, 0.0  # the unconditional CFG row
    x0, mask = torch.randn(1, 80, frames, generator=generator), torch.ones(2, 1, frames)
    start = time.perf_counter()
    with torch.no_grad():
        whole = _euler(
            lambda _, x, t: estimator(x.expand(2, -1, -1), mask, mu, t, spks, cond, streaming=True), x0, 0.7
        )
        graph = IncrementalEstimatorGraph(estimator).eval()
        caches = [[torch.zeros(0, blocks, 2, width), torch.zeros(2, channels, 2)] for _ in range(10)]
        pieces = []
        for begin, end in CHUNKS:

            def velocity(step, x, t, begin=begin, end=end):
                out, new_blocks, tails = graph(
                    x.expand(2, -1, -1), mu[..., begin:end], t, spks, cond[..., begin:end], *caches[step]
                )
                caches[step] = [torch.cat([caches[step][0], new_blocks]), tails]
                return out

            pieces.append(_euler(velocity, x0[..., begin:end], 0.7))
    error = float((torch.cat(pieces, dim=-1) - whole).abs().max())
    print(
        f"{blocks} blocks, width {width}: incremental vs recomputed mel over {len(CHUNKS)} chunks, 10 Euler "
        f"steps: max |difference| {error:.3g} (mel scale {float(whole.abs().max()):.3g}), "
        f"{time.perf_counter() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
