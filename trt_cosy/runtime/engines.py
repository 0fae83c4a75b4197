"""Load an engines directory written by ``trt-cosy build`` onto ONNX Runtime (torch-free).

Every family has the graphs of its contract set (``Family.graphs``: ``graphs.GRAPHS`` for
CosyVoice2, ``models/v1/graphs.py``, ``models/v3/graphs.py``), the three LLM lookup tables and
``model_config.json``; CosyVoice2/3 add the fixed CFM noise, CosyVoice3 the fixed HiFT noise, and
CosyVoice-300M-SFT/-Instruct engines their preset speakers.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Final

import numpy as np

from ..errors import EngineMismatchError
from ..family_lookup import family_named
from . import graphs
from .backends.base import Runner
from .backends.onnxruntime.runner import LazyOrtRunner, OrtRunner, default_threads
from .manifest import Manifest, model_config_from_dict
from .model import LoadedModel

__all__ = [
    "load_engines", "ORT_BACKEND", "MIXED_BACKEND", "TABLE_NAMES", "MODEL_CONFIG_NAME", "FLOW_NOISE_NAME",
    "HIFT_NOISE_NAME", "SPEAKERS_NAME", "TOKENIZER_DIR", "graph_specs", "LAZY_GRAPHS"
]

_LOGGER = logging.getLogger(__name__)

ORT_BACKEND: Final = "onnxruntime"
TRT_BACKEND: Final = "tensorrt"
OV_BACKEND: Final = "openvino"
MIXED_BACKEND: Final = "mixed"  # per-graph backends: the LLM on ONNX Runtime, the rest on OpenVINO
AUTO_BACKEND: Final = "auto"  # load_engines: the manifest's backend
# File names inside an engines directory, shared with the builder (trt_cosy/builder/engines.py).
TABLE_NAMES: Final = ("text_embedding", "speech_embedding", "llm_embedding")  # <name>.npy
MODEL_CONFIG_NAME: Final = "model_config.json"
FLOW_NOISE_NAME: Final = "flow_noise.npy"  # v2/v3: the official fixed CFM noise [1, 80, 15000]
HIFT_NOISE_NAME: Final = "hift_noise.npy"  # v3: the causal HiFT's fixed NSF buffer prefix [1, S, 9]
SPEAKERS_NAME: Final = "speakers.npz"  # v1 -SFT/-Instruct: preset speakers from spk2info.pt
TOKENIZER_DIR: Final = "tokenizer"  # v2/v3: the Qwen tokenizer files; v1: multilingual.tiktoken
# ONNX Runtime graphs whose session is created on first use: only streaming synthesis runs the
# chunk-attention estimator, and its session costs ~0.5 s of cold start and its own weights; likewise
# CosyVoice3's streaming vocoder (``hift_stream``: a second copy of the HiFT weights, 84 MB at full size).
LAZY_GRAPHS: Final = frozenset({"flow_estimator_stream", "hift_stream"})


def graph_specs(family: str) -> dict[str, graphs.GraphSpec]:
    """The graph contracts of a family (``"v1"``, ``"v2"``, ``"v3"``), keyed by graph name."""
    return dict(family_named(family).graphs)


def load_engines(
    engines_dir: Path,
    threads: int | None = None,
    model_dir: Path | None = None,
    backend: str = ORT_BACKEND,
    slots: int = 1,
    lazy_graphs: Collection[str] = LAZY_GRAPHS,
) -> LoadedModel:
    """Load the graphs (ONNX Runtime sessions or TensorRT plans), LLM tables, fixed noise and config.

    The manifest is checked first (trt-cosy version, backend, every file present with its size;
    with ``model_dir``, also the checkpoint hashes): stale or incomplete engines raise
    ``EngineMismatchError`` naming the ``trt-cosy build`` command to run. ``threads`` is the
    intra-op thread count of every session (default: physical cores). The embedding tables and the
    HiFT noise are memory-mapped read-only. ``backend="tensorrt"`` loads the plans of
    ``engines_dir/plans`` (``slots`` execution contexts each); a plan built for another GPU,
    TensorRT version or checkpoint is refused, never used. On ONNX Runtime the graphs named in
    ``lazy_graphs`` (default ``LAZY_GRAPHS``: the streaming flow estimator) get a ``LazyOrtRunner``
    whose session is created by its first call, and so do the two LLM graphs when the engines have the
    batched decode graph (only one of them is used); pass ``()`` to create every session now.
    On TensorRT the plans of ``lazy_graphs`` and the plain estimator plans where the step plans run the
    Euler loop are deserialised on first use (``runtime.backends.tensorrt.lazy``).
    ``backend="openvino"`` compiles the OpenVINO IR of each graph (``runtime.backends.openvino.runner``; lazy graphs
    on first use); ``backend="mixed"`` loads engines built with ``trt-cosy build --backend mixed``
    (the LLM graphs on ONNX Runtime, the others on OpenVINO, as each graph's manifest record says);
    ``backend="auto"`` loads the engines on the backend their manifest names.
    """
    engines_dir = Path(engines_dir)
    manifest = Manifest.read(engines_dir)
    if backend == AUTO_BACKEND:  # the backend the engines were built for
        backend = manifest.backend
    manifest.check(engines_dir, model_dir, backend=backend)
    if manifest.tuning is not None:  # tuned on another CPU: one line saying so and how to tune again
        from .native_guard import machine
        from .tuning_record import warn_if_tuned_elsewhere

        warn_if_tuned_elsewhere(manifest.tuning, engines_dir, machine().key, machine().cpu)
    config = model_config_from_dict(_read_json(engines_dir / MODEL_CONFIG_NAME))
    if backend == TRT_BACKEND:
        from .backends.tensorrt.lazy import deferred_plans, load_plans
        from .backends.tensorrt.runner import checkpoint_digest
        from .profiles import PROFILES_NAME, read_profiles

        _check_trt_graphs(engines_dir, config.family)
        lazy = deferred_plans(read_profiles(engines_dir / PROFILES_NAME), lazy_graphs)
        digest = checkpoint_digest(manifest.checkpoint)
        runners: dict[str, Runner] = dict(load_plans(engines_dir, slots, checkpoint=digest, lazy=lazy))
    else:  # onnxruntime, openvino or mixed: each graph on its manifest record's backend
        runners = _load_runners(engines_dir, manifest, graph_specs(config.family), threads, lazy_graphs)
    tables = {name: np.load(engines_dir / f"{name}.npy", mmap_mode="r") for name in TABLE_NAMES}
    noise_path = engines_dir / FLOW_NOISE_NAME
    family = family_named(config.family)
    if not family.fixed_flow_noise and not noise_path.is_file():  # v1 draws fresh CFM noise per call
        flow_noise = np.zeros((1, config.flow.output_size, 0), np.float32)
    else:
        flow_noise = np.load(noise_path)  # [1, 80, 15000]
    hift_noise = None
    if family.fixed_hift_noise:
        hift_noise = np.load(engines_dir / HIFT_NOISE_NAME, mmap_mode="r")  # [1, S, 9]
    _LOGGER.debug(
        "loaded %s %s engines from %s (built %s)",
        config.family,
        manifest.backend,
        engines_dir,
        manifest.created,
    )
    return LoadedModel(
        config=config,
        backend=backend,
        runners=runners,
        llm_tables=tables,
        flow_noise=flow_noise,
        hift_noise=hift_noise,
    )


def _load_runners(
    engines_dir: Path,
    manifest: Manifest,
    specs: dict[str, graphs.GraphSpec],
    threads: int | None,
    lazy_graphs: Collection[str],
) -> dict[str, Runner]:
    """One runner per graph of ``specs`` (plus ``llm_batch`` when built), each on the backend its
    manifest record names (``Manifest.graph_backend``: ONNX Runtime or OpenVINO; both in mixed engines).

    Lazy: the graphs in ``lazy_graphs``, and when the engines have the batched decode graph, both
    LLM graphs (one of them is used: do not hold both weights); nothing when ``lazy_graphs`` is empty.
    """
    names = list(specs)
    lazy = set(lazy_graphs)
    if graphs.LLM_BATCH.name in manifest.graphs:  # the batched decode graph (stages.llm_batch)
        names.append(graphs.LLM_BATCH.name)
        if lazy_graphs:
            lazy |= {graphs.LLM.name, graphs.LLM_BATCH.name}
    if graphs.FLOW_ESTIMATOR_INCREMENTAL.name in manifest.graphs:  # streaming chunks over new frames only
        names.append(graphs.FLOW_ESTIMATOR_INCREMENTAL.name)  # (stages.flow_incremental)
        if lazy_graphs:
            lazy.add(graphs.FLOW_ESTIMATOR_INCREMENTAL.name)
    for name in names:
        if name not in manifest.graphs:
            option = "" if manifest.backend == ORT_BACKEND else f" --backend {manifest.backend}"
            raise EngineMismatchError(
                f"{engines_dir} has no '{name}' graph. Rebuild it: run `trt-cosy build{option} --model-dir DIR "
                f"--out {engines_dir}`."
            )
    open_ov = None
    ov_names = [name for name in names if manifest.graph_backend(name) == OV_BACKEND]
    if ov_names:
        open_ov = _openvino_opener(manifest, ov_names, threads)
    runners: dict[str, Runner] = {}
    for name in names:
        path = engines_dir / manifest.graphs[name].file
        if open_ov is not None and name in ov_names:
            runners[name] = open_ov(path, name, name in lazy)
        else:
            loader = LazyOrtRunner if name in lazy else OrtRunner.from_path
            runners[name] = loader(path, name, threads, exported=True)
    return runners


def _openvino_opener(manifest: Manifest, names: list[str], threads: int | None):
    """``open(path, name, lazy) -> runner`` for OpenVINO IR graphs, each compiled in the precision
    its manifest record names (a build's fallback) or else ``graph_precisions`` gives it in engines of
    the manifest's precision (lazy graphs on first use), through OpenVINO's compiled-model cache
    (``compiled_model_cache``). Graphs the manifest records as compiled on a machine like this one
    (``trusted_compiles``) compile at once; the others are checked in a child process first."""
    from .backends.openvino.runner import (
        LazyOvRunner,
        OvRunner,
        compiled_model_cache,
        graph_precisions,
        load_openvino,
    )

    computes = graph_precisions(manifest.precision, tuple(names))
    computes.update({name: manifest.graphs[name].compute for name in names if manifest.graphs[name].compute})
    ov = load_openvino()
    trusted = trusted_compiles(manifest, ov.get_version(), default_threads() if threads is None else threads)
    core = ov.Core()
    compiled_model_cache(core)  # a later process loads the compiled graphs instead of compiling

    def open_graph(path: Path, name: str, lazy: bool) -> Runner:
        sure = trusted.get(name) == computes[name]
        if lazy:
            return LazyOvRunner(path, name, threads, computes[name], trusted=sure)
        return OvRunner.from_path(path, name, threads, computes[name], core, trusted=sure)

    return open_graph


def trusted_compiles(manifest: Manifest, backend_version: str, threads: int) -> dict[str, str]:
    """``{graph: compute}`` that the build compiled in a child process on a machine with this CPU
    signature and this library version with ``threads`` threads (``Manifest.compile_check``); empty
    elsewhere (a native crash can depend on each: the tiny CosyVoice2 LLM in bf16 crashes OpenVINO on
    Intel AMX with one thread, not with two), and a line in the log says that the first load here checks
    each graph in a child first."""
    from .native_guard import machine

    record = manifest.compile_check or {}
    here = machine()
    checked_threads = record.get("threads", [])
    checked_threads = checked_threads if isinstance(checked_threads, list) else [checked_threads]
    same = record.get("machine") == here.key and record.get("backend_version") == backend_version
    if same and int(threads) in {int(count) for count in checked_threads}:
        return {str(name): str(compute) for name, compute in dict(record.get("graphs", {})).items()}
    if record:
        _LOGGER.info(
            "these engines were compile-checked on %s with %s and %s thread(s); this is %s with %s and %d "
            "thread(s): each graph is compiled in a child process first, once",
            record.get("cpu", "another CPU"),
            record.get("backend_version", "another version"),
            checked_threads,
            here.describe(),
            backend_version,
            threads,
        )
    return {}


def _check_trt_graphs(engines_dir: Path, family: str) -> None:
    """The TensorRT profiles (one plan each) must cover exactly the family's graph set, before any
    plan is loaded: a v1/v3 directory has its own graph names (``Family.graphs``)."""
    from .llm_decode import LLM_DECODE_NAME
    from .profiles import PROFILES_NAME, read_profiles, trt_graph_specs

    # batched decode, incremental flow (and its device Euler step)
    optional = {LLM_DECODE_NAME, graphs.FLOW_ESTIMATOR_INCREMENTAL.name, graphs.FLOW_STEP_INCREMENTAL.name}
    named = set(read_profiles(engines_dir / PROFILES_NAME)) - optional
    expected = set(trt_graph_specs(family_named(family)))  # the exported graphs plus the flow step graphs (v2/v3)
    if named != expected:
        raise EngineMismatchError(
            f"{engines_dir / PROFILES_NAME} lists the graphs {sorted(named)}, a {family} model has "
            f"{sorted(expected)}. Rebuild the engines: run `trt-cosy build --backend tensorrt --model-dir DIR "
            f"--out {engines_dir}`."
        )


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise EngineMismatchError(
            f"{path} is unreadable ({exc}). Rebuild the engines: run `trt-cosy build --model-dir DIR "
            f"--out {path.parent}`."
        ) from exc
