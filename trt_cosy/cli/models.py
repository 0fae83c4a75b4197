"""`trt-cosy download`, `build`, `make-test-model` and `verify`: releases and the engines built from them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from ..family_lookup import FAMILIES
from .options import BACKENDS, SOURCES, echo_progress


@click.command()
@click.argument("name", default="CosyVoice2-0.5B")
@click.option("--source", type=click.Choice(SOURCES), default="huggingface", show_default=True)
@click.option(
    "--dir",
    "target",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to put the release (default: the trt-cosy cache, $TRT_COSY_CACHE).",
)
def download(name: str, source: str, target: Path | None) -> None:
    """Fetch a release (NAME: CosyVoice2-0.5B or a repository id) with the files inference needs."""
    from ..download import download_model

    path = download_model(name, source, target, progress=echo_progress)
    click.echo(
        f'release ready in {path}; speak with: trt-cosy say "Hello." --model-dir {path} --ref ref.wav -o out.wav'
    )


@click.command()
@click.option("--model-dir", required=True, type=click.Path(path_type=Path), help="Official release directory.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Engines directory to write (e.g. engines/cosyvoice2/onnxruntime-fp32).")
@click.option("--backend", type=click.Choice(["auto", "onnxruntime", "tensorrt", "openvino", "mixed"]), default="auto",
              show_default=True,
              help="auto: tensorrt fp16 where a CUDA GPU and TensorRT are present, else each stage's CPU engines "
                   "chosen by timing them here (--tune; --tune off: onnxruntime int4; --precision: untuned); says "
                   "which. mixed: the LLM on onnxruntime, flow and vocoder on openvino.")
@click.option("--precision", type=click.Choice(["fp32", "fp16", "bf16", "int8", "int4"]), default=None,
              help="Default: int4 for onnxruntime (4-bit LLM, int8 flow; fp32 for `trt-cosy verify` parity), "
                   "fp16 for tensorrt, bf16 for openvino. See docs/precision.md.")
@click.option("--force", is_flag=True, help="Rebuild even when the manifest says nothing changed.")
@click.option("--onnx-only", is_flag=True,
              help="TensorRT: write fp16 graphs, profiles and manifest only (no GPU needed); plans come later.")
@click.option("--tune", type=click.Choice(["on", "off"]), default="on", show_default=True,
              help="With --backend auto on a CPU machine: build the CPU candidates, time each stage here and keep "
                   "per stage the fastest that passes the quality guard (recorded in the manifest). off: "
                   "today's rule, no timing.")
@click.option("--tune-seconds", type=click.FloatRange(min=1.0), default=None,
              help="About how long the timing may take (default 90; the candidates' builds come first).")
@click.option("--tune-threads", "tune_threads", is_flag=True,
              help="Then time splits of this machine's cores among the engines (`trt-cosy tune-threads` with its "
                   "defaults) and record the best next to them, for `serve --workers auto` and one engine.")
def build(model_dir: Path, out_dir: Path, backend: str, precision: str | None, force: bool, onnx_only: bool,
          tune: str, tune_seconds: float | None, tune_threads: bool) -> None:
    """Export the official checkpoint to ONNX per stage and build engines for a backend."""
    from ..errors import require

    require("torch", "build")
    require("onnx", "build")
    from ..builder.engines import build_engines
    from ..runtime.backend_choice import AUTO, BackendChoice, resolve_backend

    choice = resolve_backend(backend, precision)
    if onnx_only and backend == AUTO:  # --onnx-only writes TensorRT inputs, whatever this machine has
        choice = BackendChoice("tensorrt", precision or "fp16", "--onnx-only writes TensorRT inputs")
    if backend == AUTO and tune == "on" and precision is None and choice.backend != "tensorrt":
        from ..builder.tuning import DEFAULT_TUNE_SECONDS, tune_build

        echo_progress(f"backend: chosen per stage by timing on this CPU (today's rule would be {choice.backend} "
                      f"{choice.precision}; --tune off keeps it)")
        path = tune_build(model_dir, out_dir, fallback=(choice.backend, choice.precision), force=force,
                          budget_s=tune_seconds or DEFAULT_TUNE_SECONDS,
                          progress=lambda message: click.echo(message, err=True))
        click.echo(f"engines ready in {path}")
        _tune_threads(path, tune_threads)
        return
    if backend == AUTO:
        echo_progress(choice.line() + ("" if tune == "off" or choice.backend == "tensorrt" else
                                       "; not tuned: --precision was given"))
    path = build_engines(model_dir, out_dir, backend=choice.backend, precision=choice.precision, force=force,
                         progress=lambda message: click.echo(message, err=True), onnx_only=onnx_only,
                         backend_reason=choice.reason)
    click.echo(f"engines ready in {path}")
    _tune_threads(path, tune_threads and not onnx_only and choice.backend != "tensorrt")


def _tune_threads(engines: Path, wanted: bool) -> None:
    """``build --tune-threads``: the thread plan of the engines just built (``bench.thread_split``)."""
    if not wanted:
        return
    from ..bench.thread_split import tune_threads
    from ..runtime.thread_plan import write_plan

    plan = tune_threads(engines, progress=echo_progress)
    click.echo(f"thread plan recorded in {write_plan(plan, engines)}")


@click.command()
@click.option("--model-dir", required=True, type=click.Path(path_type=Path), help="Official release directory.")
@click.option("--golden", required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A golden reference.npz made by the official code, or tests/data/vc/<family>.npz "
                   "(the official inference_vc end to end).")
@click.option("--backend", type=click.Choice(BACKENDS), default="torch", show_default=True)
@click.option("--engines", type=click.Path(path_type=Path), default=None,
              help="Engines directory (onnxruntime / tensorrt / openvino backends).")
@click.option("--threads", type=int, default=None, help="CPU threads for the backend.")
def verify(model_dir: Path, golden: Path, backend: str, engines: Path | None, threads: int | None) -> None:
    """Compare every stage with the official outputs in a golden file (CosyVoice 1, 2 or 3); exit 1 on any failure."""
    from ..verify import format_table, run_verify
    from ..verify.golden import GoldenSet

    model = load_backend(backend, model_dir, engines, threads)
    rows = run_verify(model, GoldenSet.load(golden), model_dir=model_dir, threads=threads)
    click.echo(format_table(rows))
    if any(row.status == "FAIL" for row in rows):
        precision = _engines_precision(engines)
        if precision in ("int8", "int4"):
            echo_progress(f"note: {engines} holds {precision} engines; verify's tolerances are those of fp32 "
                          "engines. Check parity on `trt-cosy build --precision fp32` engines; the quality guard "
                          "of reduced precisions is bench/quality_guard.py (docs/precision.md).")
        sys.exit(1)


def _engines_precision(engines: Path | None) -> str | None:
    """The precision an engines directory's manifest records, or None (no engines, unreadable)."""
    if engines is None:
        return None
    from ..errors import TrtCosyError
    from ..runtime.manifest import Manifest

    try:
        return Manifest.read(engines).precision
    except (TrtCosyError, OSError, ValueError):
        return None


@click.command("make-test-model")
@click.option("--out", required=True, type=click.Path(file_okay=False, path_type=Path))
@click.option("--family", type=click.Choice(list(FAMILIES)), default="v2", show_default=True,
              help="v1: CosyVoice-300M-SFT layout, v2: CosyVoice2-0.5B, v3: Fun-CosyVoice3-0.5B.")
@click.option("--size", type=click.Choice(["tiny", "full"]), default="tiny", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--overwrite", is_flag=True, help="Replace a non-empty --out directory.")
def make_test_model(out: Path, family: str, size: str, seed: int, overwrite: bool) -> None:
    """Write a random-weight release directory (official layout) for tests and benchmarks."""
    from ..errors import InputError, require

    if out.is_dir() and any(out.iterdir()) and not overwrite:  # before the slow torch import
        raise InputError(f"{out} exists and is not empty; choose another --out or pass --overwrite.")
    require("torch", "build")
    from ..builder.testmodel.release import make_test_model as write

    path = write(out, size=size, seed=seed, overwrite=overwrite, family=family)
    click.echo(
        f"wrote {size} random-weight {family} test model to {path} (not a real voice: audio is noise-like)"
    )


def load_backend(backend: str, model_dir: Path, engines: Path | None, threads: int | None) -> Any:
    """The ``LoadedModel`` ``verify`` runs for ``backend``: ``torch`` runs our reference modules on the checkpoint."""
    from ..errors import InputError, require

    if backend == "torch":
        require("torch", "build")
        from ..builder.reference import load_torch_model

        return load_torch_model(model_dir, threads=threads)
    from ..family_lookup import family_of_release

    family_of_release(model_dir)  # a missing or unknown release directory is refused first
    if engines is None:
        raise InputError(f"--backend {backend} needs --engines DIR (built with `trt-cosy build`).")
    if backend not in ("onnxruntime", "tensorrt", "openvino", "mixed"):
        raise InputError(f"unknown backend {backend!r}; use torch, onnxruntime, tensorrt, openvino or mixed.")
    from ..runtime.engines import load_engines

    return load_engines(engines, threads=threads, model_dir=model_dir, backend=backend)
