"""Does TensorRT tolerate two execution contexts running one optimization profile at once?

``NvInferRuntime.h`` (``class IExecutionContext``) says each context in concurrent use must use a
separate profile, so trt-cosy builds plans with their profiles once per slot. trtexec breaks that
rule, so it may work in practice; if it does on a given TensorRT, plans could be built with the
profiles once (faster builds, smaller plans). This builds a toy plan with ONE copy of the profiles,
puts two single-slot runners on the same engine (two contexts, same profiles), runs them from two
threads at lengths across both profiles, and counts outputs that differ from ONNX Runtime.
Informational: scripts/gpu_check.sh prints the line; nothing in trt-cosy relies on the answer.

    python tools/experiments/tensorrt/trt_shared_profile.py [--calls 200]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trt_cosy.builder.trt.plans import build_plan
from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
from trt_cosy.runtime.backends.tensorrt.runner import TrtRunner, load_tensorrt, shared_runtime
from trt_cosy.runtime.profiles import GraphProfiles, ShapeProfile

PROFILES = GraphProfiles(
    "toy",
    (
        ShapeProfile("short", {"x": ((1, 1, 256), (1, 64, 256), (1, 256, 256))}),
        ShapeProfile("long", {"x": ((1, 1, 256), (1, 1024, 256), (1, 4096, 256))}),
    ),
)


def _toy_graph(path: Path) -> Path:
    """x [1, T, 256] -> 4 x (MatMul + Tanh) -> y: enough work per launch for launches to overlap."""
    rng = np.random.default_rng(0)
    nodes, weights, current = [], [], "x"
    for layer in range(4):
        weights.append(
            numpy_helper.from_array((rng.standard_normal((256, 256)) / 16).astype(np.float32), f"w{layer}")
        )
        nodes += [
            helper.make_node("MatMul", [current, f"w{layer}"], [f"h{layer}"]),
            helper.make_node("Tanh", [f"h{layer}"], [f"y{layer}" if layer < 3 else "y"]),
        ]
        current = f"y{layer}"
    graph = helper.make_graph(
        nodes,
        "toy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 256])],
        weights,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="calls per thread")
    args = parser.parse_args(argv)
    trt = load_tensorrt()
    with tempfile.TemporaryDirectory() as work:
        source = _toy_graph(Path(work) / "toy.onnx")
        plan = build_plan(source, Path(work) / "toy.plan", PROFILES, slots=1)  # the profiles ONCE
        engine = shared_runtime(trt).deserialize_cuda_engine(plan.read_bytes())
        runners = [TrtRunner(engine, "toy", PROFILES, trt=trt) for _ in range(2)]  # 2 contexts, same profiles
        reference = OrtRunner.from_path(source, "toy")
        bad: list[str] = []

        def work_on(runner: TrtRunner, seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(args.calls):
                x = rng.standard_normal((1, int(rng.integers(1, 4097)), 256)).astype(np.float32)
                error = float(np.abs(runner.infer({"x": x})["y"] - reference.infer({"x": x})["y"]).max())
                if not error < 1e-3:
                    bad.append(f"thread {seed}: T={x.shape[1]} off by {error:.3g}")

        threads = [threading.Thread(target=work_on, args=(r, i)) for i, r in enumerate(runners)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for runner in runners:
            runner.free()
    verdict = "outputs all correct" if not bad else f"{len(bad)} wrong outputs, e.g. {bad[:3]}"
    print(
        f"shared profile, 2 contexts x 2 threads x {args.calls} calls, TensorRT {trt.__version__}: {verdict}"
    )
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
