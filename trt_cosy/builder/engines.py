"""``trt-cosy build``: an official release directory in, an engines directory out.

Layout of the engines directory (``backend="onnxruntime"``, ``precision="fp32"``)::

    manifest.json                 what was built, from which checkpoint (runtime/manifest.py)
    model_config.json             ModelConfig.to_dict()
    llm.onnx  flow_encoder.onnx  flow_estimator.onnx  flow_estimator_stream.onnx  hift.onnx
    <graph>.onnx.data             external weights, only for graphs over 1 GiB (the full-size LLM)
    text_embedding.npy  speech_embedding.npy  llm_embedding.npy   host-side LLM lookup tables
    flow_noise.npy                the official fixed CFM start noise [1, 80, 15000]
    tokenizer/                    vocab.json, merges.txt, tokenizer_config.json, tokenizer.json
    campplus.onnx  speech_tokenizer_v2.onnx                        the release's frontend models

CosyVoice 1 and 3 releases (``builder.family_engines``) have their own graph sets and data: v1 has
no ``flow_noise.npy``, carries ``speakers.npz`` (the -SFT/-Instruct preset speakers),
``tokenizer/multilingual.tiktoken`` and ``speech_tokenizer_v1.onnx``; v3 adds ``hift_noise.npy``
(the causal HiFT's fixed noise, 60 s) and carries ``speech_tokenizer_v3.onnx``.

Everything is written to a staging directory next to ``out_dir`` and renamed into place at the
end, so an interrupted build never leaves a half-written engines directory behind.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from ..config import ModelConfig
from ..errors import EngineMismatchError, InputError, TrtCosyError
from ..family_lookup import family_named
from ..runtime.backends.openvino.runner import OV_PRECISIONS
from ..runtime.engines import MODEL_CONFIG_NAME, TOKENIZER_DIR
from ..runtime.llm_decode import LLM_DECODE_NAME
from ..runtime.manifest import MANIFEST_NAME, GraphRecord, Manifest, hash_checkpoint
from ..version import __version__
from .export import OPSET, ExportResult, graph_record
from .family_engines import (
    check_family_options,
    export_family,
    export_plan,
    frontend_files,
    load_model_for_build,
    write_model_data,
)
from .flow_incremental import export_incremental_estimator, write_incremental_estimator
from .onnx.llm_batch import batch_graph_record, write_batched_llm
from .onnx.passes import rewrite_engine_graphs
from .progress import emitter
from .quantize.engines import QUANTIZED_PRECISIONS, nbits_blocks, quantize_engines
from .quantize.estimator_int8 import quantize_estimators
from .quantize.vocoder_int8 import quantize_vocoders
from .registry import build_family_of

__all__ = ["build_engines", "BACKENDS", "PRECISIONS"]

_LOGGER = logging.getLogger(__name__)

BACKENDS: Final = ("onnxruntime", "tensorrt", "openvino", "mixed")
PRECISIONS: Final = ("fp32", *QUANTIZED_PRECISIONS)
# TensorRT builds strongly typed plans from fp16 (or fp32) ONNX graphs; quantised CPU graphs do not apply.
TRT_PRECISIONS: Final = ("fp16", "fp32")
_PLANS_DIR: Final = "plans"
_DIR_MODE: Final = 0o755

Progress = Callable[[str], None]


def build_engines(
    model_dir: Path,
    out_dir: Path,
    backend: str = "onnxruntime",
    precision: str = "fp32",
    force: bool = False,
    progress: Progress | None = None,
    onnx_only: bool = False,
    backend_reason: str | None = None,
) -> Path:
    """Export an official CosyVoice release (1, 2 or 3) to an engines directory and return its path.

    Each graph is exported to ONNX with the dynamo exporter, checked with ``onnx.checker`` and
    compared with torch on ONNX Runtime. The build is skipped when ``out_dir/manifest.json`` already
    matches this checkpoint (sha256 of the yaml, the three ``.pt`` files and the Qwen2 config),
    this trt-cosy version, ``backend`` and ``precision``, and every file is present; ``force``
    rebuilds anyway. ``progress`` receives one line per step (the CLI prints them).

    Args:
        model_dir: the release directory (``cosyvoice2.yaml``, ``llm.pt``, ``flow.pt``, ``hift.pt``,
            ``CosyVoice-BlankEN/``, optionally ``campplus.onnx`` and ``speech_tokenizer_v2.onnx``).
        out_dir: the engines directory to create or replace.
        backend: ``"onnxruntime"``, ``"tensorrt"``, ``"openvino"`` (``builder.openvino``) or ``"mixed"``
            (the LLM on ONNX Runtime, the other graphs on OpenVINO: ``builder.mixed``).
        precision: ``"fp32"``, or ``"int8"``/``"int4"`` (weight-only 8/4-bit LLM, int8 flow
            estimators; see ``builder.quantize.engines`` and docs/precision.md). The reduced graphs replace the
            fp32 ones after those passed the torch parity check.
        force: rebuild even when the manifest says the engines are current.
        progress: optional callback for progress lines.
        onnx_only: with ``backend="tensorrt"``, write the fp16 graphs, profiles and manifest but no
            plans (for a machine without a GPU; plans are built later where TensorRT runs).
        backend_reason: why this backend/precision (``runtime.backend_choice``), kept in the manifest.
    """
    _check_options(backend, precision)
    check_family_options(Path(model_dir), backend, precision)
    if backend == "tensorrt" and not onnx_only:
        from ..runtime.backends.tensorrt.runner import load_tensorrt

        load_tensorrt()  # fail before a long export when plans cannot be built here
    if backend in ("openvino", "mixed"):
        _check_openvino(precision)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    emit = emitter(_LOGGER, progress)
    start = time.perf_counter()
    hashes = hash_checkpoint(model_dir)
    if not force and _is_current(out_dir, hashes, backend, precision):
        emit(
            f"engines in {out_dir} are up to date with {model_dir}; nothing to build (use --force to rebuild)"
        )
        return _finish_tensorrt(out_dir, backend, force, onnx_only, emit)
    _check_replaceable(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.staging-", dir=out_dir.parent))
    staging.chmod(_DIR_MODE)  # mkdtemp makes it private (0700); the engines are ordinary files
    try:
        _write_engines(model_dir, staging, hashes, backend, precision, emit, backend_reason)
        _swap_into_place(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    emit(f"built {backend}/{precision} engines in {out_dir} in {time.perf_counter() - start:.1f} s")
    return _finish_tensorrt(out_dir, backend, force, onnx_only, emit)


def _finish_tensorrt(out_dir: Path, backend: str, force: bool, onnx_only: bool, emit: Progress) -> Path:
    """TensorRT plans are per GPU and TensorRT version: (re)built here unless ``onnx_only``."""
    if backend != "tensorrt":
        return out_dir
    if onnx_only:
        emit(
            f"wrote TensorRT inputs (fp16 graphs, profiles) to {out_dir}; TensorRT is needed for plans: "
            f"run `python -m trt_cosy.builder.trt.plans {out_dir}` on a machine with an NVIDIA GPU"
        )
        return out_dir
    from .trt.plans import build_plans

    build_plans(out_dir, force=force, progress=emit)
    return out_dir


def _check_options(backend: str, precision: str) -> None:
    if backend not in BACKENDS:
        raise InputError(
            f"backend {backend!r} cannot be built by this version; available: {', '.join(BACKENDS)}."
        )
    allowed = {"tensorrt": TRT_PRECISIONS, "openvino": OV_PRECISIONS}.get(backend, PRECISIONS)
    if precision not in allowed:
        raise InputError(
            f"precision {precision!r} is not available for the {backend} backend; available: "
            f"{', '.join(allowed)}."
        )


def _check_openvino(precision: str) -> None:
    """OpenVINO must be importable before a long export; bf16 engines on a CPU without bf16 kernels
    are built (they are portable) but will compute in float32 here, which the build says."""
    from ..runtime.backends.openvino.runner import cpu_has_bf16, load_openvino

    load_openvino()
    if precision != "fp32" and not cpu_has_bf16():
        _LOGGER.warning(
            "this CPU has no bfloat16 kernels (AVX512-BF16/AMX): %s OpenVINO engines will compute in "
            "float32 here; build --precision fp32 for this machine",
            precision,
        )


def _is_current(out_dir: Path, hashes: dict[str, str], backend: str, precision: str) -> bool:
    if not (out_dir / MANIFEST_NAME).is_file():
        return False
    try:
        manifest = Manifest.read(out_dir)
        manifest.check(out_dir, backend=backend, precision=precision, checkpoint_hashes=hashes)
    except EngineMismatchError as exc:
        _LOGGER.info("rebuilding: %s", exc)
        return False
    return True


def _check_replaceable(out_dir: Path) -> None:
    """Refuse to replace a directory that holds files but is not an engines directory."""
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir} exists and is not a directory; choose another --out.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_NAME).is_file():
        raise InputError(
            f"{out_dir} is not empty and is not an engines directory (no {MANIFEST_NAME}); choose another "
            "--out or empty it."
        )


def _write_engines(
    model_dir: Path,
    staging: Path,
    hashes: dict[str, str],
    backend: str,
    precision: str,
    emit: Progress,
    backend_reason: str | None = None,
) -> None:
    emit(f"loading the checkpoint in {model_dir}")
    model = load_model_for_build(model_dir)
    family = model.config.family
    results = export_family(model, staging, progress=emit)  # the family's graph set (BuildFamily.export)
    incremental = None
    if backend == "onnxruntime":  # streaming chunks over new frames only (CosyVoice2 and 3; None for v1)
        incremental = write_incremental_estimator(model, staging, precision, progress=emit)
    elif backend in ("openvino", "mixed") and family_named(family).openvino_incremental:  # plain export, to IR
        exported = export_incremental_estimator(model, staging, progress=emit)
        if exported is not None:
            results[exported[0].name] = exported[0]
    write_model_data(model, model_dir, staging)  # tables, fixed noise, preset speakers
    if backend == "tensorrt" and family_named(family).qwen_llm:  # batched decode across requests
        from .trt.llm_decode import export_llm_decode

        results[LLM_DECODE_NAME] = export_llm_decode(model.runners["llm"].module, model.config, staging, emit)
    if backend == "tensorrt":  # streaming chunks over new frames only, plain ONNX (CosyVoice2; None otherwise)
        from .trt.flow_incremental import INCREMENTAL_NAME, export_trt_incremental

        if (trt_incremental := export_trt_incremental(model, staging, emit)) is not None:
            results[INCREMENTAL_NAME] = trt_incremental
    config = model.config
    del model  # the torch weights (2+ GB at full size) are not needed past this point
    gc.collect()
    batch_graph = None
    records: dict[str, GraphRecord] = {}
    if backend == "openvino":  # the plain exports (no ONNX Runtime contrib ops) to OpenVINO IR
        from .openvino import convert_engine_graphs

        records = {
            name: _graph_record(result, staging) for name, result in results.items()
        }  # I/O as exported
        ir_files = convert_engine_graphs(staging, list(results), precision, progress=emit)
        records = {name: dataclasses.replace(rec, file=ir_files[name]) for name, rec in records.items()}
    elif backend == "mixed":  # the LLM on ONNX Runtime, the other graphs as OpenVINO IR (builder.mixed)
        from .mixed import split_mixed_graphs

        exported = {name: _graph_record(result, staging) for name, result in results.items()}
        records = split_mixed_graphs(
            staging, exported, precision, family, lambda name: _plan_feeds(config, name), progress=emit
        )
    elif backend == "tensorrt":
        from .trt.plans import prepare_trt_graphs

        prepare_trt_graphs(staging, config, hashes, precision, progress=emit)
    else:  # onnxruntime: faster CPU forms of the estimators, proven equal, then the precision
        rewrite_engine_graphs(staging, lambda name: _plan_feeds(config, name), progress=emit)
        if precision != "fp32":
            quantize_engines(staging, precision, family, progress=emit)
        batch_graph = write_batched_llm(staging)  # continuous batching (stages.llm_batch), v2/v3
    _write_model_config(config, staging / MODEL_CONFIG_NAME)
    build_family_of(config).copy_text_tokenizer(model_dir, staging / TOKENIZER_DIR)
    _link_frontend_models(model_dir, staging, frontend_files(family))
    compile_check = None
    if backend in ("openvino", "mixed"):  # each IR compiled in a child: a native crash falls back, recorded
        from .openvino import check_graph_compiles

        records, compile_check = check_graph_compiles(staging, records, precision, progress=emit)
    manifest = Manifest(
        trt_cosy_version=__version__,
        backend=backend,
        precision=precision,
        opset=OPSET,
        checkpoint=hashes,
        graphs=records or {name: _graph_record(result, staging) for name, result in results.items()},
        files=_file_sizes(staging),
        backend_reason=backend_reason,
        compile_check=compile_check,
    )
    if batch_graph is not None:
        manifest.graphs[batch_graph.stem] = batch_graph_record(batch_graph, staging)
    if incremental is not None:
        manifest.graphs[incremental[0].stem] = incremental[1]
    if backend in ("onnxruntime", "mixed") and precision in QUANTIZED_PRECISIONS:  # n-bit block sizes
        only = {name for name, record in manifest.graphs.items() if record.backend != "openvino"}
        manifest = dataclasses.replace(manifest, nbits_blocks=nbits_blocks(precision, family, only))
    manifest.write(staging)
    if backend == "onnxruntime" and precision in QUANTIZED_PRECISIONS:  # calibrated through the flow
        quantize_estimators(staging, family, progress=emit)  # first: the vocoders calibrate through it
        quantize_vocoders(staging, family, progress=emit)  # each refreshes the manifest's file sizes


def _plan_feeds(config: ModelConfig, name: str) -> list[dict]:
    plan = export_plan(config, name)
    return [plan.sample, *plan.parity]


def _write_model_config(config: ModelConfig, path: Path) -> None:
    path.write_text(json.dumps(config.to_dict(), indent=2) + "\n", encoding="utf-8")


def _link_frontend_models(model_dir: Path, staging: Path, names: tuple[str, ...]) -> None:
    for name in names:
        source = model_dir / name
        if not source.is_file():
            _LOGGER.warning(
                "%s has no %s; voice prompts will need it from the release later", model_dir, name
            )
            continue
        try:
            os.link(source, staging / name)  # no copy of the frontend models when on the same file system
        except OSError:
            shutil.copy2(source, staging / name)


def _graph_record(result: ExportResult, root: Path) -> GraphRecord:
    return graph_record(result.path, root, result.max_errors)


def _file_sizes(root: Path) -> dict[str, int]:
    return {
        path.relative_to(root).as_posix(): path.stat().st_size
        for path in sorted(root.rglob("*"))
        # plans/ is per GPU and TensorRT version and has its own records (builder.trt.plans)
        if path.is_file() and path.name != MANIFEST_NAME and path.relative_to(root).parts[0] != _PLANS_DIR
    }


def _swap_into_place(staging: Path, out_dir: Path) -> None:
    """Rename ``staging`` to ``out_dir``; an old ``out_dir`` is moved aside first and removed after."""
    if not out_dir.exists():
        staging.rename(out_dir)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    old.rmdir()  # only the unique name is wanted: rename needs the target to be absent or empty
    out_dir.rename(old)
    try:
        staging.rename(out_dir)
    except OSError as exc:
        old.rename(out_dir)
        raise TrtCosyError(
            f"could not move the new engines into {out_dir} ({exc}); the old ones are kept."
        ) from exc
    shutil.rmtree(old, ignore_errors=True)
