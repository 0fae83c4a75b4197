"""``trt-cosy verify``: run every stage on golden inputs and compare with the official outputs.

Works for the three families (golden README §2, §7, §8); the model's family supplies the stage
drivers (``Family.verify_drivers``: ``stages`` here for CosyVoice2, ``models/v1/verify.py``,
``models/v3/verify.py``). ``run_verify`` is
``compute_outputs`` (run the stages, injected noise) followed by ``compare_outputs`` (one row per
compared golden key, plus ``conversion:<run>_wav``: the voice-conversion request on the golden runs,
``verify.conversion``). A golden of the official ``inference_vc`` run end to end (``tests/data/vc``)
gives the ``vc:`` rows of ``verify.official_vc``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..errors import InputError
from ..runtime.model import LoadedModel
from .conversion import CONVERSION_PREFIX
from .golden import Comparison, GoldenSet, compare

__all__ = ["run_verify", "compute_outputs", "compare_outputs", "format_table"]

_LOGGER = logging.getLogger(__name__)

StageDriver = Callable[[LoadedModel, GoldenSet, dict[str, str]], dict[str, Any]]

# Keys the engine does not reproduce by design, with the reason printed in the table.
_SKIPPED: dict[str, str] = {
    "llm_sampled_tokens": "informational: drawn with torch's CPU multinomial RNG, not reproducible without torch",
}


def compute_outputs(model: LoadedModel, golden: GoldenSet) -> tuple[dict[str, Any], dict[str, str]]:
    """Run each stage on the golden inputs (noise injected): (our outputs by golden key, skipped keys)."""
    from ..family_lookup import FAMILIES, family_of  # the families' drivers import this package

    family = family_of(model.config)
    golden_name = golden.meta.get("family", "v2")  # the CosyVoice2 golden set predates the field
    golden_family = FAMILIES.get(golden_name)
    if golden_family is not family:
        title = golden_family.title if golden_family else golden_name
        raise InputError(
            f"{golden.source} is a {title} golden set but the model "
            f"is {family.title}; pass the reference.npz made for this model."
        )
    ours: dict[str, Any] = {}
    skipped = dict(_SKIPPED)
    for driver in family.verify_drivers:
        ours.update(driver(model, golden, skipped))
    from .conversion import run_conversion  # voice conversion: the conversion request on the golden runs

    ours.update(run_conversion(model, golden, skipped))
    return ours, skipped


def compare_outputs(
    ours: Mapping[str, Any], skipped: Mapping[str, str], golden: GoldenSet
) -> list[Comparison]:
    """One row per compared golden key (inputs and injected draws are not compared)."""
    rows = []
    for key in golden.compared_keys():
        if key in skipped:
            rows.append(Comparison(key, "skipped", note=skipped[key]))
            continue
        tolerance = golden.tolerance(key)
        if key not in ours or tolerance is None:
            reason = (
                "no tolerance known for this key" if tolerance is None else "not computed by this version"
            )
            rows.append(Comparison(key, "skipped", note=reason))
            continue
        rows.append(compare(key, ours[key], golden[key], tolerance))
    for key in sorted(key for key in ours if key.startswith(CONVERSION_PREFIX)):  # against <run>_wav
        golden_key = key[len(CONVERSION_PREFIX) :]
        rows.append(compare(key, ours[key], golden[golden_key], golden.tolerance(golden_key)))
    return rows


def run_verify(
    model: LoadedModel, golden: GoldenSet, model_dir: Path | None = None, threads: int | None = None
) -> list[Comparison]:
    """Run each stage on the golden inputs (noise injected) and compare every output key.

    A voice-conversion golden (``tests/data/vc/<family>.npz``, the official ``inference_vc`` end to
    end) gives the ``vc:`` rows of ``verify.official_vc`` instead; it needs ``model_dir`` (the release
    with the frontend ONNX files).
    """
    from .official_vc import is_vc_golden, run_official_vc

    if is_vc_golden(golden):
        if model_dir is None:
            raise InputError(f"{golden.source} is a voice-conversion golden: pass --model-dir (the release).")
        return run_official_vc(model, golden, model_dir, threads)
    ours, skipped = compute_outputs(model, golden)
    return compare_outputs(ours, skipped, golden)


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
