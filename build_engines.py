#!/usr/bin/env python
"""Build trt-cosy engines from an official CosyVoice2 release (same as ``trt-cosy build``).

    python build_engines.py --model-dir CosyVoice2-0.5B --out engines/cosyvoice2-0.5b/onnxruntime-fp32

Needs the ``build`` extra (torch, onnx, onnxscript): ``pip install 'trt-cosy[build,cpu]'``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import click


def main(argv: Sequence[str] | None = None) -> int:
    """Same options and behaviour as `trt-cosy build` (this script only forwards to it)."""
    from trt_cosy.cli import main as cli_main

    try:
        cli_main(["build", *(sys.argv[1:] if argv is None else argv)], standalone_mode=False)
    except SystemExit as exc:  # TrtCosyError is reported by the CLI and exits 2
        return int(exc.code or 0)
    except click.exceptions.ClickException as exc:  # usage errors
        exc.show()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
