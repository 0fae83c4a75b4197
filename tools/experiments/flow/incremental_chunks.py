"""Incremental streaming chunks against recomputed ones on tiny engines of every CPU backend.

    python tools/experiments/flow/incremental_chunks.py RELEASE OUT_DIR

RELEASE: the golden tiny CosyVoice2 release (tests/_support.py ``tiny_release``: the golden checkpoint
plus the tokenizer and stand-in frontend models). Builds mixed fp32/int4, OpenVINO fp32/bf16 and ONNX
Runtime fp32 engines into OUT_DIR, then prints, per engines and schedule, the max |mel difference| per
chunk of the incremental chunks against the same engines' recomputed ones and of both against ONNX
Runtime fp32 recomputation, and the worst `verify` stream rows with and without the incremental graph
(docs/benchmarks.md, "Mixed engines with the incremental streaming estimator").
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np

from trt_cosy.builder.engines import build_engines
from trt_cosy.runtime import graphs
from trt_cosy.runtime.engines import load_engines
from trt_cosy.stages.flow import FlowStage
from trt_cosy.streaming import FAST_SCHEDULE, OFFICIAL_SCHEDULE, hop_schedule
from trt_cosy.verify import run_verify
from trt_cosy.verify.golden import GoldenSet

ENGINES = (
    ("mixed", "fp32"),
    ("mixed", "int4"),
    ("openvino", "fp32"),
    ("openvino", "bf16"),
    ("onnxruntime", "fp32"),
)
INCREMENTAL = graphs.FLOW_ESTIMATOR_INCREMENTAL.name
GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "data" / "cosyvoice2-tiny" / "reference.npz"


def _flow(model, incremental: bool) -> FlowStage:
    runners = model.runners
    return FlowStage(
        runners[graphs.FLOW_ENCODER.name],
        runners[graphs.FLOW_ESTIMATOR.name],
        runners[graphs.FLOW_ESTIMATOR_STREAM.name],
        model.flow_noise,
        model.config.flow,
        incremental_runner=runners[INCREMENTAL] if incremental else None,
        voice_slots=0,
    )


def _chunks(model, reference, golden: GoldenSet, schedule: str) -> list[tuple[float, float, float]]:
    """Per chunk: max |inc - recomputed|, max |recomputed - fp32|, max |inc - fp32| (mel)."""
    meta = golden.meta["streampad"]
    prompt_tokens = meta["prompt_tokens"]
    prompt = (
        golden["in_prompt_speech_token"][:, :prompt_tokens].astype(np.int64),  # [1, P]
        golden["in_prompt_feat"][:, : meta["prompt_feat_frames"]],  # [1, 2P, 80]
        golden["in_spk_embedding"],  # [1, 192]
    )
    tokens = np.random.default_rng(0).integers(0, model.config.flow.vocab_size, (1, 330))  # [1, N]
    recompute, incremental, fp32 = _flow(model, False), _flow(model, True), _flow(reference, False)
    cache = incremental.new_cache()
    rows = []
    for plan in hop_schedule(prompt_tokens, True, 25, 3, schedule).plan_all(tokens.shape[1]):
        args = (tokens[:, : plan.end], *prompt)
        want = recompute.token2mel(*args, streaming=plan.streaming, finalize=plan.final).mel
        got = incremental.token2mel(*args, streaming=plan.streaming, finalize=plan.final, cache=cache).mel
        exact = fp32.token2mel(*args, streaming=plan.streaming, finalize=plan.final).mel
        rows.append(tuple(float(np.abs(a - b).max()) for a, b in ((got, want), (want, exact), (got, exact))))
    return rows


def main() -> None:
    release, root = Path(sys.argv[1]), Path(sys.argv[2])
    golden = GoldenSet.load(GOLDEN)
    built = {
        (backend, precision): build_engines(
            release, root / f"{backend}-{precision}", backend=backend, precision=precision
        )
        for backend, precision in ENGINES
    }
    reference = load_engines(built["onnxruntime", "fp32"], threads=1)
    for key, path in built.items():
        model = load_engines(path, threads=1, backend="auto")
        for schedule in (OFFICIAL_SCHEDULE, FAST_SCHEDULE):
            rows = _chunks(model, reference, golden, schedule)
            for label, column in (("inc vs recomputed", 0), ("recomputed vs fp32", 1), ("inc vs fp32", 2)):
                print(key, schedule, label, " ".join(f"{row[column]:.1e}" for row in rows), flush=True)
        for use in (False, True):
            runners = model.runners if use else {k: v for k, v in model.runners.items() if k != INCREMENTAL}
            rows = [
                row
                for row in run_verify(dataclasses.replace(model, runners=runners), golden)
                if row.key.startswith(("stream_", "streampad_"))
            ]
            worst: dict[str, float] = {}
            for row in rows:
                if row.max_abs_err is not None:
                    kind = row.key.split("_", 2)[-1]
                    worst[kind] = max(worst.get(kind, 0.0), row.max_abs_err)
            failed = sum(row.status not in ("ok", "skipped") for row in rows)
            summary = ", ".join(f"{kind} {value:.2e}" for kind, value in worst.items())
            print(
                key,
                "incremental" if use else "recomputed",
                f"{len(rows)} stream rows, {failed} not ok: {summary}",
            )


if __name__ == "__main__":
    main()
