"""TensorRT engines: strongly typed fp16 graphs, profiles, plans, timing cache and their records.

Two steps, so that a GPU host never needs torch:

1. ``prepare_trt_graphs`` (build time, CPU, no TensorRT): after the fp32 export, writes
   ``<graph>.fp16.onnx`` (precision fp16; fp32 builds use ``<graph>.onnx`` as it is), ``profiles.json``
   and ``tensorrt.json`` (precision, checkpoint digest, each graph's ONNX sha256, fp16 report and the
   fp16-vs-fp32 error measured on ONNX Runtime) and ``parity/<graph>.npz`` (the export's feeds and
   the fp32 graph's outputs, ``builder.trt.parity``). This is all ``--onnx-only`` does.
2. ``build_plans`` (GPU host, TensorRT, no torch, no onnx): parses each graph, adds the profiles,
   builds a strongly typed network, writes ``plans/<graph>.plan`` atomically with a
   ``plans/<graph>.json`` record keyed by checkpoint digest + GPU name + compute capability +
   TensorRT version + precision + profiles + ONNX sha256, and persists ``plans/timing.cache``. Each
   new plan runs on its parity feeds against the fp32 outputs: NaN/inf or an error above
   ``PLAN_TOLERANCES`` removes it and fails the build; ``plans/parity.json`` records the errors. A plan
   whose record does not match the running system is rebuilt; the runtime refuses it
   (``runtime.backends.tensorrt.runner.plan_mismatch``). The Docker entrypoint runs this step on first start.

The ``plans/`` directory is per GPU and TensorRT version: it is not listed in ``manifest.json``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from ...config import ModelConfig
from ...errors import EngineMismatchError, InputError, TrtCosyError
from ...family_lookup import families_where, family_named
from ...runtime.backends.tensorrt.runner import (
    PLANS_DIR,
    PlanRecord,
    checkpoint_digest,
    current_system,
    load_tensorrt,
    plan_mismatch,
    shared_runtime,
    trt_logger,
)
from ...runtime.graphs import FLOW_ESTIMATOR_INCREMENTAL, FLOW_STEP_INCREMENTAL
from ...runtime.incremental_profiles import incremental_profiles
from ...runtime.llm_decode import LLM_DECODE_NAME
from ...runtime.manifest import file_sha256
from ...runtime.profiles import (
    PROFILES_NAME,
    GraphProfiles,
    ProfileLimits,
    default_profiles,
    llm_decode_profiles,
    read_profiles,
    step_profiles,
    trt_graph_specs,
    write_profiles,
)
from ...version import __version__
from ..progress import emitter
from .parity import (
    PARITY_DIR,
    PLAN_TOLERANCES,
    check_plan,
    read_parity_feeds,
    record_parity,
    write_parity_feeds,
)

__all__ = [
    "TRT_PRECISIONS", "TRT_FAMILIES", "TRT_SUMMARY_NAME", "TIMING_CACHE_NAME", "prepare_trt_graphs",
    "build_plans", "build_plan", "graph_file"
]

_LOGGER = logging.getLogger(__name__)

TRT_PRECISIONS: Final = ("fp16", "fp32")
# Model families whose graph sets prepare_trt_graphs() and the profiles know (``Family.trt_engines``).
TRT_FAMILIES: Final = families_where(lambda family: family.trt_engines)
TRT_SUMMARY_NAME: Final = "tensorrt.json"
TIMING_CACHE_NAME: Final = "timing.cache"
INCREMENTAL_NAME: Final = FLOW_ESTIMATOR_INCREMENTAL.name  # optional, as llm_decode (exported for v2)
INCREMENTAL_STEP_NAME: Final = FLOW_STEP_INCREMENTAL.name  # its device Euler step, made with it

Progress = Callable[[str], None]


def graph_file(graph: str, precision: str) -> str:
    """The ONNX file a plan is built from: ``<graph>.fp16.onnx`` for fp16, the export itself for fp32."""
    return f"{graph}.fp16.onnx" if precision == "fp16" else f"{graph}.onnx"


def prepare_trt_graphs(
    engines_dir: Path,
    config: Any,
    checkpoint_hashes: Mapping[str, str],
    precision: str = "fp16",
    *,
    limits: ProfileLimits | None = None,
    measure: bool = True,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Write the TensorRT inputs next to the fp32 ``<graph>.onnx`` files of ``engines_dir``.

    Every graph of ``config.family``'s set (``Family.graphs``). Needs onnx and onnxruntime,
    never TensorRT. Returns the ``tensorrt.json`` content. The fp16 pass calibrates its range islands
    on the export's sample and parity feeds; ``measure`` compares each fp16 graph with its fp32
    export on the same feeds and raises ``TrtCosyError`` on NaN/inf.
    """
    if precision not in TRT_PRECISIONS:
        raise InputError(
            f"precision {precision!r} is not available for TensorRT; choose {', '.join(TRT_PRECISIONS)}."
        )
    if config.family not in TRT_FAMILIES:
        raise InputError(f"TensorRT engines are not available for model family {config.family!r}.")
    engines_dir = Path(engines_dir)
    emit = emitter(_LOGGER, progress)
    profiles = default_profiles(config, family_named(config.family), limits)
    names = list(family_named(config.family).graphs)
    if (engines_dir / f"{LLM_DECODE_NAME}.onnx").is_file():  # exported for the Qwen2 families
        profiles[LLM_DECODE_NAME] = llm_decode_profiles(config, limits)  # type: ignore[arg-type]
        names.append(LLM_DECODE_NAME)
    steps = [name for name in trt_graph_specs(family_named(config.family)) if name not in names]
    if (engines_dir / f"{INCREMENTAL_NAME}.onnx").is_file():  # CosyVoice2: streaming chunks, new frames only
        profiles[INCREMENTAL_NAME] = incremental_profiles(config, limits)  # type: ignore[arg-type]
        names.append(INCREMENTAL_NAME)
        # its Euler step with the guidance on the device (backends.tensorrt.euler_incremental: x stays there)
        profiles[INCREMENTAL_STEP_NAME] = step_profiles(profiles[INCREMENTAL_NAME], INCREMENTAL_STEP_NAME)
        steps.append(INCREMENTAL_STEP_NAME)
    write_profiles(profiles, engines_dir / PROFILES_NAME)
    graphs: dict[str, Any] = {}
    for name in names:
        graphs[name] = _prepare_graph(engines_dir, name, config, precision, measure, emit)
    for name in steps:
        graphs[name] = _prepare_step_graph(engines_dir, name, config, precision, measure, emit)
    summary = {
        "trt_cosy_version": __version__,
        "family": config.family,
        "precision": precision,
        "checkpoint": checkpoint_digest(checkpoint_hashes),
        "profiles": PROFILES_NAME,
        "graphs": graphs,
    }
    _write_json_atomic(engines_dir / TRT_SUMMARY_NAME, summary)
    return summary


def _export_feeds(name: str, config: Any) -> list[dict[str, Any]]:
    """The export's sample and parity feeds of graph ``name`` (calibration and fp16-vs-fp32 check)."""
    from ..registry import build_family_of  # torch: build time only

    if name == LLM_DECODE_NAME:
        from .llm_decode import llm_decode_plan

        plan = llm_decode_plan(config)  # type: ignore[arg-type]
        return [plan.sample, *plan.parity]
    if name == INCREMENTAL_NAME:
        from ..flow_incremental import incremental_export_plan

        plan = incremental_export_plan(config)  # type: ignore[arg-type]
        return [plan.sample, *plan.parity]
    plan = build_family_of(config).export_plan(config, name)
    return [plan.sample, *plan.parity]


def _prepare_graph(
    engines_dir: Path,
    name: str,
    config: Any,
    precision: str,
    measure: bool,
    emit: Progress,
) -> dict[str, Any]:
    source, target = engines_dir / f"{name}.onnx", engines_dir / graph_file(name, precision)
    if not source.is_file():
        raise EngineMismatchError(f"{source} is missing: export the fp32 graphs first (`trt-cosy build`).")
    entry: dict[str, Any] = {"onnx": target.name}
    feeds = _export_feeds(name, config) if measure or precision == "fp16" else []
    if measure:  # the fp32 outputs every plan is checked against once built (builder.trt.parity)
        parity = write_parity_feeds(engines_dir, name, source, feeds)
        entry["parity_feeds"] = parity.relative_to(engines_dir).as_posix()
    if precision == "fp16":
        from ..quantize.precision import compare_fp16, to_fp16_graph  # onnx: build time only
        from ..registry import build_family_of  # torch: build time only

        policy = build_family_of(config).precision_policy(name)
        report = to_fp16_graph(source, target, policy, graph=name, calibration=feeds)
        entry["fp16"] = report.summary()
        if measure:
            errors = compare_fp16(source, target, feeds)
            entry["fp16_vs_fp32_max_error"] = errors
            emit(
                f"{name}: fp16 graph ({report.summary()}); max error vs fp32 "
                + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
            )
        else:
            emit(f"{name}: fp16 graph ({report.summary()})")
    entry["onnx_sha256"] = file_sha256(target)
    return entry


def _prepare_step_graph(
    engines_dir: Path, name: str, config: ModelConfig, precision: str, measure: bool, emit: Progress
) -> dict[str, Any]:
    """``<step>[.fp16].onnx``: the prepared estimator graph wrapped with guidance and the Euler update
    (``builder.flow_step``), for the device-side solve (``runtime.backends.tensorrt.euler.DeviceEulerLoop``)."""
    from ...runtime.graphs import STEP_GRAPHS
    from ..flow_step import write_flow_step

    estimator = next(est for est, step in STEP_GRAPHS.items() if step.name == name)
    target = engines_dir / graph_file(name, precision)
    rate = config.flow.cfm.inference_cfg_rate
    write_flow_step(engines_dir / graph_file(estimator, precision), target, rate)
    emit(f"{name}: {estimator} + guidance (rate {rate}) + Euler update")
    entry = {"onnx": target.name, "derived_from": estimator, "onnx_sha256": file_sha256(target)}
    if measure:  # the estimator's feeds as one step (x and t at batch 1, dt 0.1), against the fp32 step
        feeds = [
            {**feed, "x": feed["x"][:1], "t": feed["t"][:1], "dt": np.array([0.1], np.float32)}
            for feed in _export_feeds(estimator, config)
        ]
        with tempfile.TemporaryDirectory() as scratch:
            fp32_step = Path(scratch) / f"{name}.onnx"
            write_flow_step(engines_dir / f"{estimator}.onnx", fp32_step, rate)
            parity = write_parity_feeds(engines_dir, name, fp32_step, feeds)
        entry["parity_feeds"] = parity.relative_to(engines_dir).as_posix()
    return entry


def build_plans(
    engines_dir: Path,
    *,
    force: bool = False,
    timing_cache: Path | None = None,
    workspace_bytes: int | None = None,
    slots: int = 1,
    progress: Progress | None = None,
) -> dict[str, PlanRecord]:
    """Build (or keep, when current) ``plans/<graph>.plan`` for every graph of a prepared engines dir.

    Needs an NVIDIA GPU, tensorrt and cuda-python; not torch or onnx. Without them raises
    ``MissingDependencyError`` saying that plans need TensorRT. ``timing_cache`` defaults to
    ``plans/timing.cache`` and is loaded before and saved after every plan. ``slots``: how many
    execution contexts may run each plan at once (the plan holds its profiles once per slot).
    """
    engines_dir = Path(engines_dir)
    emit = emitter(_LOGGER, progress)
    summary = _read_summary(engines_dir)
    profiles = read_profiles(engines_dir / summary["profiles"])
    trt = load_tensorrt()
    system = current_system(trt)
    plans_dir = engines_dir / PLANS_DIR
    plans_dir.mkdir(exist_ok=True)
    cache_path = Path(timing_cache) if timing_cache else plans_dir / TIMING_CACHE_NAME
    records = {}
    total, started = len(summary["graphs"]), time.perf_counter()
    for number, (name, entry) in enumerate(summary["graphs"].items(), 1):
        step = f"[{number}/{total}, {time.perf_counter() - started:.0f} s] {name}"
        record = PlanRecord(
            graph=name,
            onnx=entry["onnx"],
            onnx_sha256=entry["onnx_sha256"],
            precision=summary["precision"],
            checkpoint=summary["checkpoint"],
            profiles=profiles[name].to_dict(),
            plan=f"{name}.plan",
            system=system,
            trt_cosy_version=__version__,
            slots=max(1, int(slots)),
        )
        old = _read_record(plans_dir / f"{name}.json")
        reason = "forced" if force else _stale_reason(old, record, plans_dir)
        if reason is None:
            emit(f"{step}: plan is current for {system['gpu']} / TensorRT {system['tensorrt']}; kept")
        else:
            emit(f"{step}: building TensorRT plan ({reason})")
            build_plan(
                engines_dir / record.onnx,
                plans_dir / record.plan,
                profiles[name],
                cache_path,
                workspace_bytes=workspace_bytes,
                slots=record.slots,
                trt=trt,
                progress=emit,
            )
            _check_plan_parity(engines_dir, name, record, profiles[name], emit)
            _write_json_atomic(plans_dir / f"{name}.json", record.to_dict())
        records[name] = record
    return records


def _plan_runner(path: Path, name: str, profiles: GraphProfiles) -> Any:
    """A one-slot ``TrtRunner`` over a freshly built plan, every input fed (the parity check)."""
    from ...runtime.backends.tensorrt.runner import TrtRunner

    return TrtRunner.from_plan(path, name, profiles, slots=1)


def _check_plan_parity(
    engines_dir: Path, name: str, record: PlanRecord, profiles: GraphProfiles, emit: Progress
) -> None:
    """Run the new plan on ``parity/<name>.npz`` against the fp32 outputs (``builder.trt.parity``);
    on NaN/inf or an error above the precision's tolerance remove the plan and raise."""
    plans_dir = engines_dir / PLANS_DIR
    feeds = engines_dir / PARITY_DIR / f"{name}.npz"
    if not feeds.is_file():
        emit(f"{name}: no parity feeds ({feeds.name}; prepared without measuring): plan not checked")
        record_parity(plans_dir, name, {"feeds": 0, "skipped": "no parity feeds"})
        return
    runner = _plan_runner(plans_dir / str(record.plan), name, profiles)
    try:
        result = check_plan(name, runner.infer, read_parity_feeds(feeds), PLAN_TOLERANCES[record.precision])
    except TrtCosyError:
        (plans_dir / str(record.plan)).unlink(missing_ok=True)
        record_parity(plans_dir, name, None)
        raise
    finally:
        runner.free()
    record_parity(plans_dir, name, result)
    emit(
        f"{name}: plan vs fp32 ONNX on {result['feeds']} feed(s): "
        + ", ".join(f"{k} {v:.2e}" for k, v in result["max_error"].items())
    )


def _stale_reason(old: PlanRecord | None, new: PlanRecord, plans_dir: Path) -> str | None:
    if old is None:
        return "no plan yet"
    if not (plans_dir / (old.plan or "")).is_file():
        return "plan file missing"
    if old.slots != new.slots:
        return f"built for {old.slots} slot(s), {new.slots} wanted"
    return plan_mismatch(
        old,
        new.system or {},
        checkpoint=new.checkpoint,
        precision=new.precision,
        profiles=new.profiles,
        onnx_sha256=new.onnx_sha256,
    )


def build_plan(
    onnx_path: Path,
    plan_path: Path,
    profiles: GraphProfiles,
    timing_cache: Path | None = None,
    *,
    workspace_bytes: int | None = None,
    slots: int = 1,
    trt: Any = None,
    progress: Progress | None = None,
) -> Path:
    """Parse ``onnx_path`` into a strongly typed network, add ``profiles``, build, write ``plan_path`` atomically.

    The profiles are added once per slot (slot k uses profiles k·P … k·P + P − 1): execution
    contexts in concurrent use must use separate profiles (``NvInferRuntime.h``, ``IExecutionContext``).
    Parser errors, a rejected profile and graph inputs that the profiles do not name (or that
    TensorRT dropped from the plan because nothing uses them) raise ``TrtCosyError`` before a plan
    is written, so a plan the runtime would refuse is never written. The timing cache is read from
    and written back to ``timing_cache`` when given.
    """
    trt = trt or load_tensorrt()
    emit = emitter(_LOGGER, progress)
    start = time.perf_counter()
    builder = trt.Builder(trt_logger(trt))
    network = builder.create_network(_strongly_typed_flags(trt))
    parser = trt.OnnxParser(network, trt_logger(trt))
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise TrtCosyError(
            f"TensorRT could not parse {onnx_path}: " + "; ".join(errors or ["no parser message"])
        )
    network_inputs = [network.get_input(i).name for i in range(network.num_inputs)]
    _check_inputs(onnx_path, "the parsed network", network_inputs, profiles)
    config = builder.create_builder_config()
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_bytes))
    cache = _load_timing_cache(config, timing_cache)
    _add_profiles(builder, config, profiles, max(1, int(slots)), onnx_path)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise TrtCosyError(
            f"TensorRT failed to build a plan from {onnx_path} (see the TensorRT errors logged above)."
        )
    _check_plan_inputs(trt, serialized, onnx_path, profiles)
    _write_bytes_atomic(Path(plan_path), memoryview(serialized))
    if timing_cache is not None and cache is not None:
        _write_bytes_atomic(Path(timing_cache), memoryview(config.get_timing_cache().serialize()))
    emit(f"{Path(plan_path).name}: built in {time.perf_counter() - start:.0f} s")
    return Path(plan_path)


def _add_profiles(builder: Any, config: Any, profiles: GraphProfiles, slots: int, onnx_path: Path) -> None:
    """Add every profile once per slot; TensorRT returns -1 for a profile it rejects (``NvInfer.h``,
    ``IBuilderConfig::addOptimizationProfile``) and the binding raises on inconsistent shapes."""
    for profile in profiles.profiles:
        empty = profile.empty_opt()
        if empty:  # TensorRT tunes at opt: an empty opt tunes the plan for no work (issue 29 item 7)
            raise TrtCosyError(
                f"{onnx_path}: profile '{profile.name}' has an empty opt shape for {empty}; TensorRT tunes "
                "its kernels at opt. Give every opt dimension at least 1 (runtime/profiles.py)."
            )
    for slot in range(slots):
        for local, profile in enumerate(profiles.profiles):
            expected = slot * len(profiles.profiles) + local
            try:
                index = config.add_optimization_profile(profile.to_trt(builder))
            except (
                RuntimeError
            ) as exc:  # IOptimizationProfile.set_shape: "Shape provided ... is inconsistent"
                raise TrtCosyError(f"{onnx_path}: TensorRT rejects profile '{profile.name}': {exc}") from exc
            if index != expected:
                raise TrtCosyError(
                    f"{onnx_path}: TensorRT rejected profile '{profile.name}' (slot {slot}: "
                    f"add_optimization_profile returned {index}, expected {expected}); its shapes do not fit "
                    "the graph's inputs. Fix the profiles (runtime/profiles.py) for this graph."
                )


def _check_inputs(onnx_path: Path, where: str, inputs: list[str], profiles: GraphProfiles) -> None:
    named = set(profiles.input_names)
    if set(inputs) == named:
        return
    dropped, unnamed = sorted(named - set(inputs)), sorted(set(inputs) - named)
    hint = (
        f" TensorRT drops graph inputs that nothing uses: {dropped} must feed the graph's outputs, or leave "
        "the graph contract and the profiles."
        if dropped
        else ""
    )
    raise TrtCosyError(
        f"{onnx_path}: {where} has inputs {sorted(inputs)}, the profiles name {sorted(named)} "
        f"(missing {dropped}, unnamed {unnamed}).{hint} The runtime would refuse this plan."
    )


def _check_plan_inputs(trt: Any, serialized: Any, onnx_path: Path, profiles: GraphProfiles) -> None:
    """The built plan's inputs, as the runtime will see them (unused inputs are gone by now)."""
    engine = shared_runtime(trt).deserialize_cuda_engine(serialized)
    if engine is None:
        raise TrtCosyError(f"TensorRT cannot load the plan it just built from {onnx_path}.")
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    _check_inputs(onnx_path, "the built plan", inputs, profiles)


def _strongly_typed_flags(trt: Any) -> int:
    # TensorRT 10.12+ opts in with this flag; 11.x is always strongly typed and ignores it.
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def _load_timing_cache(config: Any, path: Path | None) -> Any:
    data = Path(path).read_bytes() if path is not None and Path(path).is_file() else b""
    cache = config.create_timing_cache(data)
    if cache is None or not config.set_timing_cache(cache, False):
        _LOGGER.warning("timing cache %s does not fit this TensorRT/GPU; starting an empty one", path)
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
    return cache


def _read_summary(engines_dir: Path) -> dict[str, Any]:
    path = engines_dir / TRT_SUMMARY_NAME
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
        summary["graphs"], summary["precision"], summary["checkpoint"]  # noqa: B018 - presence check
        return summary
    except (OSError, ValueError, KeyError) as exc:
        raise EngineMismatchError(
            f"{engines_dir} has no usable {TRT_SUMMARY_NAME} ({exc!r}): it was not built for TensorRT. Run "
            f"`trt-cosy build --backend tensorrt --model-dir DIR --out {engines_dir}`."
        ) from exc


def _read_record(path: Path) -> PlanRecord | None:
    try:
        return PlanRecord.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_bytes_atomic(path: Path, data: bytes | memoryview) -> None:
    """Write to a temporary file in the same directory, then rename over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _write_json_atomic(path: Path, value: Mapping[str, Any]) -> None:
    _write_bytes_atomic(path, (json.dumps(value, indent=1) + "\n").encode("utf-8"))


def main(argv: list[str] | None = None) -> int:
    """``python -m trt_cosy.builder.trt.plans ENGINES_DIR [--force]``: build missing or stale plans
    (no torch needed; the Docker entrypoint runs this on every start)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("engines_dir", type=Path)
    parser.add_argument("--force", action="store_true", help="rebuild every plan")
    parser.add_argument("--workspace-mb", type=int, default=None, help="TensorRT workspace limit")
    parser.add_argument(
        "--slots", type=int, default=1, help="execution contexts that may run each plan at once (default 1)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    workspace = args.workspace_mb * 2**20 if args.workspace_mb else None
    try:
        build_plans(
            args.engines_dir, force=args.force, workspace_bytes=workspace, slots=args.slots, progress=print
        )
    except TrtCosyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
