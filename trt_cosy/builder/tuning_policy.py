"""Which candidate a tuned build keeps for a stage: the fastest that passes the quality guard (pure).

``choose_stage`` takes the stage's trials as measured (``runtime.tuning_record.Trial``: status ``ok``
with times and quality numbers, or ``failed``/``skipped`` with the reason) and returns the choice with
every trial's final status: a timed trial whose quality numbers miss a bar of
``verify.quality.THRESHOLDS`` for its stage becomes ``refused`` (the metric, value and bar in its
reason), and the fastest remaining ``ok`` trial (by median time) is chosen. When none is left, the stage
keeps ``fallback`` (today's rule, ``runtime.backend_choice``) and the reason says why. No I/O, no clock:
the tests give it made-up trials.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Final

from ..runtime.tuning_record import StageTuning, Trial

__all__ = ["DEFAULT_MARGIN", "STAGE_METRICS", "quality_failures", "choose_stage"]

DEFAULT_MARGIN: Final = 0.05  # how much faster than today's rule a candidate must be to replace it

# The quality guard's bar(s) that decide each stage (verify.quality.THRESHOLDS: metric -> (bound, kind)).
STAGE_METRICS: Final = {"llm": ("llm_kl_mean",), "flow": ("flow_mel_snr_db",), "hift": ("hift_wav_snr_db",)}


def quality_failures(
    stage: str, quality: Mapping[str, float], thresholds: Mapping[str, tuple[float, str]]
) -> list[str]:
    """The bars of ``stage`` that ``quality`` misses, as ``"metric value < bound"`` phrases.

    A metric the trial lacks is a failure (a candidate is never kept unchecked), except on the
    reference candidate, whose trials carry no quality numbers and are not passed here.
    """
    missed = []
    for metric in STAGE_METRICS.get(stage, ()):
        bound, kind = thresholds[metric]
        if metric not in quality:
            missed.append(f"{metric} not measured")
            continue
        value = float(quality[metric])
        ok = value <= bound if kind == "max" else value >= bound
        if not ok or value != value:  # nan never passes
            sign = ">" if kind == "max" else "<"
            missed.append(f"{metric} {value:.4g} {sign} {bound:g}")
    return missed


def choose_stage(
    stage: str,
    trials: Sequence[Trial],
    fallback: tuple[str, str],
    thresholds: Mapping[str, tuple[float, str]],
    reference: tuple[str, str] | None = None,
    margin: float = DEFAULT_MARGIN,
) -> StageTuning:
    """The fastest trial of ``stage`` that was timed and passes the guard; else ``fallback``.

    ``reference`` (backend, precision): the candidate the others are compared with (fp32), which
    passes by definition. ``fallback`` (today's rule) is kept when it passed and the fastest is less
    than ``margin`` (a fraction) faster: a difference within a loaded machine's noise does not move
    a stage off the engines measured at full size. Ties keep the earlier trial.
    """
    judged: list[Trial] = []
    for trial in trials:
        if trial.status == "ok" and (trial.backend, trial.precision) != reference:
            missed = quality_failures(stage, trial.quality, thresholds)
            if missed:
                trial = dataclasses.replace(
                    trial, status="refused", reason="quality guard: " + "; ".join(missed)
                )
        if trial.status == "ok" and not trial.times_s:
            trial = dataclasses.replace(trial, status="failed", reason=trial.reason or "no time measured")
        judged.append(trial)
    passing = [trial for trial in judged if trial.status == "ok"]
    if not passing:
        backend, precision = fallback
        why = (
            "; ".join(f"{trial.label} {trial.status}: {trial.reason}" for trial in judged) or "no candidates"
        )
        return StageTuning(
            stage,
            backend,
            precision,
            f"no candidate was timed and passed the guard ({why}); today's rule",
            tuple(judged),
        )
    best = min(passing, key=lambda trial: trial.median_s)  # min keeps the first of equal medians
    others = sorted((trial for trial in passing if trial is not best), key=lambda trial: trial.median_s)
    today = next((trial for trial in passing if (trial.backend, trial.precision) == tuple(fallback)), None)
    if today is not None and best is not today and best.median_s > (1.0 - margin) * today.median_s:
        return StageTuning(
            stage,
            today.backend,
            today.precision,
            f"today's rule kept: the fastest, {best.label} (median {best.median_s:.4g} s), is less than "
            f"{margin:.0%} faster than {today.label} ({today.median_s:.4g} s)",
            tuple(judged),
        )
    if others:
        runner_up = others[0]
        reason = (
            f"fastest of {len(passing)} passing candidates: median {best.median_s:.4g} s "
            f"vs {runner_up.median_s:.4g} s for {runner_up.label}"
        )
    else:
        reason = f"the only candidate timed that passed the guard (median {best.median_s:.4g} s)"
    return StageTuning(stage, best.backend, best.precision, reason, tuple(judged))
