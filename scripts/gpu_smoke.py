"""A first GPU run in at most 10 minutes on one H100/H200, with no network (issue 29).

    python scripts/gpu_smoke.py --prepare WORK          # on a CPU (torch): tiny v2/v3 --onnx-only dirs
    python scripts/gpu_smoke.py --dry-run               # list every step with its time budget
    python scripts/gpu_smoke.py --engines WORK          # on the GPU host: run every step
    python scripts/gpu_smoke.py --engines WORK --cpu-only   # the steps that need no GPU (CI runs them)

Every step runs in its own process under its time budget (a crash or a hang in TensorRT fails that
step, not the script), prints one ``PASS`` / ``FAIL`` / ``SKIP`` line, and the script goes on after a
failure; a summary ends the run, exit status 1 when a step failed. ``WORK`` holds ``v2/`` and ``v3/``:
``trt-cosy build --backend tensorrt --onnx-only`` of the tiny golden checkpoints (a few MiB each,
parity feeds included), made by ``--prepare`` on any CPU machine and copied to the GPU host.

The GPU steps are written to TensorRT's documented Python API (10.12+ / 11.x) and cuda-python's
``cuda.bindings.runtime``; they have not run on a GPU yet (docs/tensorrt.md: what a CPU verifies).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
FAMILIES = {"v2": DATA / "cosyvoice2-tiny", "v3": DATA / "cosyvoice3-tiny"}
SLOTS = 2
CLI = (sys.executable, "-m", "trt_cosy.cli")  # the trt-cosy command of this interpreter
SMOKE_NOISE_SAMPLES = 120_000  # 5 s at 24 kHz of v3's fixed HiFT noise (the golden tiny set: 76 800)
PREPARED_LIMIT = 64 * 2**20  # what may travel to the GPU host


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    gpu: bool
    what: str


STEPS = (
    Step("versions", 10, False, "Python, numpy, trt-cosy; tensorrt, cuda-python and the GPU where present"),
    Step("prepared", 10, False, "the v2/v3 --onnx-only dirs: graphs, profiles, parity feeds, under 64 MiB"),
    Step("fakes", 90, False, "the CPU fakes' byte/synchronize counts and first-run checks (pytest)"),
    Step("gpu-tests", 80, True, "the existing GPU tests (pytest -m gpu: CUDA plumbing, runtime, Euler loop)"),
    Step("build-plans", 180, True, f"every plan of tiny v2 and v3 for {SLOTS} slots, each checked vs fp32"),
    Step("profiles", 80, True, "every plan at each profile's min/opt/max, switching, vs ORT, 2 threads"),
    Step("nan-kv", 30, True, "batched decode over KV slots poisoned with NaN equals each row alone"),
    Step("verify", 60, True, "trt-cosy verify --backend tensorrt on the golden tiny v2 and v3 sets"),
    Step("timing", 30, True, "CPU enqueue vs GPU time: ms per decode step (B = 1, 4, 16) and per chunk"),
)
assert sum(step.budget_s for step in STEPS) <= 600, "the smoke run must fit 10 minutes"


# -- steps (each runs in a child process: ``--run-step NAME``) ------------------------------------------


def step_versions(work: Path) -> str:
    import numpy

    import trt_cosy
    from trt_cosy.runtime.backends.tensorrt.cuda import device_info, gpu_unavailable_reason

    parts = [f"python {sys.version.split()[0]}", f"numpy {numpy.__version__}"]
    parts.append(f"trt-cosy {trt_cosy.__version__}")
    reason = gpu_unavailable_reason()
    if reason is None:
        import tensorrt

        info = device_info()
        parts += [f"TensorRT {tensorrt.__version__}", f"GPU {info['name']} (sm {info['compute_capability']})"]
    else:
        parts.append(f"no GPU path here: {reason.split(';')[0]}")
    return ", ".join(parts)


def step_prepared(work: Path) -> str:
    from trt_cosy.builder.trt.parity import read_parity_feeds
    from trt_cosy.runtime.manifest import Manifest

    sizes = []
    for family, release in FAMILIES.items():
        engines = work / family
        Manifest.read(engines).check(engines, release, backend="tensorrt")  # what load_engines checks first
        summary = json.loads((engines / "tensorrt.json").read_text())
        profiles = json.loads((engines / "profiles.json").read_text())
        missing = sorted(set(summary["graphs"]) - set(profiles))
        if missing:
            raise AssertionError(f"{family}: graphs without profiles {missing}")
        for name, entry in summary["graphs"].items():
            feeds = engines / entry.get("parity_feeds", "missing")
            if not (engines / entry["onnx"]).is_file() or not feeds.is_file() or not read_parity_feeds(feeds):
                raise AssertionError(f"{family}/{name}: graph or parity feeds missing")
        files = [p for p in engines.rglob("*") if p.is_file() and "plans" not in p.parts]
        sizes.append(sum(p.stat().st_size for p in files))
    if sum(sizes) > PREPARED_LIMIT:
        raise AssertionError(f"prepared dirs hold {sum(sizes) / 2**20:.1f} MiB, more than 64 MiB")
    return f"{len(FAMILIES)} dirs, {sum(sizes) / 2**20:.1f} MiB"


def step_fakes(work: Path) -> str:
    tests = ["tests/test_trt_device_counts.py", "tests/test_trt_plan_build.py", "tests/test_trt_packaging.py"]
    _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests])
    return f"{len(tests)} test files"


def step_gpu_tests(work: Path) -> str:
    tests = ["tests/test_cuda_gpu.py", "tests/test_trt_runtime.py", "tests/test_euler_loop.py"]
    _run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu", *tests])
    return "pytest -m gpu passed"


def step_build_plans(work: Path) -> str:
    for family in FAMILIES:  # each new plan is run on its parity feeds vs fp32 (builder.trt.parity)
        _run([sys.executable, "-m", "trt_cosy.builder.trt.plans", str(work / family), "--slots", str(SLOTS)])
    errors = {}
    for family in FAMILIES:
        parity = json.loads((work / family / "plans" / "parity.json").read_text())
        for name, entry in parity.items():
            errors[f"{family}/{name}"] = max([*entry.get("max_error", {}).values(), 0.0])
    worst = max(errors, key=errors.get)
    return f"{len(errors)} plans, worst plan-vs-fp32 error {errors[worst]:.2e} ({worst})"


def _shapes_at(profile, which: int) -> dict[str, tuple[int, ...]]:
    return {name: tuple(bounds[which]) for name, bounds in profile.shapes.items()}


def _random_feed(shapes, dtypes, rng):
    import numpy as np

    feed = {}
    for name, shape in shapes.items():
        dtype = np.dtype(dtypes[name])
        if name == "key_positions":
            feed[name] = np.arange(shape[0], dtype=dtype)
        elif name == "past_lengths":
            feed[name] = np.zeros(shape, dtype)  # every row reads position 0 only
        elif dtype.kind in "iu":
            feed[name] = np.zeros(shape, dtype)  # ids, indices: 0 is valid in every graph
        else:
            feed[name] = rng.standard_normal(shape).astype(dtype)
    return feed


def step_profiles(work: Path) -> str:
    import numpy as np

    from trt_cosy.builder.trt.parity import PLAN_TOLERANCES
    from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner
    from trt_cosy.runtime.backends.tensorrt.runner import TrtRunner
    from trt_cosy.runtime.profiles import read_profiles

    checked, failures = 0, []
    for family in FAMILIES:
        engines = work / family
        summary = json.loads((engines / "tensorrt.json").read_text())
        tolerance = PLAN_TOLERANCES[summary["precision"]]
        for name, graph in read_profiles(engines / "profiles.json").items():
            if name == "flow_estimator_incremental" or summary["graphs"][name].get("derived_from"):
                continue  # the incremental plan's min/opt/max are not self-consistent feeds; steps: by build
            runner = TrtRunner.from_plan(engines / "plans" / f"{name}.plan", name, graph, slots=SLOTS)
            fp32 = engines / f"{name}.onnx"  # left out by --prepare where an fp16 twin exists
            graph_file = fp32 if fp32.is_file() else engines / f"{name}.fp16.onnx"
            reference = OrtRunner.from_path(graph_file, name, threads=2, exported=True)
            dtypes = {n: spec[1] for n, spec in runner.input_specs().items()}
            order = [(p, w) for p in range(len(graph.profiles)) for w in range(3)]  # min/opt/max of each

            def work_through(seed: int, sequence) -> None:
                rng = np.random.default_rng(seed)
                for index, which in sequence:
                    feed = _random_feed(_shapes_at(graph.profiles[index], which), dtypes, rng)
                    if graph.select({n: v.shape for n, v in feed.items()}) != index:
                        continue  # an earlier profile takes these shapes; it is checked there
                    got, want = runner.infer(feed), reference.infer(feed)
                    for output, value in want.items():
                        if not np.isfinite(value).all():
                            continue  # random data the fp32 graph itself overflows on: nothing to compare
                        where = f"{family}/{name} {graph.profiles[index].name}[{which}] {output}"
                        if not np.isfinite(got[output]).all():
                            failures.append(f"{where}: NaN")
                            continue
                        scale = max(1.0, float(np.abs(value).max()))
                        error = float(np.abs(got[output].astype(np.float64) - value).max()) / scale
                        if error > 10 * tolerance:  # random inputs: looser than the parity feeds
                            failures.append(f"{where}: {error:.2e}")

            sequences = ((0, order + order[::-1]), (1, order[::-1] + order))  # back and forth, both slots
            threads = [threading.Thread(target=work_through, args=sequence) for sequence in sequences]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            runner.free()
            checked += 1
    if failures:
        raise AssertionError("; ".join(failures[:8]))
    return f"{checked} plans, every profile at min/opt/max, 2 threads"


def step_nan_kv(work: Path) -> str:
    import numpy as np

    from trt_cosy.runtime.backends.tensorrt.batch import DeviceKVSlots, TrtBatchLLM, cache_dtype
    from trt_cosy.runtime.backends.tensorrt.cuda import PinnedBuffer, Stream
    from trt_cosy.runtime.backends.tensorrt.runner import TrtRunner
    from trt_cosy.runtime.kv_slots import PrefillCache
    from trt_cosy.runtime.llm_decode import LLM_DECODE_NAME, device_cache_inputs
    from trt_cosy.runtime.profiles import read_profiles

    engines = work / "v2"
    profiles = read_profiles(engines / "profiles.json")
    llm = TrtRunner.from_plan(engines / "plans" / "llm.plan", "llm", profiles["llm"])
    graph = profiles[LLM_DECODE_NAME]
    decode = TrtRunner.from_plan(engines / "plans" / f"{LLM_DECODE_NAME}.plan", LLM_DECODE_NAME, graph,
                                 external=device_cache_inputs(graph.input_names))  # fmt: skip
    shape = llm.input_specs()["past_keys"][0]  # (L, 1, H, P, Dh)
    layers, heads, head_dim = int(shape[0]), int(shape[2]), int(shape[4])
    hidden = int(llm.input_specs()["inputs_embeds"][0][2])
    model = TrtBatchLLM(llm, decode, layers)
    slots = DeviceKVSlots(3, layers, heads, 128, head_dim, cache_dtype(decode))
    poison = np.full(slots.nbytes // slots.dtype.itemsize, np.nan, slots.dtype)
    with PinnedBuffer(poison.nbytes) as staged, Stream() as stream:
        staged.view(slots.dtype, poison.shape)[...] = poison
        slots.buffer.copy_from_async(staged, poison.nbytes, stream)
        stream.synchronize()
    rng = np.random.default_rng(0)
    prompts = [rng.standard_normal((1, n, hidden)).astype(np.float32) for n in (5, 17, 9)]
    alone = []
    for prompt in prompts:
        cache = PrefillCache(layers, heads, prompt.shape[1], head_dim)
        model.prefill(prompt, cache)
        slots.add(cache)
        empty = np.zeros((layers, 1, heads, 0, head_dim), np.float32)  # [L, 1, H, 0, Dh]
        alone.append(llm.infer({"inputs_embeds": prompt, "past_keys": empty, "past_values": empty}))
    stepper = model.decoder(slots, alone[0]["logits"].shape[-1])
    steps, worst = 6, 0.0
    for _ in range(steps):
        embeds = rng.standard_normal((3, 1, hidden)).astype(np.float32)
        logits = stepper.step(embeds)
        if not np.isfinite(logits).all():
            raise AssertionError("NaN from the poisoned KV memory reached the logits")
        for row in range(3):
            past = {"past_keys": alone[row]["present_keys"], "past_values": alone[row]["present_values"]}
            alone[row] = out = llm.infer({"inputs_embeds": embeds[row : row + 1], **past})
            scale = max(1.0, float(np.abs(out["logits"][0, -1]).max()))
            worst = max(worst, float(np.abs(logits[row] - out["logits"][0, -1]).max()) / scale)
    slots.free()
    if worst > 5e-2:
        raise AssertionError(f"batched rows differ from each row alone by {worst:.2e}")
    return f"{steps} steps of 3 rows over NaN-poisoned slots, max scaled logit difference {worst:.2e}"


def step_verify(work: Path) -> str:
    for family, release in FAMILIES.items():
        golden = ["--model-dir", str(release), "--golden", str(release / "reference.npz")]
        _run([*CLI, "verify", *golden, "--backend", "tensorrt", "--engines", str(work / family)])
    return "golden tiny v2 and v3 pass on TensorRT"


def step_timing(work: Path) -> str:
    import numpy as np

    from trt_cosy.runtime.backends.tensorrt.batch import (
        DeviceKVSlots,
        TrtBatchLLM,
        cache_dtype,
        decode_limits,
    )
    from trt_cosy.runtime.backends.tensorrt.cuda import Event
    from trt_cosy.runtime.backends.tensorrt.euler import DeviceEulerLoop, guidance_feed, step_schedule
    from trt_cosy.runtime.backends.tensorrt.runner import TrtRunner
    from trt_cosy.runtime.kv_slots import PrefillCache
    from trt_cosy.runtime.llm_decode import LLM_DECODE_NAME, device_cache_inputs
    from trt_cosy.runtime.profiles import read_profiles
    from trt_cosy.stages.flow import cosine_t_span

    engines = work / "v2"
    profiles = read_profiles(engines / "profiles.json")
    graph = profiles[LLM_DECODE_NAME]
    decode = TrtRunner.from_plan(engines / "plans" / f"{LLM_DECODE_NAME}.plan", LLM_DECODE_NAME, graph,
                                 external=device_cache_inputs(graph.input_names))
    layers = sum(1 for n in graph.input_names if n.startswith("past_key_"))
    _, heads, _, head_dim = graph.max_shapes()["past_key_0"]
    hidden = graph.max_shapes()["inputs_embeds"][2]
    max_batch, _ = decode_limits(decode)
    lines = []
    start, stop = Event(timing=True), Event(timing=True)
    for batch in (1, 4, 16):
        rows = min(batch, max_batch)
        slots = DeviceKVSlots(rows, layers, heads, 256, head_dim, cache_dtype(decode))
        for _ in range(rows):  # 100 cached positions each (zeros)
            slots.add(PrefillCache(layers, heads, 100, head_dim))
        stepper = TrtBatchLLM(None, decode, layers).decoder(slots, 1)  # vocab: only for 0 rows
        embeds = np.zeros((rows, 1, hidden), np.float32)
        stepper.step(embeds)  # warm: profile, memory
        count, began = 20, time.perf_counter()
        start.record(decode.stream(0))
        for _ in range(count):
            stepper.step(embeds)
        stop.record(decode.stream(0))
        stop.synchronize()
        wall = (time.perf_counter() - began) * 1e3 / count
        gpu = stop.elapsed_ms(start) / count
        capped = "" if rows == batch else f" (the plan's max batch {rows})"
        lines.append(f"decode B={batch}{capped}: {wall:.2f} ms/step wall, {gpu:.2f} ms GPU")
        slots.free()
    step_graph = profiles["flow_step_stream"]
    runner = TrtRunner.from_plan(engines / "plans" / "flow_step_stream.plan", "flow_step_stream", step_graph)
    frames = 50
    rng = np.random.default_rng(0)
    zeros = np.zeros((1, 80, frames), np.float32)  # [1, 80, F]
    noise = rng.standard_normal((1, 80, frames)).astype(np.float32)
    mask, speaker = np.ones((1, 1, frames), np.float32), np.zeros((1, 80), np.float32)
    feed = guidance_feed(noise, zeros, mask, speaker, zeros)
    with DeviceEulerLoop(runner, step_schedule(cosine_t_span(10))) as loop:
        loop.run(feed)
        began = time.perf_counter()
        with runner.slot() as slot:
            start.record(runner.stream(slot))
            out = loop.enqueue(feed, slot)
            enqueue_ms = (time.perf_counter() - began) * 1e3
            out.event.synchronize()
            stop.record(runner.stream(slot))
            stop.synchronize()
        gpu_ms = stop.elapsed_ms(start)
        lines.append(
            f"Euler chunk (10 steps, {frames} frames): {enqueue_ms:.2f} ms CPU enqueue, {gpu_ms:.2f} ms GPU"
        )
    print("\n".join(lines))
    return "; ".join(lines)


STEP_FUNCTIONS: dict[str, Callable[[Path], str]] = {
    "versions": step_versions, "prepared": step_prepared, "fakes": step_fakes, "gpu-tests": step_gpu_tests,
    "build-plans": step_build_plans, "profiles": step_profiles, "nan-kv": step_nan_kv, "verify": step_verify,
    "timing": step_timing,
}  # fmt: skip


# -- driver ---------------------------------------------------------------------------------------------


def _run(command: list[str]) -> None:
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        tail = (result.stdout + result.stderr).strip().splitlines()[-15:]
        raise AssertionError(f"{' '.join(command[:4])} ... exit {result.returncode}:\n  " + "\n  ".join(tail))


def prepare(work: Path) -> int:
    """The --onnx-only engine dirs of the tiny v2 and v3 checkpoints (CPU, needs the [build] extra)."""
    for family, release in FAMILIES.items():
        out = ["--out", str(work / family)]
        _run([*CLI, "build", "--model-dir", str(release), *out, "--backend", "tensorrt", "--onnx-only"])
        removed = _strip_fp32_twins(work / family)
        print(f"prepared {work / family} (fp32 graphs with an fp16 twin left out: {len(removed)})")
    return 0


def _strip_fp32_twins(engines: Path) -> list[str]:
    """Leave out each fp32 ``<graph>.onnx`` that has a ``<graph>.fp16.onnx`` twin, and its line in
    the manifest's file list (its graph record then names the twin): TensorRT builds from the fp16 graphs and each plan is checked against
    the fp32 outputs stored in ``parity/``, so the fp32 graphs need not travel. The ``profiles`` step
    compares with the fp16 graph on ONNX Runtime instead. v3's fixed HiFT noise is cut to its first
    ``SMOKE_NOISE_SAMPLES`` (the manifest records the new size): both dirs then fit 64 MiB."""
    manifest_path = engines / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    removed = []
    for twin in sorted(engines.glob("*.fp16.onnx")):
        fp32 = engines / twin.name.replace(".fp16.onnx", ".onnx")
        if fp32.is_file():
            fp32.unlink()
            manifest["files"].pop(fp32.name, None)
            removed.append(fp32.name)
            for record in manifest["graphs"].values():  # the graph's record names the file that is there
                if record.get("file") == fp32.name:
                    record["file"] = twin.name
    noise = engines / "hift_noise.npy"  # v3's fixed HiFT noise: 60 s (52 MB); the golden set needs 3.2 s
    if noise.is_file():
        import numpy as np

        kept = np.array(np.load(noise, mmap_mode="r")[:, :SMOKE_NOISE_SAMPLES])  # [1, S, 9]
        np.save(noise, kept)
        manifest["files"][noise.name] = noise.stat().st_size
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return removed


def run_steps(work: Path, cpu_only: bool, only: list[str] | None, scale: float = 1.0) -> int:
    from trt_cosy.runtime.backends.tensorrt.cuda import gpu_unavailable_reason

    reason = None if cpu_only else gpu_unavailable_reason()
    results = []
    for step in STEPS:
        if only and step.name not in only:
            continue
        began = time.perf_counter()
        if step.gpu and cpu_only:
            status, detail = "SKIP", "--cpu-only"
        elif step.gpu and reason is not None:
            status, detail = "FAIL", f"no GPU path: {reason.split(';')[0]}"
        else:
            command = [sys.executable, __file__, "--run-step", step.name, "--engines", str(work)]
            try:
                done = subprocess.run(
                    command, cwd=ROOT, capture_output=True, text=True, timeout=step.budget_s * scale
                )
                last = (done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or [""])[-1]
                status = "PASS" if done.returncode == 0 else "FAIL"
                detail = last[:400]
            except subprocess.TimeoutExpired:
                status, detail = "FAIL", f"over its {step.budget_s * scale:.0f} s budget"
        elapsed = time.perf_counter() - began
        results.append(status)
        print(f"{status} {step.name:<12} {elapsed:6.1f} s / {step.budget_s:>3} s  {detail}", flush=True)
    counts = {s: results.count(s) for s in ("PASS", "FAIL", "SKIP")}
    print(f"SUMMARY {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 1 if counts["FAIL"] else 0


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    default = Path(os.environ.get("TRT_COSY_SMOKE", "smoke-engines"))
    parser.add_argument("--engines", type=Path, default=default, help="the --prepare folder (v2/, v3/)")
    parser.add_argument("--dry-run", action="store_true", help="list the steps and their budgets only")
    parser.add_argument("--cpu-only", action="store_true", help="run the steps that need no GPU")
    parser.add_argument("--prepare", type=Path, help="write the --onnx-only dirs to this folder (CPU)")
    parser.add_argument("--step", action="append", help="run only this step (repeatable)")
    parser.add_argument(
        "--budget-scale", type=float, default=1.0, help="multiply every budget (a loaded CI machine)"
    )
    parser.add_argument("--run-step", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.prepare:
        return prepare(args.prepare)
    if args.dry_run:
        for step in STEPS:
            print(f"{step.name:<12} {step.budget_s:>4} s  {'GPU' if step.gpu else 'CPU'}  {step.what}")
        print(f"total budget {sum(s.budget_s for s in STEPS)} s (at most 600 s on one H100/H200)")
        return 0
    if args.run_step:  # the child: its last stdout line is the step's one-line result
        try:
            print(STEP_FUNCTIONS[args.run_step](args.engines))
        except Exception as exc:  # reported as the step's FAIL line; the traceback goes to stderr
            import traceback

            traceback.print_exc()
            print(" ".join(f"{type(exc).__name__}: {exc}".split()))
            return 1
        return 0
    return run_steps(args.engines, args.cpu_only, args.step, args.budget_scale)


if __name__ == "__main__":
    sys.exit(main())
