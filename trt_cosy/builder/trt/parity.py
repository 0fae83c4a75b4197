"""Each TensorRT plan checked against its fp32 ONNX graph right after it is built (issue 29 item 8).

The fp16-vs-fp32 error that ``prepare_trt_graphs`` records is measured on ONNX Runtime, not on the
plans TensorRT builds. So the CPU step also writes ``parity/<graph>.npz``: the export's sample and
parity feeds of the graph (edge lengths included) and the fp32 graph's outputs on them (ONNX Runtime).
On the GPU host (no torch, no onnx) ``build_plans`` runs every plan it builds on those feeds
(``check_plan``): a NaN or inf in any output, or a scaled error max |plan - fp32| / max(1, max |fp32|)
above ``PLAN_TOLERANCES[precision]``, fails the build and removes the plan; the errors are recorded
per plan and output in ``plans/parity.json``. A feed outside the plan's profiles is skipped and
counted (``skipped``), never silently passed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from ...errors import InputError, TrtCosyError

__all__ = [
    "PARITY_DIR",
    "PARITY_SUMMARY",
    "PLAN_TOLERANCES",
    "write_parity_feeds",
    "read_parity_feeds",
    "check_plan",
    "record_parity",
]

_LOGGER = logging.getLogger(__name__)

PARITY_DIR: Final = "parity"
PARITY_SUMMARY: Final = "parity.json"  # in plans/, next to the plans it describes
# Scaled error max |plan - fp32| / max(1, max |fp32|) a plan may show on its parity feeds. fp16: the
# ONNX Runtime estimate of the fp16 graphs is at most 1.5e-3 (docs/tensorrt.md, every family and
# graph); 1e-2 leaves room for TensorRT's own tactics and fusions and still catches a missing fp32
# island or a broken tactic (errors of order 1e-1 and more). fp32: TensorRT may use TF32 (10-bit
# mantissa) for fp32 matrix products unless told otherwise, hence 2e-3, not 1e-5.
PLAN_TOLERANCES: Final = {"fp16": 1e-2, "fp32": 2e-3}

Feed = Mapping[str, np.ndarray]


def write_parity_feeds(engines_dir: Path, name: str, fp32_graph: Path, feeds: Iterable[Feed]) -> Path:
    """``parity/<name>.npz``: every feed and the fp32 graph's outputs on it (ONNX Runtime, CPU)."""
    from ...runtime.backends.onnxruntime.runner import OrtRunner  # onnxruntime: the CPU build step only

    reference = OrtRunner.from_path(fp32_graph, f"{name}-fp32", threads=None, exported=True)
    arrays: dict[str, np.ndarray] = {}
    for index, feed in enumerate(feeds):
        outputs = reference.infer(feed)
        arrays.update({f"{index}/in/{key}": np.asarray(value) for key, value in feed.items()})
        arrays.update({f"{index}/out/{key}": np.asarray(value) for key, value in outputs.items()})
    path = Path(engines_dir) / PARITY_DIR / f"{name}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_suffix(".tmp.npz")
    np.savez(temp, **arrays)
    temp.replace(path)
    return path


def read_parity_feeds(path: Path) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """The (feed, fp32 outputs) pairs of a ``parity/<name>.npz``, in order."""
    pairs: dict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = {}
    with np.load(path) as data:
        for key in data.files:
            index, kind, name = key.split("/", 2)
            feed, outputs = pairs.setdefault(int(index), ({}, {}))
            (feed if kind == "in" else outputs)[name] = data[key]
    return [pairs[index] for index in sorted(pairs)]


def check_plan(
    name: str,
    run: Callable[[Feed], Mapping[str, np.ndarray]],
    pairs: Iterable[tuple[Feed, Mapping[str, np.ndarray]]],
    tolerance: float,
) -> dict[str, Any]:
    """Run ``run`` (the plan's ``infer``) on every feed and compare with the fp32 outputs.

    Returns ``{"max_error": {output: error}, "feeds": n, "skipped": k, "tolerance": t}``. Raises
    ``TrtCosyError`` on NaN/inf in an output or an error above ``tolerance``; a feed outside the
    plan's profiles (``InputError``) is skipped. No feed run at all raises too: nothing was checked.
    """
    errors: dict[str, float] = {}
    ran = skipped = 0
    for feed, expected in pairs:
        try:
            got = run(feed)
        except InputError as exc:  # beyond the profiles (e.g. an export length above a bucket)
            _LOGGER.info("%s: parity feed skipped (%s)", name, exc)
            skipped += 1
            continue
        ran += 1
        for output, reference in expected.items():
            value = np.asarray(got[output], np.float64)
            if not np.isfinite(value).all():
                raise TrtCosyError(
                    f"TensorRT plan '{name}': output '{output}' has NaN/inf on its parity feed (the fp32 "
                    "ONNX graph gives finite values). The plan was removed; build with --precision fp32 or "
                    "report the GPU and TensorRT version."
                )
            if reference.size:
                scale = max(1.0, float(np.abs(reference).max()))
                error = float(np.abs(value - reference.astype(np.float64)).max()) / scale
                errors[output] = max(errors.get(output, 0.0), error)
    if not ran:
        raise TrtCosyError(f"TensorRT plan '{name}': none of its {skipped} parity feeds fits its profiles.")
    worst = {output: error for output, error in errors.items() if error > tolerance}
    if worst:
        raise TrtCosyError(
            f"TensorRT plan '{name}' differs from the fp32 ONNX graph by {worst} (scaled max error, "
            f"tolerance {tolerance:g}). The plan was removed; build with --precision fp32 or report the GPU and "
            "TensorRT version."
        )
    return {"max_error": errors, "feeds": ran, "skipped": skipped, "tolerance": tolerance}


def record_parity(plans_dir: Path, name: str, result: Mapping[str, Any] | None) -> None:
    """Store (or, with None, drop) the parity of plan ``name`` in ``plans/parity.json``."""
    path = Path(plans_dir) / PARITY_SUMMARY
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = {}
    if result is None:
        summary.pop(name, None)
    else:
        summary[name] = dict(result)
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(summary, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    temp.replace(path)
