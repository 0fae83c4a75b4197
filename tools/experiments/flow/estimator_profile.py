"""Per-op-type kernel time of estimator graphs on the same frames (ONNX Runtime profiling).

    python tools/experiments/flow/estimator_profile.py --past 600 --new 200 --runs 2 --threads 2 \\
        before=/tmp/incflow-int4/flow_estimator_incremental.onnx after=NEW.onnx \\
        stream=/tmp/incflow-int4/flow_estimator_stream.onnx

Each ``label=graph`` is an incremental estimator (contract ``FLOW_ESTIMATOR_INCREMENTAL``: fed
``--new`` new frames and ``--past`` cached frames of random block inputs) or, where its inputs
hold a ``mask``, a recomputing estimator fed all ``past + new`` frames. Random feeds of the full-size
CosyVoice2 layout are read from the graph's declared shapes. The graphs run in turn (alternating,
after one warm-up call each); printed per graph: the median wall seconds of a call and the kernel
seconds per call summed per op type (the profile's ``*_kernel_time`` events, warm-up included in
the average), largest first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort


def _feeds(session: ort.InferenceSession, past: int, new: int, rng: np.random.Generator) -> dict:
    inputs = {node.name: node.shape for node in session.get_inputs()}
    recompute = "mask" in inputs
    frames = past + new if recompute else new
    feed = {
        name: rng.standard_normal((2, 80, frames), dtype=np.float32) for name in ("x", "mu", "cond")
    }  # [2, 80, F]
    feed["t"] = np.full(2, 0.3, np.float32)  # [2]
    feed["spks"] = rng.standard_normal((2, 80), dtype=np.float32)  # [2, 80]
    if recompute:
        feed["mask"] = np.ones((2, 1, frames), np.float32)  # [2, 1, F]
    else:
        _, blocks, rows, width = inputs["past_blocks"]
        feed["past_blocks"] = rng.standard_normal(
            (past, blocks, rows, width), dtype=np.float32
        )  # [P, L, 2, D]
        feed["past_tails"] = rng.standard_normal(tuple(inputs["past_tails"]), dtype=np.float32)  # [2, C, 2]
    return feed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("graphs", nargs="+", help="label=path.onnx")
    parser.add_argument("--past", type=int, default=600)
    parser.add_argument("--new", type=int, default=200)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    sessions = {}
    for item in args.graphs:
        label, path = item.split("=", 1)
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        options.enable_profiling = True
        options.profile_file_prefix = f"estimator-profile-{label}"
        session = ort.InferenceSession(str(Path(path)), options, providers=["CPUExecutionProvider"])
        feed = _feeds(session, args.past, args.new, rng)
        session.run(None, feed)  # warm-up
        sessions[label] = (session, feed)
    walls: dict[str, list[float]] = defaultdict(list)
    for _ in range(args.runs):
        for label, (session, feed) in sessions.items():
            start = time.perf_counter()
            session.run(None, feed)
            walls[label].append(time.perf_counter() - start)
    for label, (session, _) in sessions.items():
        profile = Path(session.end_profiling())
        totals: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)
        calls = 0
        for event in json.loads(profile.read_text(encoding="utf-8")):
            if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
                totals[event["args"]["op_name"]] += event["dur"] / 1e6
                counts[event["args"]["op_name"]] += 1
            elif event.get("cat") == "Session" and event["name"] == "model_run":
                calls += 1
        profile.unlink()
        total = sum(totals.values()) / calls
        print(
            f"== {label} (past {args.past}, new {args.new}): wall median "
            f"{statistics.median(walls[label]):.3f} s, kernels {total:.3f} s per call"
        )
        for op, seconds in sorted(totals.items(), key=lambda item: -item[1])[: args.top]:
            share = 100 * seconds / calls / total
            print(f"  {op:26s} {seconds / calls:7.3f} s {share:5.1f} %  {counts[op] // calls} nodes")


if __name__ == "__main__":
    main()
