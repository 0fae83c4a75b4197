"""Check that `trt-cosy verify` runs unchanged on a full-size checkpoint, and measure it.

There is no official full-size golden file here (real weights cannot be downloaded), so this
script writes a golden-format file for a full-size random checkpoint with the *full-size scenario
of the golden README §2.5* (16+24 text tokens, 50-token prompt, 100 targets, 37-token padded
prompt, 200 synthetic frames) whose expected outputs come from our own torch reference. Running
`trt-cosy verify` on it then exercises exactly the code path a user runs on a real release with
the official full-size reference, and reports time and peak memory. It is a smoke/measurement
tool, not a parity check (parity is checked on the official tiny golden set in the tests).

    python bench/full_size_verify.py --work /tmp/trt-cosy-full
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _scenarios() -> dict[str, dict]:
    def chunk(n, offset, streaming, finalize):
        return {"n_tokens_to_flow": n, "token_offset": offset, "flow_streaming": streaming, "flow_finalize": finalize}

    return {
        "nonstream": {"prompt_tokens": 50, "prompt_feat_frames": 100, "chunks": [chunk(50, 0, False, True)]},
        "stream": {
            "prompt_tokens": 50,
            "prompt_feat_frames": 100,
            "chunks": [chunk(28, 0, True, False), chunk(78, 25, True, False), chunk(100, 75, False, True)],
        },
        "streampad": {
            "prompt_tokens": 37,
            "prompt_feat_frames": 74,
            "chunks": [chunk(41, 0, True, False), chunk(60, 38, False, True)],
        },
    }


def _inputs(rng: np.random.Generator, text_vocab: int) -> dict[str, np.ndarray]:
    return {
        "in_prompt_text": rng.integers(0, text_vocab, (1, 16)).astype(np.int32),
        "in_text": rng.integers(0, text_vocab, (1, 24)).astype(np.int32),
        "in_prompt_speech_token": rng.integers(0, 6561, (1, 50)).astype(np.int32),
        "in_target_speech_token": rng.integers(0, 6561, (1, 100)).astype(np.int32),
        "in_prompt_feat": rng.normal(-5.0, 2.0, (1, 100, 80)).astype(np.float32),
        "in_spk_embedding": rng.standard_normal((1, 192)).astype(np.float32),
        "in_hift_synth_mel": rng.normal(-5.0, 2.0, (1, 80, 200)).astype(np.float32),
    }


def make_golden(model_dir: Path, out: Path, n_forced: int = 8, greedy_steps: int = 100) -> None:
    from trt_cosy.builder.reference import load_torch_model
    from trt_cosy.verify.golden import GoldenSet
    from trt_cosy.verify.stages import run_flow, run_hift, run_llm

    model = load_torch_model(model_dir)
    rng = np.random.default_rng(20240601)
    arrays = _inputs(rng, min(2048, model.config.llm.qwen.vocab_size))
    width = model.config.llm.llm_input_size
    arrays["llm_tf_lm_input"] = np.zeros((1, 1 + 16 + 24 + 1 + 50 + n_forced, width), np.float32)
    arrays["llm_greedy_tokens"] = np.zeros(greedy_steps, np.int32)
    arrays["flow_rand_noise"] = model.flow_noise[:, :, :400]
    meta = {"scenario": "full-size self-reference (bench/full_size_verify.py)", **_scenarios()}
    arrays["hift_synth_sine_noise"] = rng.standard_normal((1, 200 * 480, 9)).astype(np.float16)
    for name, scenario in _scenarios().items():
        for index, chunk in enumerate(scenario["chunks"]):
            prefix = f"{name}_c{index}_"
            n, offset = chunk["n_tokens_to_flow"], chunk["token_offset"]
            arrays[prefix + "flow_tokens"] = arrays["in_target_speech_token"][:, :n]
            frames = 2 * (n if chunk["flow_finalize"] else n - 3) - 2 * offset + (8 if index else 0)
            arrays[prefix + "hift_sine_noise"] = rng.standard_normal((1, frames * 480, 9)).astype(np.float16)
    golden = GoldenSet(arrays, meta, out)
    outputs: dict = {}
    for run in (run_llm, run_flow):
        outputs.update(run(model, golden, {}))
    arrays.update(outputs)
    outputs = run_hift(model, GoldenSet(arrays, meta, out), {})
    arrays.update(outputs)
    np.savez(out, meta_json=np.array(json.dumps(meta)), **{k: np.asarray(v) for k, v in arrays.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/trt-cosy-full"))
    args = parser.parse_args()
    model_dir, golden = args.work / "model", args.work / "reference-self.npz"
    if not (model_dir / "llm.pt").is_file():
        subprocess.run([sys.executable, "-m", "trt_cosy.cli", "make-test-model", "--out", str(model_dir),
                        "--size", "full", "--overwrite"], check=True)
    if not golden.is_file():
        make_golden(model_dir, golden)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "trt_cosy.cli", "verify", "--model-dir", str(model_dir),
                             "--golden", str(golden), "--backend", "torch"], capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024**2
    print(result.stdout.splitlines()[-1] if result.stdout else result.stderr)
    print(f"verify on full size: exit {result.returncode}, {elapsed:.1f} s wall, peak RSS {peak_gb:.2f} GB")


if __name__ == "__main__":
    main()
