"""The ``trt-cosy`` command line. Thin: parse options, call the library, report errors."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import click

from . import __version__
from .errors import TrtCosyError

_LOGGER = logging.getLogger(__name__)

_BACKENDS = ("torch", "onnxruntime", "tensorrt")


class _Group(click.Group):
    """Turns TrtCosyError into a one-line message and exit status 2 (no traceback)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except TrtCosyError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="trt-cosy")
@click.option("-v", "--verbose", count=True, help="-v for info, -vv for debug logging.")
def main(verbose: int) -> None:
    """Fast CosyVoice inference: build engines, verify parity, speak."""
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@main.command()
@click.option("--model-dir", required=True, type=click.Path(path_type=Path), help="Official release directory.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Engines directory to write (e.g. engines/cosyvoice2/onnxruntime-fp32).")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt"]), default="onnxruntime", show_default=True)
@click.option("--precision", type=click.Choice(["fp32", "fp16", "int8", "int4"]), default="fp32", show_default=True)
@click.option("--force", is_flag=True, help="Rebuild even when the manifest says nothing changed.")
def build(model_dir: Path, out_dir: Path, backend: str, precision: str, force: bool) -> None:
    """Export the official checkpoint to ONNX per stage and build engines for a backend."""
    from .errors import require

    require("torch", "build")
    require("onnx", "build")
    from .build.engines import build_engines

    path = build_engines(model_dir, out_dir, backend=backend, precision=precision, force=force,
                         progress=lambda message: click.echo(message, err=True))
    click.echo(f"engines ready in {path}")


@main.command()
@click.option("--model-dir", required=True, type=click.Path(path_type=Path), help="Official release directory.")
@click.option("--golden", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A golden reference.npz made by the official code.")
@click.option("--backend", type=click.Choice(_BACKENDS), default="torch", show_default=True)
@click.option("--engines", type=click.Path(path_type=Path), default=None,
              help="Engines directory (onnxruntime / tensorrt backends).")
@click.option("--threads", type=int, default=None, help="CPU threads for the backend.")
def verify(model_dir: Path, golden: Path, backend: str, engines: Path | None, threads: int | None) -> None:
    """Compare every stage with the official outputs in a golden file; exit 1 on any failure."""
    from .verify import format_table, load_backend, run_verify
    from .verify.golden import GoldenSet

    model = load_backend(backend, model_dir, engines, threads)
    rows = run_verify(model, GoldenSet.load(golden))
    click.echo(format_table(rows))
    if any(row.status == "FAIL" for row in rows):
        sys.exit(1)


@main.command("make-test-model")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--size", type=click.Choice(["tiny", "full"]), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --out directory.")
def make_test_model(out: Path, size: str, seed: int, overwrite: bool) -> None:
    """Write a random-weight CosyVoice2 release directory (official layout) for tests and benchmarks."""
    from .errors import require

    require("torch", "build")
    from .build.testmodel import make_test_model as write

    path = write(out, size=size, seed=seed, overwrite=overwrite)
    click.echo(f"wrote {size} random-weight test model to {path} (not a real voice: audio is noise-like)")


if __name__ == "__main__":  # pragma: no cover
    main()
