"""A/B of engines directories in one process, alternating run by run (for speed claims on a noisy machine).

    python bench/ab_engines.py /tmp/perf-full/int4-old /tmp/perf-full/int4-new --runs 4 --json ab.json

The machine's speed drifts by 10-15 % over minutes when it is shared, so two ``trt-cosy bench``
runs taken one after the other can disagree by more than the change being measured. This loads
every directory once, then runs the benchmark's scenario (``trt_cosy.bench.speed``: prefill, 250
greedy tokens, non-streaming flow, HiFT) on each in turn, one warm-up round and ``--runs`` timed
rounds, and prints the per-directory medians. Same seed and inputs for every directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from trt_cosy.bench.speed import BenchOptions, _inputs, _one_run, _Stages
from trt_cosy.runtime.engines import load_engines

SHOWN = ("llm_decode_tokens_per_s", "llm_s", "flow_s", "hift_s", "rtf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engines", nargs="+", type=Path, help="engines directories to compare")
    parser.add_argument("--runs", type=int, default=4, help="timed rounds after one warm-up round")
    parser.add_argument("--tokens", type=int, default=BenchOptions.tokens)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write every run's metrics here")
    args = parser.parse_args(argv)
    options = BenchOptions(tokens=args.tokens, threads=args.threads)
    setups = []
    for directory in args.engines:
        model = load_engines(directory, threads=args.threads, backend="auto")
        setups.append((_Stages(model), _inputs(model, directory, options)))
    runs: dict[str, list[dict[str, float]]] = {str(d): [] for d in args.engines}
    for round_index in range(args.runs + 1):
        for directory, (stages, inputs) in zip(args.engines, setups, strict=True):
            result = _one_run(stages, inputs, options, np.random.default_rng(options.seed))
            label = "warm-up" if round_index == 0 else f"run {round_index}/{args.runs}"
            shown = ", ".join(f"{key} {result[key]:.3g}" for key in SHOWN)
            print(f"{label} {directory}: {shown}", flush=True)
            if round_index:
                runs[str(directory)].append(result)
    for directory, results in runs.items():
        medians = {key: statistics.median(run[key] for run in results) for key in SHOWN}
        print(f"median {directory}: " + ", ".join(f"{key} {value:.3g}" for key, value in medians.items()))
    if args.json is not None:
        args.json.write_text(json.dumps(runs, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
