"""What a tuned ``trt-cosy build`` measured and chose, per stage (kept in ``manifest.json``; json only).

``trt-cosy build`` without ``--backend`` times each stage's candidate engines on the machine that builds
(``builder.tuning``) and keeps, per stage, the fastest candidate that passes the quality guard
(``builder.tuning_policy``). This module holds the record of that choice (``TuningRecord``: the CPU
model and ISA flags, threads, the time budget and, per stage, every candidate with its times, its
quality numbers and what became of it) and the one check the loader makes with it: engines tuned on
another CPU log one line saying so and how to tune again (``warn_if_tuned_elsewhere``).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "STAGES", "TRIAL_STATUSES", "Trial", "StageTuning", "TuningRecord", "stage_of_graph", "summarise_times",
    "warn_if_tuned_elsewhere"
]

_LOGGER = logging.getLogger(__name__)

STAGES: Final = ("llm", "flow", "hift")
# ok: timed and passed the guard (or is the reference); refused: timed, failed the guard; failed: did not
# build, load or run (``reason`` says why); skipped: not timed (the time budget was spent).
TRIAL_STATUSES: Final = ("ok", "refused", "failed", "skipped")


def stage_of_graph(name: str) -> str:
    """The stage a CosyVoice2/3 graph belongs to: ``llm*`` -> llm, ``hift*`` -> hift, the rest -> flow."""
    if name.startswith("llm"):
        return "llm"
    if name.startswith("hift"):
        return "hift"
    return "flow"


def summarise_times(times: Sequence[float]) -> tuple[float, float]:
    """(median, spread = max - min) of ``times`` in seconds; (inf, 0) when there are none."""
    if not times:
        return float("inf"), 0.0
    return float(statistics.median(times)), float(max(times) - min(times))


@dataclass(frozen=True)
class Trial:
    """One candidate engine set (``backend``/``precision``) on one stage."""

    backend: str
    precision: str
    status: str
    times_s: tuple[float, ...] = ()
    quality: dict[str, float] = field(default_factory=dict)  # metric -> value (verify.quality.THRESHOLDS)
    reason: str = ""

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.precision}"

    @property
    def median_s(self) -> float:
        return summarise_times(self.times_s)[0]

    @property
    def spread_s(self) -> float:
        return summarise_times(self.times_s)[1]

    def to_dict(self) -> dict[str, Any]:
        median, spread = summarise_times(self.times_s)
        return {
            "backend": self.backend,
            "precision": self.precision,
            "status": self.status,
            "times_s": [round(value, 6) for value in self.times_s],
            "median_s": None if not self.times_s else round(median, 6),
            "spread_s": None if not self.times_s else round(spread, 6),
            "quality": {key: _finite(value) for key, value in self.quality.items()},
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Trial:
        return cls(
            backend=str(raw["backend"]),
            precision=str(raw["precision"]),
            status=str(raw["status"]),
            times_s=tuple(float(value) for value in raw.get("times_s", ())),
            quality={str(key): _unfinite(value) for key, value in dict(raw.get("quality", {})).items()},
            reason=str(raw.get("reason", "")),
        )


@dataclass(frozen=True)
class StageTuning:
    """The choice for one stage: the engines its graphs come from, why, and every trial."""

    stage: str
    backend: str
    precision: str
    reason: str
    trials: tuple[Trial, ...] = ()
    threads: dict[str, float] | None = None  # optional: median seconds per thread count (1 vs all cores)

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.precision}"

    def to_dict(self) -> dict[str, Any]:
        raw: dict[str, Any] = {
            "backend": self.backend,
            "precision": self.precision,
            "reason": self.reason,
            "candidates": [trial.to_dict() for trial in self.trials],
        }
        if self.threads is not None:
            raw["threads"] = dict(self.threads)
        return raw

    @classmethod
    def from_dict(cls, stage: str, raw: Mapping[str, Any]) -> StageTuning:
        threads = raw.get("threads")
        return cls(
            stage=stage,
            backend=str(raw["backend"]),
            precision=str(raw["precision"]),
            reason=str(raw.get("reason", "")),
            trials=tuple(Trial.from_dict(item) for item in raw.get("candidates", ())),
            threads=None if threads is None else {str(k): float(v) for k, v in dict(threads).items()},
        )


@dataclass(frozen=True)
class TuningRecord:
    """The whole tuning of one build: where it ran and what each stage chose."""

    cpu: str
    flags: tuple[str, ...]
    machine: str  # ``native_guard.Machine.key`` of the CPU (model + flags digest)
    threads: int
    budget_s: float
    spent_s: float
    stages: dict[str, StageTuning]

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpu": self.cpu,
            "flags": list(self.flags),
            "machine": self.machine,
            "threads": self.threads,
            "budget_s": round(self.budget_s, 3),
            "spent_s": round(self.spent_s, 3),
            "stages": {name: stage.to_dict() for name, stage in self.stages.items()},
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> TuningRecord:
        return cls(
            cpu=str(raw["cpu"]),
            flags=tuple(str(flag) for flag in raw.get("flags", ())),
            machine=str(raw["machine"]),
            threads=int(raw["threads"]),
            budget_s=float(raw["budget_s"]),
            spent_s=float(raw["spent_s"]),
            stages={
                str(name): StageTuning.from_dict(str(name), item) for name, item in raw["stages"].items()
            },
        )

    def summary(self) -> str:
        """One line: ``llm onnxruntime/int4, flow openvino/bf16, hift onnxruntime/int4``."""
        return ", ".join(f"{name} {stage.label}" for name, stage in self.stages.items())


def warn_if_tuned_elsewhere(
    record: TuningRecord | None, engines_dir: Any, machine_key: str, cpu: str
) -> bool:
    """Log one line when ``record`` was measured on another CPU than ``machine_key``; True when it was."""
    if record is None or record.machine == machine_key:
        return False
    _LOGGER.warning(
        "these engines were tuned on %s; this is %s: their per-stage choice (%s) may not be the fastest "
        "here. Re-tune on this machine: `trt-cosy build --model-dir DIR --out %s --force`.",
        record.cpu,
        cpu,
        record.summary(),
        engines_dir,
    )
    return True


def _finite(value: float) -> float | str:
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)  # JSON has no inf/nan
    return value


def _unfinite(value: Any) -> float:
    return float(value)
