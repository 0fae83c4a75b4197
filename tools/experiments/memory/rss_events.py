"""Where the bench's peak RSS happens: VmRSS and VmHWM around every session creation and graph call.

    python tools/experiments/memory/rss_events.py /tmp/v3full/int4-new 3

Runs the scenario of ``trt-cosy bench`` (``trt_cosy.bench.speed._one_run``: prefill, 250 greedy
tokens, non-streaming flow, vocoder) RUNS times without a warm-up or cold start, with the peak
(VmHWM, reset through /proc/self/clear_refs before each event) recorded around every ONNX Runtime
session creation (``load <graph>``), graph call (``run <graph>``) and LLM decode step, and prints per
event the largest RSS before, peak and RSS after, in MiB. Linux only. Variants, for comparison:
``XP_TRIM=1`` trims glibc's heap after each session load (what ``OrtRunner.from_path`` now does
itself), ``XP_MMAP=1`` fixes glibc's mmap threshold (``heap.return_large_blocks``), ``XP_ARENA=N``
sets the shared arena's extend strategy (0 next power of two, 1 same as requested).
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime

from trt_cosy.bench import speed
from trt_cosy.runtime.backends.onnxruntime import runner as ort_mod
from trt_cosy.runtime.engines import load_engines
from trt_cosy.runtime.heap import return_large_blocks

_EVENTS: dict[str, list[float]] = {}  # label -> [count, max RSS before, max peak, max RSS after]
_OVERALL: list = [0.0, ""]  # [peak MiB, event]


def status_mib(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _record(label: str, before: float, peak: float, after: float) -> None:
    row = _EVENTS.setdefault(label, [0, 0.0, 0.0, 0.0])
    row[0] += 1
    row[1], row[2], row[3] = max(row[1], before), max(row[2], peak), max(row[3], after)
    if peak > _OVERALL[0]:
        _OVERALL[:] = [peak, label]


def _watched(label_of, function):
    def inner(*args, **kwargs):
        before, prior = status_mib("VmRSS"), status_mib("VmHWM")
        if prior > _OVERALL[0]:  # the peak between two events
            _OVERALL[:] = [prior, "(between)"]
        _reset_peak()
        try:
            return function(*args, **kwargs)
        finally:
            _record(label_of(*args, **kwargs), before, status_mib("VmHWM"), status_mib("VmRSS"))

    return inner


def _install() -> None:
    """Wrap the runner methods (and apply the XP_* variants)."""
    if os.environ.get("XP_MMAP"):
        print("mmap threshold fixed:", return_large_blocks())
    if os.environ.get("XP_ARENA"):
        arena_cfg, strategy = onnxruntime.OrtArenaCfg, int(os.environ["XP_ARENA"])
        onnxruntime.OrtArenaCfg = lambda limit, _, chunk, dead: arena_cfg(limit, strategy, chunk, dead)
        print("arena extend strategy", strategy)
    original = ort_mod.OrtRunner.from_path.__func__
    from_path = original
    if os.environ.get("XP_TRIM"):
        trim = ctypes.CDLL("libc.so.6").malloc_trim

        def trimmed(cls, *args, **kwargs):
            runner = original(cls, *args, **kwargs)
            trim(0)
            return runner

        from_path = trimmed
        print("malloc_trim after each load")
    ort_mod.OrtRunner.from_path = classmethod(
        _watched(lambda cls, path, name, *a, **k: f"load {name}", from_path)
    )
    ort_mod.OrtRunner.infer = _watched(lambda self, feed: f"run {self.name}", ort_mod.OrtRunner.infer)
    ort_mod.OrtKVDecoder.step = _watched(
        lambda self, embeds: f"step llm T={'1' if embeds.shape[1] == 1 else '>1'}", ort_mod.OrtKVDecoder.step
    )


def main(argv: list[str]) -> int:
    engines, runs = Path(argv[0]), int(argv[1]) if len(argv) > 1 else 2
    _install()
    start = time.perf_counter()
    _reset_peak()
    model = load_engines(engines, threads=2, backend="auto")
    stages = speed._Stages(model)
    _OVERALL[0] = max(_OVERALL[0], status_mib("VmHWM"))
    print(f"loaded: RSS {status_mib('VmRSS'):.0f} MiB ({time.perf_counter() - start:.1f} s)", flush=True)
    options = speed.BenchOptions(threads=2)
    inputs = speed._inputs(model, engines, options)
    rng = np.random.default_rng(0)
    for index in range(runs):
        result = speed._one_run(stages, inputs, options, rng)
        peak = max(_OVERALL[0], status_mib("VmHWM"))
        print(
            f"run {index}: rtf {result['rtf']:.2f}, RSS {status_mib('VmRSS'):.0f} MiB, "
            f"peak so far {peak:.0f} MiB at {_OVERALL[1]}",
            flush=True,
        )
    print(f"{'event':28s} {'n':>5s} {'before':>8s} {'peak':>8s} {'after':>8s}  (MiB, max over calls)")
    for label, (count, before, peak, after) in _EVENTS.items():
        print(f"{label:28s} {count:5d} {before:8.0f} {peak:8.0f} {after:8.0f}")
    print(f"overall peak {max(_OVERALL[0], status_mib('VmHWM')):.0f} MiB at {_OVERALL[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
