"""Graph-level timing of one synthesis on ONNX Runtime vs TensorRT (called by scripts/gpu_check.sh).

Runs the five graphs the way one utterance does (LLM prefill + one decode step per speech token,
flow encoder + 10 CFG estimator steps, HiFT) on random inputs of realistic lengths, after a warm-up,
and prints time to first audio (the first 25-token chunk through every stage), real-time factor,
device memory and, for TensorRT, device memory per execution context (one slot of every graph:
activation memory it holds after the run plus its preallocated I/O buffers; the issue-19 goal is
<= 0.5 GB at full size). It times the graphs, not the pipeline's overlap of stages, so it is an upper
bound on TTFA and RTF.

    python bench/gpu_check.py --ort ENGINES_DIR --trt ENGINES_DIR [--seconds 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from trt_cosy.runtime.backends.base import Runner
from trt_cosy.runtime.manifest import model_config_from_dict

TOKEN_RATE = 25  # speech tokens per second (CosyVoice2)
FIRST_CHUNK_TOKENS = 25
CFM_STEPS = 10


def _config(engines: Path):
    return model_config_from_dict(json.loads((engines / "model_config.json").read_text(encoding="utf-8")))


def _llm(runner: Runner, config, prompt: int, tokens: int, rng: np.random.Generator) -> list[float]:
    """Seconds at which each speech token is ready (prefill of ``prompt`` positions, then decode)."""
    qwen = config.llm.qwen
    cache = np.zeros(
        (qwen.num_layers, 1, qwen.num_kv_heads, 0, qwen.head_dim), np.float32
    )  # [L, 1, H, 0, Dh]
    embeds = rng.standard_normal((1, prompt, qwen.hidden_size), dtype=np.float32)  # [1, T, D]
    start, ready = time.perf_counter(), []
    keys, values = cache, cache
    for _ in range(tokens):
        out = runner.infer({"inputs_embeds": embeds, "past_keys": keys, "past_values": values})
        keys, values = out["present_keys"], out["present_values"]
        embeds = rng.standard_normal((1, 1, qwen.hidden_size), dtype=np.float32)  # [1, 1, D]
        ready.append(time.perf_counter() - start)
    return ready


def _flow(runners: Mapping[str, Runner], config, tokens: int, rng: np.random.Generator) -> float:
    start = time.perf_counter()
    flow = config.flow
    out = runners["flow_encoder"].infer(
        {
            "tokens": rng.integers(0, flow.vocab_size, (1, tokens), dtype=np.int64),  # [1, N]
            "context": rng.integers(0, flow.vocab_size, (1, flow.encoder.pre_lookahead_len), dtype=np.int64),
            "context_valid": np.ones(1, np.float32),
            "streaming": np.zeros(1, np.float32),
            "embedding": rng.standard_normal((1, flow.spk_embed_dim), dtype=np.float32),
        }
    )
    mu = out["mu"]  # [1, 80, F]
    frames = mu.shape[2]
    feed = {
        "x": rng.standard_normal((2, mu.shape[1], frames), dtype=np.float32),
        "mask": np.ones((2, 1, frames), np.float32),
        "mu": np.concatenate([mu, np.zeros_like(mu)]),
        "spks": np.zeros((2, mu.shape[1]), np.float32),
        "cond": np.zeros((2, mu.shape[1], frames), np.float32),
    }
    for step in range(CFM_STEPS):
        feed["t"] = np.full(2, step / CFM_STEPS, np.float32)
        velocity = runners["flow_estimator"].infer(feed)["estimator_out"]  # [2, 80, F]
        feed["x"] = feed["x"] + 0.1 * velocity
    return time.perf_counter() - start


def _hift(runner: Runner, config, frames: int, rng: np.random.Generator) -> float:
    hop, harmonics = config.hift.samples_per_frame, config.hift.nb_harmonics + 1
    start = time.perf_counter()
    runner.infer(
        {
            "mel": rng.standard_normal((1, config.hift.in_channels, frames), dtype=np.float32) - 5.0,
            "sine_noise": rng.standard_normal((1, hop * frames, harmonics), dtype=np.float32),
            "cache_source": np.zeros((1, 1, 0), np.float32),
        }
    )
    return time.perf_counter() - start


def measure(runners: Mapping[str, Runner], config, seconds: float) -> dict[str, float]:
    """TTFA and RTF of one ``seconds``-long utterance (after one warm-up pass)."""
    rng = np.random.default_rng(0)
    tokens, ratio = int(seconds * TOKEN_RATE), config.token_mel_ratio
    for _ in range(2):  # the first pass warms up (lazy init, autotuning caches); the second is timed
        ready = _llm(runners["llm"], config, prompt=120, tokens=tokens, rng=rng)
        first_flow = _flow(runners, config, FIRST_CHUNK_TOKENS, rng)
        first_hift = _hift(runners["hift"], config, FIRST_CHUNK_TOKENS * ratio, rng)
        full_flow = _flow(runners, config, tokens, rng)
        full_hift = _hift(runners["hift"], config, tokens * ratio, rng)
    ttfa = ready[FIRST_CHUNK_TOKENS - 1] + first_flow + first_hift
    total = ready[-1] + full_flow + full_hift
    return {
        "ttfa_s": ttfa,
        "rtf": total / seconds,
        "llm_tok_s": tokens / ready[-1],
        "flow_s": full_flow,
        "hift_s": full_hift,
    }


def _device_used() -> int | None:
    try:
        from trt_cosy.runtime.backends.tensorrt.cuda import memory_info

        free, total = memory_info()
        return total - free
    except Exception:
        return None


def context_memory(runners: Mapping[str, Runner]) -> dict[str, dict[str, int]] | None:
    """Per graph, the device bytes of its first execution context (``TrtRunner.device_memory``);
    None for runners without device contexts (ONNX Runtime)."""
    report = {}
    for name, runner in runners.items():
        memory = getattr(runner, "device_memory", None)
        if memory is None:
            return None
        report[name] = memory()[0]
    return report


def _run(label: str, loader: Callable[[], Mapping[str, Runner]], config, seconds: float) -> dict:
    """Load, measure, and report the device memory the backend added (None when CUDA is absent)."""
    before = _device_used()
    runners = loader()
    print(f"loaded {label}; timing a {seconds:.0f} s utterance", file=sys.stderr)
    row = {"backend": label, **measure(runners, config, seconds)}
    after = _device_used()
    row["device_mb"] = None if before is None or after is None else round((after - before) / 2**20)
    contexts = context_memory(runners)
    row["context_graphs"] = contexts
    row["context_mb"] = (
        None if contexts is None else round(sum(m["total"] for m in contexts.values()) / 2**20)
    )
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ort", type=Path, help="onnxruntime engines directory")
    parser.add_argument("--trt", type=Path, help="tensorrt engines directory (plans built)")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = []
    if args.ort:
        from trt_cosy.runtime.engines import load_engines

        rows.append(
            _run("onnxruntime", lambda: load_engines(args.ort).runners, _config(args.ort), args.seconds)
        )
        rows[-1]["device_mb"] = rows[-1]["context_mb"] = None  # ORT runs on the CPU here
    if args.trt:
        from trt_cosy.runtime.backends.tensorrt.runner import load_plan_runners

        rows.append(_run("tensorrt", lambda: load_plan_runners(args.trt), _config(args.trt), args.seconds))
    print(
        f"{'model':<6} {'backend':<12} {'TTFA s':>8} {'RTF':>7} {'LLM tok/s':>10} {'flow s':>7} {'hift s':>7} "
        f"{'dev MB':>8} {'ctx MB':>8}"
    )
    for row in rows:
        mem = "-" if row["device_mb"] is None else str(row["device_mb"])
        ctx = "-" if row.get("context_mb") is None else str(row["context_mb"])
        print(
            f"{args.label:<6} {row['backend']:<12} {row['ttfa_s']:>8.3f} {row['rtf']:>7.3f} "
            f"{row['llm_tok_s']:>10.1f} {row['flow_s']:>7.3f} {row['hift_s']:>7.3f} {mem:>8} {ctx:>8}"
        )
        for graph, memory in (row.get("context_graphs") or {}).items():
            print(
                f"    {graph:<22} activations {memory['activations'] / 2**20:8.1f} MiB "
                f"(largest profile {memory['activations_max'] / 2**20:8.1f}), I/O {memory['io'] / 2**20:8.1f} MiB"
            )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
