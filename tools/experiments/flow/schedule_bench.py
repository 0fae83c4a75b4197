"""Compute of one streaming segment under each schedule, against not streaming (flow + vocoder).

    python tools/experiments/flow/schedule_bench.py --engines /tmp/perf-full/int4 --threads 2 --ref-seconds 5 \\
        --segment-seconds 15 --runs 2 [--json out.json]

The cost of streaming is the flow and vocoder calls a schedule makes for a segment whose speech
tokens are all known: the LLM decodes the same tokens whatever the schedule, so it is left out.
For a synthetic voice of ``--ref-seconds`` (25 prompt tokens and 50 prompt mel frames a second)
and ``--segment-seconds`` of random speech tokens, each run times, in turn (alternating, so that
the machine's load affects each alike): ``none`` (one full-attention call, what
``stream=False`` does), ``official`` (trt_cosy.streaming.HopSchedule: hops 25 + pad, 50, 100, ...,
then a full-attention call) and ``fast`` (hops doubling without the cap, chunk attention to the
end). Printed per schedule: medians of the total seconds, the ratio to ``none``, the first chunk's
seconds (flow + vocoder, no LLM), the number of calls, and the mel difference to ``official`` (to
the first mode where ``--modes`` leaves it out; max and mean absolute, natural-log mel) of the
frames the schedule emits; then the peak RSS.

Engines with ``flow_estimator_incremental.onnx`` also run ``official+inc`` and ``fast+inc``: the same
schedules with the incremental flow (``trt_cosy.stages.flow_incremental``: each chunk computes its
new frames only), and print the largest flow cache the segment held. ``--incremental-b GRAPH``
adds ``official+inc-b`` and ``fast+inc-b``: the same with another build of that graph (e.g. before
and after a graph rewrite), alternating in the same process.

CosyVoice2 and CosyVoice3 engines (v3: its vocoder re-renders the whole mel so far at every chunk,
as the official ``CosyVoice3Model.token2wav`` does).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from pathlib import Path

import numpy as np

from trt_cosy.runtime import graphs
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.engines import load_engines
from trt_cosy.stages.flow import FlowStage
from trt_cosy.stages.vocoder import VocoderCache, VocoderStage
from trt_cosy.streaming import FAST_SCHEDULE, OFFICIAL_SCHEDULE, ChunkPlan, hop_schedule

SCHEDULES = ("none", OFFICIAL_SCHEDULE, FAST_SCHEDULE)
INCREMENTAL = "+inc"  # suffix of the modes that run a schedule with the incremental flow
INCREMENTAL_B = "+inc-b"  # the same with the graph of --incremental-b


def _plans(schedule: str, prompt: int, total: int, chunk: int, lookahead: int) -> list[ChunkPlan]:
    if schedule == "none":
        return [ChunkPlan(end=total, offset=0, final=True)]
    return hop_schedule(prompt, True, chunk, lookahead, schedule).plan_all(total)


def _v3_vocoder(model):
    """CosyVoice3's vocoder behind the CosyVoice2 ``render(mel, rng, cache, final)`` call of ``_run``."""
    from trt_cosy.models.v3.stages import V3VocoderCache, V3VocoderStage

    stage = V3VocoderStage(
        model.runners["hift"], model.runners["hift_stream"], model.hift_noise, model.config.hift
    )

    class _Vocoder:
        new_cache = V3VocoderCache

        @staticmethod
        def render(mel, rng, cache, final):
            return stage.render(mel, cache, final=final)

    return _Vocoder()


def _run(flow, vocoder, inputs, plans, ratio, incremental: bool = False) -> dict:
    tokens, prompt_tokens, prompt_mel, embedding = inputs
    new_cache = getattr(vocoder, "new_cache", VocoderCache)
    rng, cache, mels, seconds = np.random.default_rng(0), new_cache(), [], []
    flow_cache = flow.new_cache() if incremental else None
    held = 0
    for plan in plans:
        start = time.perf_counter()
        mel = flow.token2mel(
            tokens[:, : plan.end],
            prompt_tokens,
            prompt_mel,
            embedding,
            streaming=plan.streaming,
            finalize=plan.final,
            cache=flow_cache,
        ).mel[:, :, ratio * plan.offset :]  # [1, 80, F]
        held = max(held, 0 if flow_cache is None else flow_cache.nbytes)
        vocoder.render(mel, rng, cache, final=plan.final)
        seconds.append(time.perf_counter() - start)
        mels.append(mel)
    return {
        "total_s": sum(seconds),
        "first_s": seconds[0],
        "calls": len(plans),
        "mel": np.concatenate(mels, 2),
        "cache_bytes": held,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--ref-seconds", type=float, default=5.0)
    parser.add_argument("--segment-seconds", type=float, default=15.0)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--modes", default=None, help="Comma-separated subset of the modes (default: all).")
    parser.add_argument(
        "--incremental-b",
        type=Path,
        default=None,
        help="Another flow_estimator_incremental.onnx, run as the modes official+inc-b and fast+inc-b.",
    )
    args = parser.parse_args()

    model = load_engines(args.engines, threads=args.threads, backend="auto")  # ONNX Runtime, OpenVINO or mixed
    config = model.config
    runners = model.runners
    flow = FlowStage(
        runners[graphs.FLOW_ENCODER.name],
        runners[graphs.FLOW_ESTIMATOR.name],
        runners[graphs.FLOW_ESTIMATOR_STREAM.name],
        model.flow_noise,
        config.flow,
        incremental_runner=runners.get(graphs.FLOW_ESTIMATOR_INCREMENTAL.name),
    )
    if config.family == "v3":
        vocoder = _v3_vocoder(model)
    else:
        vocoder = VocoderStage(runners[graphs.HIFT.name], config.hift)
    rng = np.random.default_rng(1)
    prompt = round(args.ref_seconds * 25)
    total = round(args.segment_seconds * 25)
    inputs = (
        rng.integers(0, config.flow.vocab_size, (1, total)),  # [1, N]
        rng.integers(0, config.flow.vocab_size, (1, prompt)),  # [1, P]
        rng.normal(-5.0, 2.0, (1, 2 * prompt, config.flow.output_size)).astype(np.float32),  # [1, 2P, 80]
        rng.standard_normal((1, config.flow.spk_embed_dim)).astype(np.float32),  # [1, 192]
    )
    encoder = config.flow.encoder
    plans = {
        name: _plans(name, prompt, total, config.chunk_size, encoder.pre_lookahead_len) for name in SCHEDULES
    }
    modes = list(SCHEDULES)
    if flow.incremental_runner is not None:
        modes += [OFFICIAL_SCHEDULE + INCREMENTAL, FAST_SCHEDULE + INCREMENTAL]
        plans |= {name + INCREMENTAL: plans[name] for name in (OFFICIAL_SCHEDULE, FAST_SCHEDULE)}
    incremental_runners = {INCREMENTAL: flow.incremental_runner}
    if args.incremental_b is not None:
        incremental_runners[INCREMENTAL_B] = OrtRunner.from_path(
            args.incremental_b, graphs.FLOW_ESTIMATOR_INCREMENTAL.name, threads=args.threads
        )
        modes += [OFFICIAL_SCHEDULE + INCREMENTAL_B, FAST_SCHEDULE + INCREMENTAL_B]
        plans |= {name + INCREMENTAL_B: plans[name] for name in (OFFICIAL_SCHEDULE, FAST_SCHEDULE)}
    if args.modes is not None:  # mel differences against official, or the first mode without it
        modes = [name for name in modes if name in args.modes.split(",")]
    # Warm up both estimator graphs and the vocoder on the first chunk's tokens (cheap).
    first = plans[OFFICIAL_SCHEDULE][0]
    _run(flow, vocoder, inputs, [first], config.token_mel_ratio)
    _run(flow, vocoder, inputs, [ChunkPlan(end=first.end, offset=0, final=True)], config.token_mel_ratio)
    for runner in incremental_runners.values():
        if runner is not None:
            flow.incremental_runner = runner
            _run(flow, vocoder, inputs, [first], config.token_mel_ratio, incremental=True)
    runs: dict[str, list[dict]] = {name: [] for name in modes}
    for index in range(args.runs):
        for name in modes:
            suffix = next((key for key in (INCREMENTAL_B, INCREMENTAL) if name.endswith(key)), None)
            if suffix is not None:
                flow.incremental_runner = incremental_runners[suffix]
            result = _run(flow, vocoder, inputs, plans[name], config.token_mel_ratio, suffix is not None)
            runs[name].append(result)
            per_call = " ".join(f"{value:.1f}" for value in result["seconds"])
            print(
                f"run {index + 1} {name}: {result['total_s']:.2f} s in {result['calls']} calls ({per_call})",
                flush=True,
            )
    reference = OFFICIAL_SCHEDULE if OFFICIAL_SCHEDULE in runs else modes[0]
    official = runs[reference][0]["mel"]
    base = statistics.median(run["total_s"] for run in runs["none"]) if runs.get("none") else float("nan")
    summary = {}
    for name in modes:
        mel = runs[name][0]["mel"]
        difference = np.abs(mel - official)
        summary[name] = {
            "total_s": statistics.median(run["total_s"] for run in runs[name]),
            "first_chunk_s": statistics.median(run["first_s"] for run in runs[name]),
            "calls": runs[name][0]["calls"],
            "ends": [plan.end for plan in plans[name]],
            "mel_max_abs_diff_vs_official": float(difference.max()),
            "mel_mean_abs_diff_vs_official": float(difference.mean()),
            "cache_mib": runs[name][0]["cache_bytes"] / 2**20,
        }
        summary[name]["ratio_to_none"] = summary[name]["total_s"] / base
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2
    print(f"prompt {prompt} tokens, segment {total} tokens, threads {args.threads}, peak RSS {peak:.2f} GB")
    for name, row in summary.items():
        print(
            f"{name:>13}: total {row['total_s']:.2f} s ({row['ratio_to_none']:.2f}x), first chunk "
            f"{row['first_chunk_s']:.2f} s, {row['calls']} calls, mel vs {reference} max "
            f"{row['mel_max_abs_diff_vs_official']:.3g} mean {row['mel_mean_abs_diff_vs_official']:.3g}, "
            f"flow cache {row['cache_mib']:.0f} MiB"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps({"summary": summary, "peak_rss_gb": peak}, indent=1), encoding="utf-8"
        )


if __name__ == "__main__":
    main()
