"""``trt-cosy verify``: run every stage on golden inputs and compare with the official outputs."""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import InputError, require
from ..runtime.model import LoadedModel
from .golden import Comparison, GoldenSet, compare
from .stages import run_flow, run_hift, run_llm

__all__ = ["load_backend", "run_verify", "format_table"]

_LOGGER = logging.getLogger(__name__)

# Keys the engine does not reproduce by design, with the reason printed in the table.
_SKIPPED: dict[str, str] = {
    "llm_sampled_tokens": "informational: drawn with torch's CPU multinomial RNG, not reproducible without torch",
}


def load_backend(backend: str, model_dir: Path, engines: Path | None, threads: int | None) -> LoadedModel:
    """Load the model for ``backend``: ``torch`` runs our reference modules on the checkpoint."""
    if backend == "torch":
        require("torch", "build")
        from ..build.reference import load_torch_model

        return load_torch_model(model_dir, threads=threads)
    if engines is None:
        raise InputError(f"--backend {backend} needs --engines DIR (built with `trt-cosy build`).")
    if backend == "onnxruntime":
        from ..runtime.engines import load_engines

        return load_engines(engines, threads=threads, model_dir=model_dir)
    raise InputError(f"the {backend} backend is not available in this version; use onnxruntime or torch.")


def run_verify(model: LoadedModel, golden: GoldenSet) -> list[Comparison]:
    """Run each stage on the golden inputs (noise injected) and compare every output key."""
    ours: dict[str, object] = {}
    skipped = dict(_SKIPPED)
    for runner in (run_llm, run_flow, run_hift):
        ours.update(runner(model, golden, skipped))
    rows = []
    for key in golden.compared_keys():
        if key in skipped:
            rows.append(Comparison(key, "skipped", note=skipped[key]))
            continue
        tolerance = golden.tolerance(key)
        if key not in ours or tolerance is None:
            reason = "no tolerance known for this key" if tolerance is None else "not computed by this version"
            rows.append(Comparison(key, "skipped", note=reason))
            continue
        rows.append(compare(key, ours[key], golden[key], tolerance))
    return rows


def format_table(rows: list[Comparison]) -> str:
    width = max((len(row.key) for row in rows), default=10)
    lines = [f"{'key':<{width}}  {'max_abs_err':>11}  {'tolerance':>9}  result"]
    for row in rows:
        err = "-" if row.max_abs_err is None else f"{row.max_abs_err:.3e}"
        tol = "-" if row.tolerance is None else f"{row.tolerance:.0e}"
        note = f"  ({row.note})" if row.note else ""
        lines.append(f"{row.key:<{width}}  {err:>11}  {tol:>9}  {row.status}{note}")
    counts = {status: sum(row.status == status for row in rows) for status in ("ok", "FAIL", "skipped")}
    lines.append(f"summary: {counts['ok']} ok, {counts['FAIL']} failed, {counts['skipped']} skipped")
    return "\n".join(lines)
