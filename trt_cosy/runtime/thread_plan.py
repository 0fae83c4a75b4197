"""How this machine's cores are best split among engines, measured on it: the record and the choice.

``trt-cosy tune-threads`` (``bench.thread_split``) times splits of the CPU budget (``runtime.cpu_budget``)
on the machine itself: one engine with the default threads, unpinned (what trt-cosy does without a plan),
the same pinned, one-thread replicas filling the machine, and the splits between (replicas of 2, 4, ...
threads, each within one NUMA node), every replica of a split busy at once. This module holds what was
measured (``SplitTrial``), the choice for each objective (``choose_split``: pure) and where the record
lives (``write_plan``/``find_plan``), so that ``serve`` (``--workers auto``, and one engine's threads),
Ray (``--replicas auto``) and Triton (``--instances auto``) read one answer.

* **throughput**: aggregate audio seconds per second with every replica busy (sum over replicas of
  1 / RTF);
* **latency**: first audio of a streaming request (a known 5 s voice) with every replica busy, the
  slowest replica's.

Today's default (one engine, default threads, unpinned) stays unless another split measured at least
``MARGIN`` better for the objective: no change for one engine on a machine of its own except where
measured faster.

A plan holds for the engines (``engines_id``: the digest of their manifest), the CPU (``native_guard``'s
machine key) and the budget (``budget_key``: usable cores per NUMA node, SMT, quota) it was measured
with; a plan for anything else is not used (logged). It is written next to the engines
(``thread_plans/<machine>-<budget>.json``), or into the trt-cosy cache where that folder is read-only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..cache_dir import cache_root
from ..errors import InputError
from .cpu_budget import CpuBudget

__all__ = [
    "MARGIN", "OBJECTIVES", "ONE_ENGINE", "PLAN_DIR", "SplitTrial", "SplitChoice", "ThreadPlan", "budget_key",
    "choose_all", "choose_split", "engines_id", "find_plan", "planned_split", "write_plan"
]

_LOGGER = logging.getLogger(__name__)

OBJECTIVES: Final = ("throughput", "latency")
ONE_ENGINE: Final = "one-engine"  # the choice for one engine alone: the single-engine split of lowest RTF
MARGIN: Final = 0.05  # another split must be this much better than today's default to replace it
PLAN_DIR: Final = "thread_plans"  # in the engines directory
_CACHE_DIR: Final = "thread-plans"  # in the trt-cosy cache, for read-only engines directories
_FORMAT: Final = 1


def engines_id(engines_dir: Path) -> str:
    """A digest of the engines' ``manifest.json`` (a rebuild gives a new one)."""
    data = (Path(engines_dir) / "manifest.json").read_bytes()
    return hashlib.sha256(data).hexdigest()[:16]


def budget_key(budget: CpuBudget) -> str:
    """What a split depends on besides the CPU model: usable cores per NUMA node, SMT and the quota."""
    per_node = [sum(1 for core in budget.cores if core.node == node) for node in budget.nodes]
    quota = "none" if budget.quota_cpus is None else f"{budget.quota_cpus:g}"
    return f"u{budget.usable_cores}-n{'.'.join(map(str, per_node))}-smt{budget.smt}-q{quota}"


def _split_dict(split: SplitTrial | SplitChoice) -> dict[str, Any]:
    """What a trial and a choice both record: ``replicas`` engines of ``threads`` threads, pinned or not."""
    return {"replicas": split.replicas, "threads": split.threads, "pinned": split.pinned}


def _split_of(raw: Mapping[str, Any]) -> tuple[int, int, bool]:
    """``_split_dict`` read back: ``(replicas, threads, pinned)``."""
    return int(raw["replicas"]), int(raw["threads"]), bool(raw["pinned"])


@dataclass(frozen=True)
class SplitTrial:
    """One split timed: ``replicas`` engines of ``threads`` threads each, busy at once."""

    replicas: int
    threads: int
    pinned: bool
    status: str  # ok | failed | skipped
    rtf: tuple[float, ...] = ()
    """Each replica's median RTF (compute seconds per audio second) while all ran."""
    first_audio_s: tuple[float, ...] = ()
    """Each replica's median first audio of a streaming request, seconds."""
    reason: str = ""

    @property
    def label(self) -> str:
        pin = "pinned" if self.pinned else "unpinned"
        return f"{self.replicas} x {self.threads} thread{'s' if self.threads > 1 else ''}, {pin}"

    @property
    def throughput(self) -> float:
        """Audio seconds per second of all replicas together (0 when not measured)."""
        return sum(1.0 / value for value in self.rtf if value > 0) if self.ok else 0.0

    @property
    def first_audio(self) -> float:
        """The slowest replica's first audio, seconds (inf when not measured)."""
        return max(self.first_audio_s) if self.ok and self.first_audio_s else math.inf

    @property
    def ok(self) -> bool:
        return self.status == "ok" and bool(self.rtf)

    def score(self, objective: str) -> float:
        """Higher is better: audio s per s, or 1 / first audio."""
        if objective == "throughput":
            return self.throughput
        return 0.0 if math.isinf(self.first_audio) else 1.0 / self.first_audio

    def to_dict(self) -> dict[str, Any]:
        return {
            **_split_dict(self),
            "status": self.status,
            "rtf": [round(value, 4) for value in self.rtf],
            "first_audio_s": [round(value, 4) for value in self.first_audio_s],
            "throughput": round(self.throughput, 4),
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> SplitTrial:
        return cls(
            *_split_of(raw),
            str(raw["status"]),
            tuple(float(v) for v in raw.get("rtf", ())),
            tuple(float(v) for v in raw.get("first_audio_s", ())),
            str(raw.get("reason", "")),
        )


@dataclass(frozen=True)
class SplitChoice:
    """What to run for one objective: ``replicas`` engines of ``threads`` threads, pinned or not."""

    objective: str
    replicas: int
    threads: int
    pinned: bool
    default: bool
    """True: today's default (one engine, default threads, unpinned) was kept."""
    reason: str

    def describe(self) -> str:
        pin = "pinned" if self.pinned else "unpinned"
        return f"{self.objective}: {self.replicas} x {self.threads} thread(s), {pin} ({self.reason})"

    def to_dict(self) -> dict[str, Any]:
        return {**_split_dict(self), "default": self.default, "reason": self.reason}

    @classmethod
    def from_dict(cls, objective: str, raw: Mapping[str, Any]) -> SplitChoice:
        return cls(objective, *_split_of(raw), bool(raw["default"]), str(raw.get("reason", "")))


def _is_default(trial: SplitTrial, usable_cores: int) -> bool:
    return trial.replicas == 1 and trial.threads == usable_cores and not trial.pinned


def choose_split(
    trials: Sequence[SplitTrial], objective: str, usable_cores: int, margin: float = MARGIN
) -> SplitChoice:
    """The split for ``objective``: the best measured, unless today's default is within ``margin`` of it
    (or was the only one measured); the default when nothing was measured."""
    if objective not in OBJECTIVES:
        raise InputError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}.")
    measured = [trial for trial in trials if trial.ok]
    default = next((trial for trial in measured if _is_default(trial, usable_cores)), None)
    unit = "audio s per s" if objective == "throughput" else "s first audio"

    def shown(trial: SplitTrial) -> str:
        value = trial.throughput if objective == "throughput" else trial.first_audio
        return f"{value:.3g} {unit}"

    if not measured:
        return SplitChoice(objective, 1, usable_cores, False, True, "nothing measured: today's default")
    best = max(measured, key=lambda trial: trial.score(objective))

    def best_chosen(reason: str) -> SplitChoice:
        return SplitChoice(objective, best.replicas, best.threads, best.pinned, False, reason)

    if default is None:
        return best_chosen(f"{best.label}: {shown(best)}, the best measured (the default was not measured)")
    if best is default or best.score(objective) < default.score(objective) * (1 + margin):
        if best is default:
            reason = f"default kept: {shown(default)}, the best measured"
        else:
            reason = (
                f"default kept: {shown(default)}; the best other, {best.label}, {shown(best)}, is not "
                f"{margin:.0%} better"
            )
        return SplitChoice(objective, 1, usable_cores, False, True, reason)
    gain = best.score(objective) / default.score(objective) - 1
    return best_chosen(f"{best.label}: {shown(best)}, {gain:.0%} better than the default's {shown(default)}")


def choose_all(trials: Sequence[SplitTrial], usable_cores: int) -> dict[str, SplitChoice]:
    """The choice per objective, and for one engine alone (``ONE_ENGINE``: among the one-replica splits,
    the lowest RTF; what ``serve`` without ``--workers`` runs)."""
    choices = {objective: choose_split(trials, objective, usable_cores) for objective in OBJECTIVES}
    alone = choose_split([trial for trial in trials if trial.replicas == 1], "throughput", usable_cores)
    choices[ONE_ENGINE] = dataclasses.replace(alone, objective=ONE_ENGINE)
    return choices


@dataclass(frozen=True)
class ThreadPlan:
    """A measured split of one machine's cores for one engines directory."""

    machine: str
    cpu: str
    budget: str
    """``budget_key`` of the budget measured with."""
    budget_description: str
    engines_id: str
    workload: str
    measured_at: str
    trials: tuple[SplitTrial, ...]
    choices: dict[str, SplitChoice]

    def choice(self, objective: str) -> SplitChoice:
        return self.choices[objective]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": _FORMAT,
            "machine": self.machine,
            "cpu": self.cpu,
            "budget": self.budget,
            "budget_description": self.budget_description,
            "engines_id": self.engines_id,
            "workload": self.workload,
            "measured_at": self.measured_at,
            "trials": [trial.to_dict() for trial in self.trials],
            "choices": {name: choice.to_dict() for name, choice in self.choices.items()},
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ThreadPlan:
        if raw.get("format") != _FORMAT:
            raise InputError(
                f"thread plan format {raw.get('format')!r} is not {_FORMAT}: run `trt-cosy tune-threads`."
            )
        return cls(
            str(raw["machine"]),
            str(raw["cpu"]),
            str(raw["budget"]),
            str(raw["budget_description"]),
            str(raw["engines_id"]),
            str(raw["workload"]),
            str(raw["measured_at"]),
            tuple(SplitTrial.from_dict(item) for item in raw["trials"]),
            {str(name): SplitChoice.from_dict(str(name), item) for name, item in raw["choices"].items()},
        )

    def table(self) -> str:
        """The trials, one line each: split, RTF and first audio per replica, aggregate."""
        lines = []
        for trial in self.trials:
            if trial.ok:
                rtf = statistics.median(trial.rtf)
                lines.append(
                    f"  {trial.label:30s} RTF {rtf:6.3f} (replicas {_joined(trial.rtf)}), first audio "
                    f"{trial.first_audio:6.3f} s, {trial.throughput:6.3f} audio s per s"
                )
            else:
                lines.append(f"  {trial.label:30s} {trial.status}: {trial.reason}")
        return "\n".join(lines)


def _joined(values: Sequence[float]) -> str:
    return " ".join(f"{value:.3f}" for value in values)


def _file_name(machine: str, budget: str) -> str:
    return f"{machine}-{budget}.json"


def _locations(engines_dir: Path, identity: str, machine: str, budget: str) -> list[Path]:
    name = _file_name(machine, budget)
    return [Path(engines_dir) / PLAN_DIR / name, cache_root() / _CACHE_DIR / f"{identity}-{name}"]


def write_plan(plan: ThreadPlan, engines_dir: Path) -> Path:
    """Write ``plan`` next to the engines, or into the cache where that folder is read-only; its path."""
    text = json.dumps(plan.to_dict(), indent=2) + "\n"
    error: OSError | None = None
    for path in _locations(engines_dir, plan.engines_id, plan.machine, plan.budget):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            staged = path.with_name(path.name + ".tmp")
            staged.write_text(text, encoding="utf-8")
            staged.replace(path)
            return path
        except OSError as exc:  # a read-only engines folder: the cache next
            error = exc
    raise InputError(f"could not write the thread plan for {engines_dir}: {error}")


def find_plan(engines_dir: Path, budget: CpuBudget, machine: str) -> ThreadPlan | None:
    """The plan measured for these engines on this CPU and budget, or None (logged when one exists for
    other engines, another CPU or another budget)."""
    engines_dir = Path(engines_dir)
    try:
        identity = engines_id(engines_dir)
    except OSError:
        return None
    key = budget_key(budget)
    for path in _locations(engines_dir, identity, machine, key):
        try:
            plan = ThreadPlan.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError, InputError) as exc:
            _LOGGER.warning("ignoring the thread plan %s: %s", path, exc)
            continue
        if plan.engines_id != identity:
            _LOGGER.info(
                "the thread plan %s was measured with other engines (rebuilt since); "
                "run `trt-cosy tune-threads --engines %s` again",
                path,
                engines_dir,
            )
            continue
        return plan
    others = sorted((engines_dir / PLAN_DIR).glob("*.json")) if (engines_dir / PLAN_DIR).is_dir() else []
    if others:
        _LOGGER.info(
            "no thread plan for this CPU and budget (%s) in %s (plans there: %s); "
            "run `trt-cosy tune-threads --engines %s` on this machine",
            key,
            engines_dir / PLAN_DIR,
            ", ".join(path.name for path in others),
            engines_dir,
        )
    return None


def planned_split(engines_dir: Path, objective: str, budget: CpuBudget | None = None) -> SplitChoice | None:
    """The measured choice for ``objective`` on this machine (``find_plan`` with this process's budget
    and CPU), or None where none was measured here. ``objective``: one of ``OBJECTIVES`` or ``ONE_ENGINE``."""
    from .cpu_budget import read_budget
    from .native_guard import machine

    plan = find_plan(engines_dir, budget if budget is not None else read_budget(), machine().key)
    return None if plan is None else plan.choice(objective)
