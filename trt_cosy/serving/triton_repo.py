"""``trt-cosy triton-repo``: write a Triton Inference Server model repository for an engines directory.

    REPO/<model-name>/config.pbtxt   decoupled Python-backend model, instance groups, queue limit
    REPO/<model-name>/1/model.py     imports ``trt_cosy.serving.triton_model.TritonPythonModel``

The engines (and the voices folder) are referenced by absolute path, not copied: mount them at the same
path inside the Triton container. The model's contract (inputs, outputs) is listed in ``INPUTS``/``OUTPUTS``
and in README "Serving".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..errors import InputError

__all__ = ["TritonRepoOptions", "write_triton_repo", "INPUTS", "OUTPUTS"]

_LOGGER = logging.getLogger(__name__)

# (name, Triton data type, dims, optional)
INPUTS: Final = (
    ("text", "TYPE_STRING", "[ 1 ]", True),  # or source_audio: voice conversion
    ("voice", "TYPE_STRING", "[ 1 ]", True),
    ("reference_audio", "TYPE_FP32", "[ -1 ]", True),
    ("reference_sample_rate", "TYPE_INT32", "[ 1 ]", True),
    ("reference_text", "TYPE_STRING", "[ 1 ]", True),
    ("seed", "TYPE_INT64", "[ 1 ]", True),
    ("stream", "TYPE_BOOL", "[ 1 ]", True),
    ("source_audio", "TYPE_FP32", "[ -1 ]", True),
    ("source_sample_rate", "TYPE_INT32", "[ 1 ]", True),
    ("instructions", "TYPE_STRING", "[ 1 ]", True),
)
OUTPUTS: Final = (("audio", "TYPE_FP32", "[ -1 ]"), ("sample_rate", "TYPE_INT32", "[ 1 ]"))
DEVICES: Final = ("auto", "cpu", "gpu")

_MODEL_PY: Final = '''\
"""trt-cosy text-to-speech for Triton's Python backend (written by `trt-cosy triton-repo`)."""

import os
import sys

# The Python-backend stub ignores PYTHONPATH; apply it (and the paths given to triton-repo) here.
_PATHS = {paths!r} + os.environ.get("PYTHONPATH", "").split(os.pathsep)
for _path in reversed([path for path in _PATHS if path]):
    if _path in sys.path:
        sys.path.remove(_path)
    sys.path.insert(0, _path)

from trt_cosy.serving.triton_model import TritonPythonModel  # noqa: E402,F401
'''


@dataclass(frozen=True)
class TritonRepoOptions:
    """What ``write_triton_repo`` puts in the repository."""

    model_name: str = "trt_cosy"
    """The model's name in Triton (its folder name, and the URL ``/v2/models/<name>``)."""
    instances: int = 1
    """Model instances (each loads the engines once; the decoupled model runs up to ``max_concurrent`` requests
    in each, the other one request at a time): per GPU with KIND_GPU."""
    device: str = "auto"
    """``"cpu"`` (KIND_CPU), ``"gpu"`` (KIND_GPU: ``instances`` on every GPU) or ``"auto"`` (GPU for
    TensorRT engines, CPU for ONNX Runtime engines)."""
    voices_dir: Path | None = None
    """Folder of stored voices (``<name>.npz``) that the ``voice`` input names; None: only reference audio."""
    max_queue: int = 8
    """Requests waiting in Triton's queue for an instance; Triton refuses more (``Exceeds maximum queue
    size``). The decoupled model takes requests from that queue as they come (its own admission judges
    them), so there it only bounds a burst; without a decoupled policy it is the queue of waiting requests."""
    request_timeout_s: float = 300.0
    """Seconds a request may take from arrival to its last audio (``trt-cosy serve --timeout``): admission
    by expected work refuses at once what would not finish within it, and Triton's queue policy rejects a
    request still queued after it (``timeout_action: REJECT``). A client's shorter Triton timeout is used
    instead (``allow_timeout_override``)."""
    max_concurrent: int = 4
    """Admitted requests each instance of the decoupled model runs at once (its worker threads); the
    engine orders their heavy stages by admission, so more mainly shares the LLM's batch."""
    work_admission: bool = True
    """Admission by expected work (``serving.triton_admission``); False: every request is started (and a
    warm-up less at load)."""
    decoupled: bool = True
    """Decoupled transaction policy (streaming: one response per chunk). False: one response per request,
    for clients of Triton's HTTP ``infer`` endpoint, which refuses decoupled models."""
    threads: int | None = None
    """CPU threads (whole cores) per graph of each instance; None: the usable cores of the serving
    machine divided among the instances. KIND_CPU instances pin themselves to disjoint cores at load."""
    max_text_chars: int = 4096
    """Longest text accepted, in characters."""
    python_path: tuple[str, ...] = ()
    """Folders put first on the stub's ``sys.path`` (a venv's site-packages, a numpy<2 folder)."""
    text_streaming: bool = False
    """Text that arrives in several requests of one sequence (Triton's sequence batcher: START with the
    voice and the first piece, then pieces, END on the last; docs/text-streaming.md): the START request's
    responses carry the audio as it is made. Decoupled only; one sequence per instance at a time."""
    sequence_idle_s: float = 30.0
    """With ``text_streaming``: a sequence with no request for this long is ended by Triton."""

    def __post_init__(self) -> None:
        if not self.model_name or "/" in self.model_name or self.model_name.startswith("."):
            raise InputError(f"invalid model name {self.model_name!r}; use letters, digits, '_' or '-'.")
        for name in ("instances", "max_queue", "max_text_chars", "max_concurrent"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InputError(f"{name} must be a positive integer, got {value!r}.")
        if not self.request_timeout_s > 0:
            raise InputError(f"request_timeout_s must be positive (seconds), got {self.request_timeout_s!r}.")
        if self.device not in DEVICES:
            raise InputError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}.")
        if self.text_streaming and not self.decoupled:
            raise InputError("text streaming sends the audio as responses of the first request: it needs a decoupled model.")


def write_triton_repo(engines: str | Path, repo: str | Path, options: TritonRepoOptions | None = None) -> Path:
    """Write ``repo/<model_name>/`` for ``engines``; returns the model folder. Other models in ``repo``
    are left alone; this model's files are replaced.

    Raises:
        EngineMismatchError: ``engines`` is not an engines directory.
        InputError: ``device`` "gpu" for ONNX Runtime engines (they run on the CPU) or "cpu" for TensorRT.
    """
    from ..runtime.manifest import Manifest

    options = options or TritonRepoOptions()
    engines = Path(engines).resolve()
    backend = Manifest.read(engines).backend
    kind = _instance_kind(options.device, backend)
    model_dir = Path(repo) / options.model_name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(model_config(engines, kind, options), encoding="utf-8")
    paths = [str(Path(path).resolve()) for path in options.python_path]
    (model_dir / "1" / "model.py").write_text(_MODEL_PY.format(paths=paths), encoding="utf-8")
    _LOGGER.info("wrote Triton model %s (%s, %s engines) in %s", options.model_name, kind, backend, model_dir)
    return model_dir


def _instance_kind(device: str, backend: str) -> str:
    gpu_engines = backend == "tensorrt"
    if device == "auto":
        return "KIND_GPU" if gpu_engines else "KIND_CPU"
    if device == "gpu" and not gpu_engines:
        raise InputError(
            "--device gpu: these are ONNX Runtime engines, which run on the CPU. Use --device cpu, or build "
            "TensorRT engines (`trt-cosy build --backend tensorrt`) for GPU instances."
        )
    if device == "cpu" and gpu_engines:
        raise InputError("--device cpu: these are TensorRT engines, which need a GPU. Use --device gpu or auto.")
    return "KIND_GPU" if device == "gpu" else "KIND_CPU"


def _cpu_comment(options: TritonRepoOptions) -> str:
    """How the CPU instances share the machine this repository was written on (the serving machine plans
    again at load)."""
    from ..runtime.cpu_budget import read_budget

    budget = read_budget()
    plan = budget.plan(options.instances, options.threads)
    return (f"CPU plan where written ({budget.describe()}): {options.instances} instance(s) x {plan.threads} "
            f"thread(s) per graph, each pinned at load to its own cores" + (" (sharing cores)" if plan.shared else ""))


_QUEUE_COMMENT: Final = (
    "# Queue: beyond max_queue_size Triton refuses at once; a request still queued after the request timeout\n"
    "# (a client may ask for less) is rejected, not started for a client that gave up. The model itself\n"
    "# refuses at once what would not finish within it (admission by expected work, docs/deploy.md).\n"
)


def model_config(engines: Path, kind: str, options: TritonRepoOptions) -> str:
    """The ``config.pbtxt`` text (protobuf text format)."""
    parameters = {
        "engines": str(engines),
        "voices_dir": str(Path(options.voices_dir).resolve()) if options.voices_dir is not None else "",
        "threads": str(options.threads or ""),
        "max_text_chars": str(options.max_text_chars),
        # KIND_CPU: each instance claims its slot of the machine's CPU plan (cpu_budget) and pins to it.
        "cpu_instances": str(options.instances) if kind == "KIND_CPU" else "",
        "text_streaming": "true" if options.text_streaming else "",
        # Admission by expected work (serving.triton_admission).
        "request_timeout_s": f"{options.request_timeout_s:g}",
        "max_concurrent": str(options.max_concurrent),
        "work_admission": str(options.work_admission).lower(),
    }
    inputs = ",\n".join(
        f'  {{ name: "{name}" data_type: {dtype} dims: {dims}{" optional: true" if optional else ""} }}'
        for name, dtype, dims, optional in INPUTS
    )
    outputs = ",\n".join(f'  {{ name: "{name}" data_type: {dtype} dims: {dims} }}' for name, dtype, dims in OUTPUTS)
    params = ",\n".join(
        f"  {{ key: {json.dumps(key)} value: {{ string_value: {json.dumps(value)} }} }}"
        for key, value in parameters.items()
    )
    return (
        f"# Written by `trt-cosy triton-repo`; engines are read from {engines} (mount it at this path).\n"
        + (f"# {_cpu_comment(options)}\n" if kind == "KIND_CPU" else "")
        + f'name: "{options.model_name}"\n'
        'backend: "python"\n'
        "max_batch_size: 0\n"
        f"model_transaction_policy {{ decoupled: {str(options.decoupled).lower()} }}\n"
        + (
            _sequence_batching(options)
            if options.text_streaming
            else _QUEUE_COMMENT
            + f"dynamic_batching {{ default_queue_policy {{ max_queue_size: {options.max_queue} timeout_action: REJECT "
            f"default_timeout_microseconds: {round(options.request_timeout_s * 1e6)} allow_timeout_override: true }} }}\n"
        )
        + f"instance_group [ {{ count: {options.instances} kind: {kind} }} ]\n"
        f"input [\n{inputs}\n]\n"
        f"output [\n{outputs}\n]\n"
        f"parameters [\n{params}\n]\n"
    )


def _sequence_batching(options: TritonRepoOptions) -> str:
    """The sequence batcher of a text-streaming model: START / END / CORRID control inputs (INT32 / UINT64 [1])."""
    idle_us = int(options.sequence_idle_s * 1_000_000)
    return (
        "sequence_batching {\n"
        f"  max_sequence_idle_microseconds: {idle_us}\n"
        "  control_input [\n"
        '    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },\n'
        '    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },\n'
        '    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }\n'
        "  ]\n"
        "}\n"
    )
