"""Quality guard of reduced-precision engines against fp32 engines (LLM KL/top-1, flow mel SNR, HiFT SNR).

python bench/quality_guard.py --reference ENGINES_FP32 --candidate ENGINES_INT4 [--golden reference.npz] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from trt_cosy.runtime.engines import load_engines
from trt_cosy.verify.quality import QualityInputs, quality_guard


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="fp32 engines directory")
    parser.add_argument("--candidate", type=Path, required=True, help="reduced-precision engines directory")
    parser.add_argument("--golden", type=Path, default=None, help="golden reference.npz (inputs only)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    reference = load_engines(args.reference, threads=args.threads, backend="auto")
    candidate = load_engines(args.candidate, threads=args.threads, backend="auto")
    inputs = None
    if args.golden is not None:
        with np.load(args.golden) as data:
            inputs = QualityInputs.from_golden({key: data[key] for key in data.files})
    rows = quality_guard(reference, candidate, inputs)
    for row in rows:
        print(
            f"{row.metric:18s} {row.value:10.4f}  bound {row.kind} {row.bound:g}  {'ok' if row.passed else 'FAIL'}"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps([row.__dict__ | {"passed": row.passed} for row in rows], indent=2) + "\n"
        )
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
