"""Tuned ``trt-cosy build``: each stage's engines chosen by timing the candidates on this machine.

Like TensorRT's kernel timing and FFTW's measured plans, ``trt-cosy build`` without ``--backend`` (and
``--backend auto``, on a machine without a CUDA GPU) builds the CPU candidates this machine can run
(``candidates_here``: ONNX Runtime int4/int8/fp32; OpenVINO bf16/int8 where the CPU has bfloat16
kernels, and fp32), times each stage of each (LLM decode, flow, HiFT) at representative shapes within a
bounded time (``--tune-seconds``), checks each stage against the fp32 ONNX Runtime candidate with the
quality guard's numbers (``verify.quality``), keeps per stage the fastest candidate that passes
(``builder.tuning_policy``, pure) and writes one engines directory whose manifest names each graph's
backend and holds the whole record (``builder.tuned_engines``, ``runtime.tuning_record``).

* The torch export runs once: the candidates share it (``builder.export_reuse``).
* Each candidate is timed in a child process (``runtime.native_guard.run_in_child``): a candidate that
  fails to build, load or run, or crashes natively, is recorded as failed with the reason and the
  others go on.
* ``build`` and ``measure`` are seams: the tests give fakes (made-up times, failing builds).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..errors import EngineMismatchError, TrtCosyError
from ..family_lookup import families_where, family_of_release
from ..runtime.manifest import MANIFEST_NAME, Manifest, hash_checkpoint
from ..runtime.native_guard import Machine, machine, run_in_child
from ..runtime.tuning_record import STAGES, StageTuning, Trial, TuningRecord
from ..verify.quality import THRESHOLDS
from .progress import Progress, emitter
from .tuned_engines import compose_tuned_engines
from .tuning_policy import choose_stage

__all__ = [
    "DEFAULT_TUNE_SECONDS",
    "Candidate",
    "MeasurePlan",
    "REFERENCE",
    "TUNED_FAMILIES",
    "candidates_here",
    "measure_in_child",
    "tune_build",
]

_LOGGER = logging.getLogger(__name__)

DEFAULT_TUNE_SECONDS: Final = 90.0  # the timing phase (builds come first and are not part of it)
TUNED_FAMILIES: Final = families_where(lambda family: family.tuned)  # a separate LLM, flow and HiFT stage each
_MIN_CALLS: Final = 2  # timed calls per stage (after one warm-up call), even past the budget
# Every candidate gets its minimum calls (loading it and one warm-up call per stage are not shortened by
# the budget); candidates are skipped only once this many times the budget is spent.
_HARD_LIMIT: Final = 2.0
_MAX_CALLS: Final = 7
_LLM_TOKENS: Final = 50  # decode steps timed per LLM call (prefill of the quality prompt first)
_WORK_SUFFIX: Final = ".tuning"


@dataclass(frozen=True)
class Candidate:
    """One engine set a stage may come from."""

    backend: str
    precision: str

    @property
    def label(self) -> str:
        return f"{self.backend}/{self.precision}"

    @property
    def key(self) -> tuple[str, str]:
        return (self.backend, self.precision)


REFERENCE: Final = Candidate("onnxruntime", "fp32")  # what the quality guard compares the others with


@dataclass(frozen=True)
class MeasurePlan:
    """What one candidate's timing does: ``stages`` with ``threads`` threads in about ``seconds``; the
    reference writes its outputs to ``reference_data``, the others read them from there."""

    stages: tuple[str, ...]
    threads: int
    seconds: float
    reference_data: Path
    is_reference: bool


Build = Callable[[Candidate, Path, Progress], Path]
Measure = Callable[[Candidate, Path, MeasurePlan], dict[str, Trial]]


def candidates_here(cpu: Machine, openvino: bool, bf16: bool, quantizable: bool = True) -> list[Candidate]:
    """The candidates this machine can run, today's default (ONNX Runtime int4) first.

    ``openvino``: the package is installed; ``bf16``: its CPU plugin has bfloat16 kernels (AVX512-BF16 or
    AMX); ``quantizable``: the family has int8/int4 ONNX Runtime engines. OpenVINO int8 (int8 LLM weights,
    bf16 elsewhere) needs bf16 kernels and an int8 dot-product unit (VNNI or AMX-INT8) in ``cpu.flags``.
    """
    found = [Candidate("onnxruntime", precision) for precision in ("int4", "int8") if quantizable]
    found.append(REFERENCE)
    if openvino:
        if bf16:
            found.append(Candidate("openvino", "bf16"))
            if any(flag in cpu.flags for flag in ("avx512_vnni", "avx_vnni", "amx_int8")):
                found.append(Candidate("openvino", "int8"))
        found.append(Candidate("openvino", "fp32"))
    return found


def _default_candidates(model_dir: Path) -> list[Candidate]:
    import importlib.util

    from ..runtime.backend_choice import cpu_has_bf16_kernels
    quantizable = bool(family_of_release(model_dir).quantized_graphs)
    openvino = importlib.util.find_spec("openvino") is not None
    return candidates_here(machine(), openvino, openvino and cpu_has_bf16_kernels(), quantizable)


def _builder(model_dir: Path) -> Build:
    """The default ``build``: ``builder.engines.build_engines`` of ``model_dir`` for one candidate."""
    from .engines import build_engines

    def build(candidate: Candidate, out_dir: Path, progress: Progress) -> Path:
        return build_engines(
            model_dir,
            out_dir,
            candidate.backend,
            candidate.precision,
            progress=progress,
            backend_reason=f"a tuning candidate ({candidate.label})",
        )

    return build


def tune_build(
    model_dir: Path,
    out_dir: Path,
    *,
    fallback: tuple[str, str],
    budget_s: float = DEFAULT_TUNE_SECONDS,
    threads: int | None = None,
    force: bool = False,
    progress: Progress | None = None,
    candidates: Sequence[Candidate] | None = None,
    build: Build | None = None,
    measure: Measure | None = None,
    keep_candidates: bool = False,
) -> Path:
    """Build, time and choose per stage; write the chosen engines to ``out_dir``; return its path.

    ``fallback`` (backend, precision): today's rule (``runtime.backend_choice``), kept for a stage where
    no candidate was timed and passed, and built untuned when tuning cannot give every stage engines.
    ``candidates``: default ``candidates_here`` for this machine; ``build``/``measure``: the seams
    (default ``builder.engines.build_engines`` and ``measure_in_child``).
    """
    from ..runtime.cpu_budget import default_threads
    from .engines import (  # one staging rule for all builds
        _check_replaceable,
        _swap_into_place,
        build_engines,
    )

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    emit = emitter(_LOGGER, progress)
    family = family_of_release(model_dir)
    if not family.tuned:
        emit(
            f"tuning: {family.name} engines are not tuned (tuning times separate LLM, flow and HiFT stages); "
            f"today's rule: {fallback[0]} {fallback[1]}"
        )
        return build_engines(
            model_dir,
            out_dir,
            *fallback,
            force=force,
            progress=progress,
            backend_reason=f"{family.title} is not tuned; today's rule",
        )
    here = machine()
    threads = threads or default_threads()
    hashes = hash_checkpoint(model_dir)
    if not force and _tuned_current(out_dir, hashes, here, threads):
        emit(
            f"engines in {out_dir} are up to date and were tuned on this CPU; nothing to build "
            "(use --force to build and tune again)"
        )
        return out_dir
    _check_replaceable(out_dir)
    candidates = list(candidates if candidates is not None else _default_candidates(model_dir))
    if REFERENCE not in candidates:
        candidates.append(REFERENCE)  # the quality guard's reference is always built
    build = build or _builder(model_dir)
    measure = measure or measure_in_child
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}{_WORK_SUFFIX}-", dir=out_dir.parent))
    try:
        emit(
            f"tuning: building {len(candidates)} candidates ({', '.join(c.label for c in candidates)}); "
            "the torch export runs once and is shared"
        )
        built, failed = _build_all(candidates, work, build, emit)
        record = _time_and_choose(
            candidates, built, failed, here, threads, budget_s, work, measure, fallback, emit
        )
        missing = [
            stage
            for stage in record.stages.values()
            if (stage.backend, stage.precision) not in {c.key for c in built}
        ]
        if missing:
            emit(
                f"tuning: today's rule ({fallback[0]} {fallback[1]}) did not build here; building it untuned"
            )
            return build_engines(
                model_dir,
                out_dir,
                *fallback,
                force=True,
                progress=progress,
                backend_reason=f"tuning failed ({missing[0].reason}); today's rule",
            )
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
        try:
            compose_tuned_engines(record, {c.key: path for c, path in built.items()}, staging)
            _swap_into_place(staging, out_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        if keep_candidates:
            emit(f"tuning: candidates kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    emit(f"tuned engines in {out_dir}: {record.summary()}")
    return out_dir


def _tuned_current(out_dir: Path, hashes: dict[str, str], here: Machine, threads: int) -> bool:
    if not (out_dir / MANIFEST_NAME).is_file():
        return False
    try:
        manifest = Manifest.read(out_dir)
        manifest.check(out_dir, checkpoint_hashes=hashes)
    except EngineMismatchError as exc:
        _LOGGER.info("tuning again: %s", exc)
        return False
    tuning = manifest.tuning
    return tuning is not None and tuning.machine == here.key and tuning.threads == threads


def _build_all(
    candidates: Sequence[Candidate], work: Path, build: Build, emit: Progress
) -> tuple[dict[Candidate, Path], dict[Candidate, str]]:
    from .export_reuse import shared_exports

    built: dict[Candidate, Path] = {}
    failed: dict[Candidate, str] = {}
    with shared_exports(work / "exports"):
        for candidate in candidates:
            emit(f"tuning: building {candidate.label}")
            try:
                built[candidate] = build(candidate, work / candidate.label.replace("/", "-"), emit)
            except (TrtCosyError, OSError, RuntimeError, ValueError, ImportError) as exc:
                reason = f"build failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                failed[candidate] = reason[:300]
                emit(f"tuning: {candidate.label}: {failed[candidate]}")
    shutil.rmtree(work / "exports", ignore_errors=True)
    return built, failed


def _time_and_choose(
    candidates: Sequence[Candidate],
    built: Mapping[Candidate, Path],
    failed: Mapping[Candidate, str],
    here: Machine,
    threads: int,
    budget_s: float,
    work: Path,
    measure: Measure,
    fallback: tuple[str, str],
    emit: Progress,
) -> TuningRecord:
    """Time every built candidate (the reference first) within ``budget_s``, then choose per stage."""
    order = [c for c in candidates if c == REFERENCE] + [c for c in candidates if c != REFERENCE]
    timed = [c for c in order if c in built]
    emit(
        f"tuning: timing {len(timed)} candidates x {len(STAGES)} stages ({', '.join(STAGES)}) on {here.cpu} "
        f"with {threads} threads, within about {budget_s:.0f} s (at most {_HARD_LIMIT * budget_s:.0f} s; "
        "--tune-seconds; --tune off keeps today's rule)"
    )
    start = time.perf_counter()
    trials: dict[str, list[Trial]] = {stage: [] for stage in STAGES}
    data = work / "reference.npz"
    reference_ok = False
    for index, candidate in enumerate(order):
        if candidate in failed:
            results = {s: Trial(*candidate.key, "failed", reason=failed[candidate]) for s in STAGES}
        elif candidate != REFERENCE and not reference_ok:
            results = {
                s: Trial(*candidate.key, "skipped", reason="the fp32 reference was not measured, so no guard")
                for s in STAGES
            }
        elif time.perf_counter() - start > _HARD_LIMIT * budget_s and candidate != REFERENCE:
            reason = f"time budget spent ({_HARD_LIMIT:g} x {budget_s:.0f} s)"
            results = {s: Trial(*candidate.key, "skipped", reason=reason) for s in STAGES}
        else:
            left = max(budget_s - (time.perf_counter() - start), 0.0)
            seconds = left / max(len([c for c in timed if order.index(c) >= index]), 1)
            plan = MeasurePlan(STAGES, threads, seconds, data, candidate == REFERENCE)
            results = _complete(candidate, measure(candidate, built[candidate], plan))
            if candidate == REFERENCE:
                reference_ok = all(trial.status == "ok" for trial in results.values())
        emit(f"tuning: {candidate.label}: " + ", ".join(_describe(stage, results[stage]) for stage in STAGES))
        for stage in STAGES:
            trials[stage].append(results[stage])
    stages = {
        stage: choose_stage(stage, trials[stage], fallback, THRESHOLDS, REFERENCE.key) for stage in STAGES
    }
    for choice in stages.values():
        emit(f"tuning: {choice.stage} -> {choice.label} ({choice.reason})")
    if threads > 1 and time.perf_counter() - start < _HARD_LIMIT * budget_s:
        stages = _time_one_thread(stages, built, threads, budget_s, data, measure, emit)
    return TuningRecord(
        here.cpu, here.flags, here.key, threads, budget_s, time.perf_counter() - start, stages
    )


def _time_one_thread(
    stages: dict[str, StageTuning],
    built: Mapping[Candidate, Path],
    threads: int,
    budget_s: float,
    data: Path,
    measure: Measure,
    emit: Progress,
) -> dict[str, StageTuning]:
    """Each chosen stage timed again with one thread per graph, recorded beside its time with ``threads``
    (``StageTuning.threads``; what a process running several engines side by side would see). Recorded
    only: the engines' thread count is the loader's choice."""
    groups: dict[Candidate, list[str]] = {}
    for stage, choice in stages.items():
        if Candidate(choice.backend, choice.precision) in built:
            groups.setdefault(Candidate(choice.backend, choice.precision), []).append(stage)
    stages = dict(stages)
    for candidate, names in groups.items():
        plan = MeasurePlan(tuple(names), 1, budget_s / (2 * len(groups)), data, False)
        results = measure(candidate, built[candidate], plan)
        for stage in names:
            trial, chosen = results.get(stage), _chosen_trial(stages[stage])
            if trial is None or trial.status != "ok" or not trial.times_s or chosen is None:
                continue
            timing = {"1": round(trial.median_s, 6), str(threads): round(chosen.median_s, 6)}
            stages[stage] = dataclasses.replace(stages[stage], threads=timing)
            emit(
                f"tuning: {stage} on {candidate.label} with 1 thread: median {trial.median_s:.3f} s "
                f"({threads} threads: {chosen.median_s:.3f} s; recorded, not applied)"
            )
    return stages


def _chosen_trial(choice: StageTuning) -> Trial | None:
    return next(
        (
            t
            for t in choice.trials
            if (t.backend, t.precision) == (choice.backend, choice.precision) and t.times_s
        ),
        None,
    )


def _complete(candidate: Candidate, results: Mapping[str, Trial]) -> dict[str, Trial]:
    """Every stage has a trial (a measure that left one out failed it)."""
    return {
        stage: results.get(stage)
        or Trial(*candidate.key, "failed", reason="not measured (the timing stopped before it)")
        for stage in STAGES
    }


def _describe(stage: str, trial: Trial) -> str:
    if trial.status == "ok" and trial.times_s:
        return f"{stage} {trial.median_s:.3f} s (spread {trial.spread_s:.3f})"
    return f"{stage} {trial.status} ({trial.reason})"


# --- the default measure: one child process per candidate ---------------------------------------------


def measure_in_child(
    candidate: Candidate, engines_dir: Path, plan: MeasurePlan, target: str = f"{__name__}:_measure"
) -> dict[str, Trial]:
    """Time ``plan.stages`` of the engines in ``engines_dir`` in a child process (``target``: ``_measure``).

    The child writes its results after each stage, so a native crash keeps the stages before it and
    fails the one it crashed in (with the signal); a Python error fails the stages left with its message.
    """
    with tempfile.TemporaryDirectory(prefix="trt-cosy-tune-") as scratch:
        out = Path(scratch) / "result.json"
        payload = {
            "engines": str(engines_dir),
            "threads": plan.threads,
            "stages": list(plan.stages),
            "seconds": plan.seconds,
            "reference_data": str(plan.reference_data),
            "is_reference": plan.is_reference,
            "out": str(out),
        }
        outcome = run_in_child(target, payload)
        try:
            raw = json.loads(out.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raw = {"trials": {}, "running": plan.stages[0] if plan.stages else None}
    trials = {stage: Trial.from_dict(item) for stage, item in raw.get("trials", {}).items()}
    if not outcome.ok:
        if outcome.crashed:
            why = f"crashed ({outcome.signal}) while timing {raw.get('running') or 'the engines'}"
        else:
            lines = [line for line in outcome.detail.strip().splitlines() if line.strip()]
            why = f"failed: {lines[-1] if lines else f'exit code {outcome.returncode}'}"
        for stage in plan.stages:
            trials.setdefault(stage, Trial(*candidate.key, "failed", reason=why[:300]))
    return trials


def _measure(
    engines: str,
    threads: int,
    stages: list[str],
    seconds: float,
    reference_data: str,
    is_reference: bool,
    out: str,
) -> None:
    """The child: load the engines, time each stage, compare with the reference's outputs."""
    import numpy as np

    from ..family_lookup import family_of
    from ..runtime.engines import load_engines
    from ..verify.quality import QualityInputs, next_token_agreement, snr_db

    model = load_engines(Path(engines), threads=threads, backend="auto")  # sessions made by the warm-up call
    family = family_of(model.config)
    api = family.build_stages(model, llm_slots=0)  # one request alone: no batching thread
    feeds = family.quality
    inputs = QualityInputs.random(model, seed=0)
    backend, precision = model.backend, Manifest.read(Path(engines)).precision
    stop = np.asarray(sorted(model.config.llm.stop_tokens), np.int64)

    def no_stop_greedy(logp: np.ndarray, decoded: Sequence[int]) -> int:
        masked = logp.copy()  # masked: [V]
        masked[stop[stop < masked.shape[0]]] = -np.inf
        return int(np.argmax(masked))

    def decode() -> None:
        for _ in api.llm.generate(
            inputs.text, inputs.prompt_text, inputs.prompt_speech, no_stop_greedy, _LLM_TOKENS
        ):
            pass

    if is_reference:
        mel = feeds.mel(model, inputs, 0)  # [1, 80, F]
        draws = feeds.vocoder_draws(model, mel.shape[2], 0)
        reference = {
            "logits": feeds.llm_logits(model, inputs),
            "mel": mel,
            "wav": feeds.wav(model, mel, draws),
        }
        np.savez(reference_data, **reference, **{f"draw_{k}": v for k, v in draws.items()})
    with np.load(reference_data) as archive:
        reference = {key: archive[key] for key in archive.files}
    draws = {key[5:]: value for key, value in reference.items() if key.startswith("draw_")}
    work: dict[str, Callable[[], Any]] = {
        "llm": decode,
        "flow": lambda: feeds.mel(model, inputs, 0),
        "hift": lambda: feeds.wav(model, reference["mel"], draws),
    }
    results: dict[str, Any] = {"trials": {}}
    per_stage = seconds / max(len(stages), 1)
    for stage in stages:
        results["running"] = stage
        _write_json(Path(out), results)
        times = _time_calls(work[stage], per_stage)
        quality: dict[str, float] = {}
        if not is_reference:
            if stage == "llm":
                quality["llm_kl_mean"] = next_token_agreement(
                    reference["logits"], feeds.llm_logits(model, inputs)
                )[0]
            elif stage == "flow":
                quality["flow_mel_snr_db"] = snr_db(reference["mel"], feeds.mel(model, inputs, 0))
            else:
                quality["hift_wav_snr_db"] = snr_db(
                    reference["wav"], feeds.wav(model, reference["mel"], draws)
                )
        results["trials"][stage] = Trial(backend, precision, "ok", tuple(times), quality).to_dict()
    results["running"] = None
    _write_json(Path(out), results)


def _time_calls(call: Callable[[], Any], seconds: float) -> list[float]:
    """One warm-up call, then timed calls until ``seconds`` are spent (``_MIN_CALLS`` to ``_MAX_CALLS``)."""
    call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < _MIN_CALLS or (len(times) < _MAX_CALLS and time.perf_counter() - start < seconds):
        begin = time.perf_counter()
        call()
        times.append(time.perf_counter() - begin)
    return times


def _write_json(path: Path, raw: Mapping[str, Any]) -> None:
    staged = path.with_name(path.name + ".tmp")
    staged.write_text(json.dumps(raw), encoding="utf-8")
    staged.replace(path)
