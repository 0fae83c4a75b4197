"""Batched decode step time of ``llm_batch`` graph variants, in one process, variants alternating.

    python tools/experiments/decode/llm_step_variants.py --config ENGINES/model_config.json \
        --variant base=ENGINES/llm_batch.onnx --variant acc1=/tmp/x.onnx \
        [--variant spin0=ENGINES/llm_batch.onnx,session.intra_op.allow_spinning=0] \
        [--batches 1,2,4,8] [--rounds 5] [--steps 8] [--cached 150] [--capacity 2048] [--threads 2] \
        [--profile DIR] [--json out.json]

Each variant is ``LABEL=PATH`` with optional ``,KEY=VALUE`` session config entries. Every variant
runs through ``OrtBatchLLM`` over ``KVSlots`` (the shared decode loop's code path; rows hold
``--cached`` random cached positions in slots of ``--capacity``). Per batch size and round, the
variants take turns (order rotated each round); a round times ``--steps`` steps after one warm-up
step and keeps their median; the figure reported is the median over rounds. ``4 x B1 / B4`` is the
tokens per second of a batch of 4 against batch 1 (the ceiling of "c = 4 vs c = 1" for the decode).

``--profile DIR``: afterwards, per variant and batch size, a fresh session with ONNX Runtime's
profiler runs ``--steps`` steps; prints the kernel time per step by op type (and the MatMulNBits
nodes by weight shape), and writes the per-op table to the JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from trt_cosy.runtime.backends.onnxruntime.batch import OrtBatchLLM
from trt_cosy.runtime.kv_slots import KVSlots, PrefillCache
from trt_cosy.runtime.manifest import model_config_from_dict


class _Runner:
    """The three attributes ``OrtBatchLLM`` reads from an ``OrtRunner``."""

    def __init__(self, name: str, session: ort.InferenceSession):
        self.name, self.session = name, session
        self.input_names = [i.name for i in session.get_inputs()]


def _session(path: str, entries: dict[str, str], threads: int, profile: str | None = None):
    options = ort.SessionOptions()  # as OrtRunner.from_path, plus the variant's config entries
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    for key, value in entries.items():
        options.add_session_config_entry(key, value)
    if profile is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile
    return ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])


def _parse_variant(text: str) -> tuple[str, str, dict[str, str]]:
    label, _, rest = text.partition("=")
    path, *pairs = rest.split(",")
    return label, path, dict(pair.split("=", 1) for pair in pairs)


class _Bench:
    def __init__(self, config, capacity: int, cached: int, rng: np.random.Generator):
        self.config, self.capacity, self.cached, self.rng = config, capacity, cached, rng
        self.qwen = config.llm.qwen

    def stepper(self, session: ort.InferenceSession, batch: int):
        qwen = self.qwen
        slots = KVSlots(batch, qwen.num_layers, qwen.num_kv_heads, self.capacity, qwen.head_dim)
        cache = PrefillCache(qwen.num_layers, qwen.num_kv_heads, self.cached, qwen.head_dim)
        for part in (*cache.keys, *cache.values):
            part[:] = self.rng.standard_normal(part.shape)
        for _ in range(batch):
            slots.add(cache)
        model = OrtBatchLLM(_Runner("llm_batch", session), qwen.num_layers)
        stepper = model.decoder(slots, self.config.llm.speech_vocab_size)
        inputs = self.rng.standard_normal((batch, 1, self.config.llm.llm_input_size)).astype(
            np.float32
        )  # [B, 1, D]

        def step() -> None:
            stepper.step(inputs)
            slots.lengths[:batch] -= 1  # stay at `cached` positions

        return step


def _time_steps(step, steps: int) -> float:
    step()  # warm
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _profile(
    bench: _Bench, path: str, entries: dict, threads: int, batch: int, steps: int, prefix: str
) -> dict:
    session = _session(path, entries, threads, profile=prefix)
    step = bench.stepper(session, batch)
    for _ in range(3):  # warm (kept out of the totals below by dividing by all runs: see `runs`)
        step()
    for _ in range(steps):
        step()
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = steps + 3
    by_type: dict[str, float] = defaultdict(float)
    by_node: dict[str, float] = defaultdict(float)
    total = 0.0
    for event in events:
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        args = event.get("args", {})
        by_type[args.get("op_name", "?")] += event["dur"]
        by_node[event["name"].removesuffix("_kernel_time")] += event["dur"]
        total += event["dur"]
    return {
        "kernel_ms_per_step": total / runs / 1e3,
        "by_op_type_ms": {k: v / runs / 1e3 for k, v in sorted(by_type.items(), key=lambda kv: -kv[1])},
        "by_node_ms": {k: v / runs / 1e3 for k, v in by_node.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="the engines' model_config.json")
    parser.add_argument("--variant", action="append", required=True, help="LABEL=PATH[,KEY=VALUE...]")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cached", type=int, default=150)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", type=Path, default=None, help="folder for ORT profiles")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    config = model_config_from_dict(json.loads(args.config.read_text()))
    batches = [int(b) for b in args.batches.split(",")]
    variants = [_parse_variant(text) for text in args.variant]
    bench = _Bench(config, args.capacity, args.cached, np.random.default_rng(0))
    sessions = {label: _session(path, entries, args.threads) for label, path, entries in variants}
    medians: dict[str, dict[int, list[float]]] = {label: defaultdict(list) for label, _, _ in variants}
    for batch in batches:
        steppers = {label: bench.stepper(sessions[label], batch) for label in sessions}
        for round_ in range(args.rounds):
            order = list(steppers)
            order = order[round_ % len(order) :] + order[: round_ % len(order)]
            for label in order:
                medians[label][batch].append(_time_steps(steppers[label], args.steps) * 1e3)
        del steppers
        line = "  ".join(f"{label} {np.median(medians[label][batch]):.2f}" for label in sessions)
        print(f"B={batch}: step ms (median of {args.rounds} rounds)  {line}", flush=True)
    out: dict = {
        "command": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "step_ms": {},
    }
    print("\nvariant  " + "  ".join(f"B{b:<6d}" for b in batches) + "  4xB1/B4  8xB1/B8")
    for label in sessions:
        row = {b: float(np.median(medians[label][b])) for b in batches}
        out["step_ms"][label] = {"median": row, "rounds": {b: medians[label][b] for b in batches}}
        ratios = [f"{n * row[1] / row[n]:.2f}x" if 1 in row and n in row else "-" for n in (4, 8)]
        print(f"{label:8s} " + "  ".join(f"{row[b]:6.2f}" for b in batches) + "  " + "  ".join(ratios))
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        out["profile"] = {}
        for label, path, entries in variants:
            for batch in batches:
                prefix = str(args.profile / f"{label}-B{batch}")
                table = _profile(bench, path, entries, args.threads, batch, args.steps, prefix)
                out["profile"][f"{label}/B{batch}"] = table
                top = ", ".join(f"{k} {v:.2f}" for k, v in list(table["by_op_type_ms"].items())[:8])
                print(f"profile {label} B={batch}: kernels {table['kernel_ms_per_step']:.2f} ms/step: {top}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
