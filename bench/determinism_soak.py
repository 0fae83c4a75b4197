"""A seed's audio must not depend on the load: the server soak of ``trt_cosy.bench.determinism``.

    trt-cosy make-test-model --size tiny --out /tmp/tiny
    trt-cosy build --model-dir /tmp/tiny --out /tmp/tiny-int4 --backend onnxruntime --precision int4
    python bench/determinism_soak.py --engines /tmp/tiny-int4 --requests 1000 --concurrency 8

Every (text, seed) case alone first (twice as WAV, once streamed PCM: the same samples), then
--requests requests at --concurrency, each compared sample for sample with its alone reference.
--no-deterministic runs the same with steps over the active rows only (EngineConfig.deterministic=False).
Exit status 1 when any answer differs.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

from trt_cosy.bench.determinism import soak_server

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_REF = ROOT / "tests" / "data" / "features" / "audio" / "en_16k_mono.wav"


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=2, help="seeds per text (8 texts)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--ref", type=Path, default=DEFAULT_REF, help="reference speech of the voice")
    parser.add_argument("--ref-text", default="Hello, this is me.")
    options = parser.parse_args()
    print(f"CPU: {_cpu()}, deterministic={options.deterministic}", flush=True)
    report = soak_server(
        options.engines, options.ref, options.ref_text, options.requests, options.concurrency,
        deterministic=options.deterministic, threads=options.threads, seeds=tuple(range(1, options.seeds + 1)),
        progress=lambda line: print(line, flush=True),
    )  # fmt: skip
    print(report.summary())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
