#!/usr/bin/env python
"""Build trt-cosy engines from an official CosyVoice2 release (same as ``trt-cosy build``).

    python build_engines.py --model-dir CosyVoice2-0.5B --out engines/cosyvoice2-0.5b/onnxruntime-fp32

Needs the ``build`` extra (torch, onnx, onnxscript): ``pip install 'trt-cosy[build,cpu]'``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, type=Path, help="official release directory")
    parser.add_argument("--out", required=True, type=Path, help="engines directory to create or replace")
    parser.add_argument("--backend", default="onnxruntime", help="engine backend (default: onnxruntime)")
    parser.add_argument("--precision", default="fp32", help="engine precision (default: fp32)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the engines are up to date")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug logging")
    args = parser.parse_args(argv)
    level = logging.WARNING if args.verbose == 0 else logging.INFO if args.verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from trt_cosy.errors import TrtCosyError, require

    try:
        require("torch", "build")
        from trt_cosy.build.engines import build_engines

        out = build_engines(
            args.model_dir,
            args.out,
            backend=args.backend,
            precision=args.precision,
            force=args.force,
            progress=None if args.verbose else print,
        )
    except TrtCosyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"engines ready in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
