"""``trt-cosy tune-threads``: time splits of this machine's cores among engines and record the choice.

Each split (``candidate_splits``: R replicas of T threads, pinned to the disjoint whole cores of
``CpuBudget.plan(R, T)`` or not) runs as R child processes (``multiprocessing`` spawn), each loading the
engines with T threads and running ``bench.speed.run_bench`` on the same synthetic workload: a
non-streamed run of ``tokens`` speech tokens (its RTF) and a streaming request in a known voice (its first
audio). The replicas wait for each other after their warm-up runs (a barrier), so every timed run
overlaps the others'. The choice per objective and the record are ``runtime.thread_plan``'s.

Splits run in order of how likely they matter (``candidate_splits``); the first two always run, later
ones are skipped once ``seconds`` are spent (recorded as skipped).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import queue
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

from ..errors import InputError
from ..runtime.cpu_budget import CpuBudget, pin_process, read_budget
from ..runtime.native_guard import machine
from ..runtime.thread_plan import SplitTrial, ThreadPlan, budget_key, choose_all, engines_id

__all__ = ["Split", "SplitOptions", "candidate_splits", "measure_split", "parse_splits", "tune_threads"]

_BARRIER_TIMEOUT_S: Final = 1800.0  # a replica that never reaches its barrier (stuck loading) fails the split
# run_bench's progress lines after its warm-up runs (bench.speed._label): where the replicas wait for each other
_SYNC_PREFIXES: Final = ("warm-up:", "streaming warm-up:")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Split:
    """``replicas`` engines of ``threads`` threads (None: the default threads, one engine alone)."""

    replicas: int
    threads: int | None
    pinned: bool


@dataclass(frozen=True)
class SplitOptions:
    """The workload of each replica and the time bound."""

    tokens: int = 100
    """Speech tokens of the non-streamed run (25 per second of audio)."""
    runs: int = 3
    """Timed runs per replica (each: one non-streamed run and one streamed first audio)."""
    warmup: int = 1
    reference_s: float = 5.0
    """Reference length of the known voice the first audio is measured in."""
    seconds: float = 600.0
    """Splits after the first two are skipped once this many seconds are spent."""

    def __post_init__(self) -> None:
        if self.tokens < 30 or self.runs < 1 or self.warmup < 1 or self.seconds <= 0:
            raise InputError(
                "tune-threads needs --tokens >= 30, --runs >= 1, --warmup >= 1 and --seconds > 0."
            )

    def describe(self) -> str:
        return (
            f"per replica: {self.warmup} warm-up then {self.runs} timed runs of {self.tokens} speech tokens "
            f"not streamed (RTF) and a streaming request in a known {self.reference_s:g} s voice (first "
            "audio), medians; every replica of a split busy at once"
        )


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0]


def candidate_splits(budget: CpuBudget) -> list[Split]:
    """Splits of ``budget`` worth timing, in order: today's default (one engine, default threads,
    unpinned); one-thread replicas filling the machine; the default pinned; replicas of each divisor of the
    usable cores that fits one NUMA node; one engine on fewer cores (memory bandwidth)."""
    usable = budget.usable_cores
    node_cores = max(sum(1 for core in budget.cores if core.node == node) for node in budget.nodes)
    splits = [Split(1, None, False)]
    if usable > 1:
        splits.append(Split(usable, 1, True))
    splits.append(Split(1, usable, True))
    splits += [Split(usable // t, t, True) for t in _divisors(usable) if 1 < t < usable and t <= node_cores]
    splits += [Split(1, t, True) for t in _divisors(usable) if t < usable]
    return splits


def parse_splits(text: str, budget: CpuBudget) -> list[Split]:
    """``"1x2,2x1p"``: REPLICASxTHREADS, ``p`` for pinned; ``default`` for one engine unpinned with the
    default threads."""
    splits = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item == "default":
            splits.append(Split(1, None, False))
            continue
        pinned = item.endswith("p")
        try:
            replicas, threads = (int(part) for part in item.rstrip("p").split("x"))
        except ValueError:
            raise InputError(
                f"--splits: {item!r} is not REPLICASxTHREADS[p] (e.g. 2x1p) or 'default'."
            ) from None
        if replicas < 1 or threads < 1 or replicas * threads > budget.usable_cores:
            raise InputError(
                f"--splits: {item!r} needs {replicas * threads} cores; this process may use "
                f"{budget.usable_cores} ({budget.describe()})."
            )
        splits.append(Split(replicas, threads, pinned))
    if not splits:
        raise InputError("--splits names no split.")
    return splits


def _bench_options(options: SplitOptions, threads: int | None) -> Any:
    from .speed import BenchOptions

    wanted = {
        "tokens": options.tokens,
        "runs": options.runs,
        "warmup": options.warmup,
        "stream": True,
        "stream_references": (options.reference_s,),
        "cold_start": False,
        "threads": threads,
        "listen_tokens": 0,
    }
    known = {field.name for field in dataclasses.fields(BenchOptions)}
    return BenchOptions(**{key: value for key, value in wanted.items() if key in known})


def _replica(
    index: int, cpus: Sequence[int], engines: str, bench_options: Any, barrier: Any, results: Any
) -> None:
    """One replica of a split (a spawned child): pin, load, run the workload in step with the others."""
    from .speed import run_bench

    synced = 0

    def in_step(message: str) -> None:
        nonlocal synced
        if message.startswith(_SYNC_PREFIXES):
            barrier.wait(_BARRIER_TIMEOUT_S)
            synced += 1

    try:
        if cpus:
            pin_process(cpus)
        report = run_bench(Path(engines), bench_options, progress=in_step)
        metrics = report["metrics"]
        first = metrics[f"first_audio_ref{bench_options.stream_references[0]:g}s"]["median"]
        results.put(
            {
                "index": index,
                "rtf": metrics["rtf"]["median"],
                "first_audio_s": first,
                "synced": synced,
                "cpus": sorted(os.sched_getaffinity(0)),
            }
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which fails the split
        results.put({"index": index, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        barrier.abort()  # after the report: the parent hears this error before the others' broken barrier


def measure_split(engines: Path, budget: CpuBudget, split: Split, options: SplitOptions) -> SplitTrial:
    """Time ``split`` on ``budget``'s cores: ``split.replicas`` child processes at once."""
    threads = split.threads if split.threads is not None else budget.usable_cores
    slots = budget.plan(split.replicas, threads).slots
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(split.replicas), context.Queue()
    bench_options = _bench_options(options, split.threads)
    children = [
        context.Process(
            target=_replica,
            args=(
                slot.index,
                slot.cpus if split.pinned else (),
                str(engines),
                bench_options,
                barrier,
                results,
            ),
            daemon=True,
        )
        for slot in slots
    ]
    for child in children:
        child.start()
    got: dict[int, dict[str, Any]] = {}
    failure = None
    try:
        while len(got) < len(children) and failure is None:
            try:
                item = results.get(timeout=1.0)
            except queue.Empty:  # a replica that died natively sends nothing: the others would wait
                crashed = [i for i, c in enumerate(children) if i not in got and c.exitcode not in (None, 0)]
                if crashed:
                    failure = f"replica {crashed[0]} exited with code {children[crashed[0]].exitcode}"
                continue
            got[item["index"]] = item
            failure = item.get("error")
    finally:
        if failure is not None:
            barrier.abort()
        for child in children:
            child.join(1 if failure is not None else 60)
            if child.is_alive():
                child.kill()
                child.join(10)
    trial = (split.replicas, threads, split.pinned)
    if failure is None:
        failure = _out_of_step(got, slots, split.pinned)
    if failure is not None:
        return SplitTrial(*trial, "failed", reason=failure)
    ordered = [got[index] for index in sorted(got)]
    return SplitTrial(
        *trial, "ok", tuple(item["rtf"] for item in ordered), tuple(item["first_audio_s"] for item in ordered)
    )


def _out_of_step(got: dict[int, dict[str, Any]], slots: Sequence[Any], pinned: bool) -> str | None:
    """Why the replicas' figures do not measure the split (None: they do): a replica that did not wait
    for the others at both barriers, or ran on other CPUs than its slot's."""
    for slot in slots:
        item = got[slot.index]
        if item["synced"] != len(_SYNC_PREFIXES):
            return (
                f"replica {slot.index} passed {item['synced']} of {len(_SYNC_PREFIXES)} barriers: the replicas "
                "did not run in step (bench.speed's progress lines changed?)"
            )
        if pinned and item["cpus"] != list(slot.cpus):
            return f"replica {slot.index} ran on CPUs {item['cpus']}, not its slot's {list(slot.cpus)}"
    return None


def tune_threads(
    engines: Path,
    options: SplitOptions | None = None,
    splits: Sequence[Split] | None = None,
    progress: Progress | None = None,
    budget: CpuBudget | None = None,
    measure: Callable[[Path, CpuBudget, Split, SplitOptions], SplitTrial] = measure_split,
) -> ThreadPlan:
    """Time ``splits`` (default ``candidate_splits``) of this machine's budget and choose per objective.

    ``measure`` is a seam for tests (made-up trials)."""
    options = options or SplitOptions()
    emit = progress or (lambda message: None)
    engines = Path(engines)
    budget = budget if budget is not None else read_budget()
    splits = list(splits) if splits is not None else candidate_splits(budget)
    here = machine()
    emit(
        f"tune-threads: {budget.describe()}; {len(splits)} splits within about {options.seconds:.0f} s "
        f"({options.describe()})"
    )
    start = time.perf_counter()
    trials = []
    for index, split in enumerate(splits):
        threads = split.threads if split.threads is not None else budget.usable_cores
        if index >= 2 and time.perf_counter() - start > options.seconds:
            trial = SplitTrial(
                split.replicas,
                threads,
                split.pinned,
                "skipped",
                reason=f"time budget spent ({options.seconds:.0f} s)",
            )
        else:
            began = time.perf_counter()
            trial = measure(engines, budget, split, options)
            emit(
                f"tune-threads: {trial.label}: "
                + (
                    f"RTF {statistics.median(trial.rtf):.3f}, first audio {trial.first_audio:.3f} s, "
                    f"{trial.throughput:.3f} audio s per s ({time.perf_counter() - began:.0f} s)"
                    if trial.ok
                    else f"{trial.status}: {trial.reason}"
                )
            )
        trials.append(trial)
    choices = choose_all(trials, budget.usable_cores)
    for choice in choices.values():
        emit(f"tune-threads: {choice.describe()}")
    return ThreadPlan(
        machine=here.key,
        cpu=here.cpu,
        budget=budget_key(budget),
        budget_description=budget.describe(),
        engines_id=engines_id(engines),
        workload=options.describe(),
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        trials=tuple(trials),
        choices=choices,
    )
