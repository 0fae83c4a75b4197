"""The OpenVINO backend (CPU): one ``OvRunner`` per graph, over one compiled model.

Engines built with ``trt-cosy build --backend openvino`` hold each graph as OpenVINO IR
(``<graph>.xml`` + ``<graph>.bin``), converted at build time from the plain ONNX exports, so loading
never reconverts. What each engines precision means at run time (``graph_precisions``):

* ``fp32``: every graph computes in float32.
* ``bf16``: every graph computes in bfloat16 (OpenVINO's ``INFERENCE_PRECISION_HINT``) except the
  graphs in ``FP32_GRAPHS`` (numeric islands measured to need float32, docs/precision.md). Needs a
  CPU with AVX512-BF16 or AMX (``cpu_has_bf16``); elsewhere they run in float32, with a warning.
* ``int8`` / ``int4``: the LLM's MatMul weights are stored 8/4-bit (``builder.openvino``); the
  graphs compute as for ``bf16``.

Memory (``OvRunner.infer``, docs/benchmarks.md "Mixed engines"): OpenVINO maps each graph's weights
file (or its compiled-model cache blob) and reads it once, when the CPU plugin repacks the weights
into its own layout on the first call; the mapped pages then stay in the process's RSS, unused.
A runner's first calls end by dropping them (``drop_weight_pages``: the kernel reads them back from the page
cache if OpenVINO ever does again). The graphs ONNX Runtime shrinks its arena after (the vocoders
and flow encoders) also hand their intermediate memory back (``CompiledModel.release_memory`` and
glibc ``malloc_trim``): OpenVINO frees a long vocoder call's buffers, but glibc keeps them.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import numpy as np

from ....errors import EngineMismatchError, require
from ...cpu_budget import default_threads
from ..base import LazyRunner, cast_input, check_feed

__all__ = [
    "OV_BACKEND",
    "OV_PRECISIONS",
    "FP32_GRAPHS",
    "IR_SUFFIX",
    "OvRunner",
    "LazyOvRunner",
    "OvKVDecoder",
    "load_openvino",
    "cpu_has_bf16",
    "graph_precisions",
    "compiled_model_cache",
    "pin_sinusoid_arguments",
    "drop_weight_pages",
    "RELEASE_AFTER_GRAPHS",
    "check_compiles",
    "compile_in_this_process",
]

_LOGGER = logging.getLogger(__name__)

OV_BACKEND: Final = "openvino"
OV_PRECISIONS: Final = ("fp32", "bf16", "int8", "int4")
IR_SUFFIX: Final = ".xml"  # the weights are the .bin next to it
# Graphs that stay float32 in the reduced precisions (measured: docs/precision.md, "OpenVINO").
FP32_GRAPHS: Final = frozenset({"hift", "hift_stream", "v1_hift"})
_HINTS: Final = {"fp32": "f32", "bf16": "bf16"}
_DEVICE: Final = "CPU"
_DECODER_INPUTS: Final = ("inputs_embeds", "past_keys", "past_values")
# Graphs whose calls end by handing their intermediate memory back (``OvRunner.infer``): those
# ``runtime.backends.onnxruntime.runner`` shrinks its arena after, the vocoders (a long call's buffers: 270 MB for 10 s of
# audio at full size) and the flow encoders (once per chunk).
RELEASE_AFTER_GRAPHS: Final = frozenset({"hift", "hift_stream", "v1_hift", "flow_encoder", "v1_flow_encoder"})
_MADV_DONTNEED: Final = 4  # <sys/mman.h>
_DROP_CALLS: Final = 2  # a runner's first calls repack its weights; later calls do not read the file
_weight_files: set[str] = set()  # the files (and cache folders) OpenVINO maps weights from
_WEIGHTS_LOCK: Final = threading.Lock()
_libc: list[Any] = []  # [libc or None]: glibc's madvise/malloc_trim, looked up once
_bf16_state: dict[str, bool] = {}  # {"cpu": has bf16?}, asked once per process
_BF16_LOCK: Final = threading.Lock()


def load_openvino() -> Any:
    """The ``openvino`` module, or ``MissingDependencyError`` naming the ``[openvino]`` extra."""
    return require("openvino", "openvino")


def cpu_has_bf16(core: Any | None = None) -> bool:
    """Whether OpenVINO's CPU plugin has bfloat16 kernels here (AVX512-BF16 or AMX): its
    ``OPTIMIZATION_CAPABILITIES`` list ``BF16``."""
    with _BF16_LOCK:
        if "cpu" not in _bf16_state:
            core = core if core is not None else load_openvino().Core()
            _bf16_state["cpu"] = "BF16" in core.get_property(_DEVICE, "OPTIMIZATION_CAPABILITIES")
        return _bf16_state["cpu"]


def graph_precisions(precision: str, graph_names: Mapping[str, Any] | tuple[str, ...]) -> dict[str, str]:
    """The precision each graph computes in (``"fp32"`` or ``"bf16"``) for engines of ``precision``."""
    if precision not in OV_PRECISIONS:
        raise EngineMismatchError(
            f"OpenVINO engines of precision {precision!r} are unknown to this trt-cosy (it knows "
            f"{', '.join(OV_PRECISIONS)}). Rebuild them with `trt-cosy build --backend openvino`."
        )
    if precision == "fp32":
        return dict.fromkeys(graph_names, "fp32")
    return {name: "fp32" if name in FP32_GRAPHS else "bf16" for name in graph_names}


def _port_names(model: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return (
        tuple(port.get_any_name() for port in model.inputs),
        tuple(port.get_any_name() for port in model.outputs),
    )


def pin_sinusoid_arguments(model: Any) -> int:
    """Keep the arguments of ``Sin``/``Cos`` in float32 under a bf16 precision hint; return how many.

    The sinusoidal time embeddings compute ``sin(1000 t f)``: rounded to bfloat16 (8 significant
    bits), an argument near 300 is off by up to 1 rad and the embedding is noise (measured: the
    CosyVoice2 estimator drops from 40 dB to 15 dB SNR against float32). OpenVINO's CPU plugin
    ignores ``disable_fp16_compression`` marks under bf16 and fuses the argument's ``Multiply`` into
    a bf16 subgraph; a node whose output is a model output keeps a float32 output, so each argument
    becomes an extra output (tiny: [B, 128]-sized), which ``OvRunner`` never returns.
    """
    arguments = [
        op.input_value(0)
        for op in model.get_ordered_ops()
        if op.get_type_name() in ("Sin", "Cos")
        and op.input_value(0).get_node().get_type_name() not in ("Parameter", "Constant")
    ]
    if arguments:
        model.add_outputs(arguments)
    return len(arguments)


def compiled_model_cache(core: Any) -> Path | None:
    """Let ``core`` cache compiled models in ``<trt-cosy cache>/openvino`` (``$TRT_COSY_CACHE``, else
    ``~/.cache/trt-cosy``); return the folder, or None when it cannot be created (then every load
    compiles). OpenVINO keys each entry by a hash of the model, device and settings, so a changed
    graph or precision never loads a stale entry; a hit skips the CPU plugin's weight repacking
    (the full-size estimator: 4.5 s to compile, 1.3 s from the cache, loaded machine)."""
    from ....cache_dir import cache_root

    folder = cache_root() / "openvino"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        core.set_property({"CACHE_DIR": str(folder)})
    except Exception as exc:  # a read-only home, or an OpenVINO without caching
        _LOGGER.info("OpenVINO compiled-model cache disabled: %r", exc)
        return None
    return folder


def _glibc() -> Any | None:
    """glibc through ctypes, with ``madvise`` and ``malloc_trim`` typed; None elsewhere."""
    with _WEIGHTS_LOCK:
        if not _libc:
            libc = None
            if sys.platform.startswith("linux"):
                try:
                    libc = ctypes.CDLL("libc.so.6", use_errno=True)
                    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
                    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
                except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
                    libc = None
            _libc.append(libc)
        return _libc[0]


def _register_weights(weights: Path, cache: str) -> None:
    """Remember a graph's weights file and the compiled-model cache folder it may load from instead."""
    names = [str(weights.resolve())] + ([str(Path(cache).resolve()) + "/"] if cache else [])
    with _WEIGHTS_LOCK:
        _weight_files.update(names)


def drop_weight_pages() -> int:
    """Drop the resident pages of the OpenVINO weight files this process maps read-only; return bytes.

    The CPU plugin reads a graph's weights file (``.bin``, or the compiled-model cache blob) once,
    when it repacks the weights on the first call, and keeps the mapping: ~140 MB of clean file
    pages per full-size estimator stay resident though nothing reads them. ``madvise(MADV_DONTNEED)``
    on a read-only shared file mapping only unmaps them (no data is lost: a later read faults them in
    from the page cache). Only mappings of files ``OvRunner.from_path`` registered are touched.
    """
    libc = _glibc()
    with _WEIGHTS_LOCK:
        files = tuple(_weight_files)
    if libc is None or not files:
        return 0
    dropped = 0
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return 0
    for line in maps:  # "lo-hi perms offset dev inode path"
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[1] != "r--s" or not fields[5].startswith(files):
            continue
        low, high = (int(value, 16) for value in fields[0].split("-"))
        if libc.madvise(low, high - low, _MADV_DONTNEED) == 0:
            dropped += high - low
    return dropped


def _compile_config(threads: int | None, compute: str) -> dict[str, Any]:
    return {
        "INFERENCE_PRECISION_HINT": _HINTS[compute],
        "INFERENCE_NUM_THREADS": default_threads() if threads is None else int(threads),
        "PERFORMANCE_HINT": "LATENCY",
        "NUM_STREAMS": 1,
    }


class OvRunner:
    """A ``Runner`` over an OpenVINO ``CompiledModel``.

    ``infer`` takes an idle infer request from the runner's pool (a new one when every request is
    busy), so any number of threads may call it at once; each request runs on its own memory.
    Feeds are cast to the dtypes the model declares (int64 ids to int32, ...); outputs are copies
    owned by the caller.
    """

    def __init__(
        self, compiled: Any, name: str, names: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    ):
        self.name = name
        self.compiled = compiled
        # Tensor names come from the model as read (``names``: its inputs and outputs): compiling may
        # add internal names to a port (``{"wav", "squeeze_1"}``) and ``get_any_name`` may pick either;
        # outputs past the model's own (``pin_sinusoid_arguments``) are never returned.
        inputs, outputs = names if names is not None else _port_names(compiled)
        self._inputs = {key: compiled.inputs[i].get_element_type().to_dtype() for i, key in enumerate(inputs)}
        self._shapes = {key: compiled.inputs[i].get_partial_shape() for i, key in enumerate(inputs)}
        self._outputs = outputs
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._busy = 0  # calls running
        self._calls = 0  # calls made

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        name: str,
        threads: int | None = None,
        compute: str = "fp32",
        core: Any | None = None,
        trusted: bool = False,
    ) -> OvRunner:
        """Compile the IR (or ONNX) file ``path`` for the CPU, computing in ``compute`` (``"fp32"`` or
        ``"bf16"``; bf16 falls back to fp32 with a warning where the CPU lacks it) with ``threads``
        threads (default: physical cores). A missing or unreadable file raises ``EngineMismatchError``.

        Unless ``trusted`` (the engines' manifest records that this graph compiled on a machine like
        this one), the first compile of the graph on this machine runs in a child process first
        (``check_compiles``): a native crash there raises ``NativeCrashError`` instead of killing this
        process.
        """
        ov = load_openvino()
        path = Path(path)
        if not path.is_file():
            raise EngineMismatchError(
                f"OpenVINO model {path} for graph '{name}' does not exist. Rebuild it with "
                "`trt-cosy build --backend openvino`."
            )
        core = core if core is not None else ov.Core()
        if compute == "bf16" and not cpu_has_bf16(core):
            _LOGGER.warning(
                "graph '%s': this CPU has no bfloat16 kernels (no AVX512-BF16/AMX); it runs in float32",
                name,
            )
            compute = "fp32"
        config = _compile_config(threads, compute)
        if not trusted:  # a native crash must not take this process down (runtime.native_guard)
            check_compiles(path, name, compute, config["INFERENCE_NUM_THREADS"])
        try:
            model = core.read_model(str(path))
            names = _port_names(model)
            if compute == "bf16":
                pin_sinusoid_arguments(model)
            compiled = core.compile_model(model, _DEVICE, config)
            cache = core.get_property("CACHE_DIR")
        # OpenVINO's pybind errors derive from RuntimeError/Exception only.
        except Exception as exc:
            raise EngineMismatchError(
                f"OpenVINO could not load {path} for graph '{name}' ({exc}). Rebuild it with "
                "`trt-cosy build --backend openvino`."
            ) from exc
        _LOGGER.debug(
            "compiled %s as '%s' (%s, %d threads)", path, name, compute, config["INFERENCE_NUM_THREADS"]
        )
        _register_weights(path.with_suffix(".bin"), str(cache))
        drop_weight_pages()  # compiling (or loading from the cache) read parts of the file
        return cls(compiled, name, names)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(self._inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._outputs

    @property
    def inference_precision(self) -> str:
        """What the compiled model computes in (OpenVINO's name: ``"f32"``, ``"bf16"``)."""
        return str(self.compiled.get_property("INFERENCE_PRECISION_HINT"))

    def input_specs(self) -> dict[str, tuple[tuple[int | str | None, ...], np.dtype | None]]:
        """Each input's declared shape (None marks a dynamic axis) and numpy dtype."""
        specs = {}
        for key, shape in self._shapes.items():
            dims = tuple(dim.get_length() if dim.is_static else None for dim in shape)
            specs[key] = (dims, self._inputs[key])
        return specs

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feed(self.name, self._inputs, feed)
        inputs = {key: self._cast(key, feed[key]) for key in self._inputs}
        request = self._acquire()
        try:
            result = request.infer(inputs, share_inputs=True, share_outputs=False)
            return {name: result[name] for name in self._outputs}
        finally:
            self._release(request)

    def _acquire(self) -> Any:
        with self._lock:
            self._busy += 1
            if self._idle:
                return self._idle.pop()
        return self.compiled.create_infer_request()

    def _release(self, request: Any) -> None:
        """After a call: drop the weight files' pages after a runner's first calls (they repack the
        weights: ``drop_weight_pages``) and, after the graphs of ``RELEASE_AFTER_GRAPHS``, the
        intermediate memory, when no other call of this runner is running (OpenVINO refuses to
        release a busy compiled model; the lock keeps a new call from starting meanwhile)."""
        released = False
        with self._lock:
            self._idle.append(request)
            self._busy -= 1
            self._calls += 1
            first = self._calls <= _DROP_CALLS
            if self._busy == 0 and self.name in RELEASE_AFTER_GRAPHS:
                try:
                    self.compiled.release_memory()  # buffers the next call allocates again
                    released = True
                except RuntimeError as exc:  # busy through a request made outside this runner
                    _LOGGER.debug("graph '%s' kept its intermediate memory: %s", self.name, exc)
        if first:
            drop_weight_pages()
        libc = _glibc() if released else None
        if libc is not None:
            libc.malloc_trim(0)  # the blocks OpenVINO freed, which glibc keeps in its heaps

    def _cast(self, key: str, value: np.ndarray) -> np.ndarray:  # OpenVINO shares only writable memory
        return cast_input(self.name, key, value, self._inputs[key], writeable=True)

    def kv_decoder(self, cache_shape: tuple[int, ...]) -> OvKVDecoder:
        """A step-by-step decoder for a graph of the ``LLM`` contract (see ``OvKVDecoder``)."""
        return OvKVDecoder(self, cache_shape)


def check_compiles(path: Path, name: str, compute: str, threads: int) -> None:
    """Compile ``path`` in a child process first, once per machine (``native_guard.checked_compile``):
    a native crash raises ``NativeCrashError`` naming what to use instead."""
    from ... import native_guard

    version = load_openvino().get_version()
    remedy = (
        "Rebuild the engines on this machine (`trt-cosy build --backend openvino ...` checks every graph and "
        "falls back to a precision that compiles, recorded in the manifest), or use `--precision fp32` "
        "or `--backend onnxruntime`."
        if compute != "fp32"
        else "Use `--backend onnxruntime` on this machine."
    )
    native_guard.checked_compile(
        backend="OpenVINO",
        version=version,
        graph=name,
        path=Path(path),
        compute=compute,
        threads=int(threads),
        target=COMPILE_CHECK_TARGET,
        payload={"path": str(path), "name": name, "compute": compute, "threads": int(threads)},
        remedy=remedy,
    )


def compile_in_this_process(path: str, name: str, compute: str, threads: int) -> None:
    """What the child of ``check_compiles`` runs: compile ``path`` as ``OvRunner.from_path`` would
    (same settings, same compiled-model cache, which the parent's compile then reads)."""
    ov = load_openvino()
    core = ov.Core()
    compiled_model_cache(core)
    model = core.read_model(str(path))
    if compute == "bf16":
        pin_sinusoid_arguments(model)
    core.compile_model(model, _DEVICE, _compile_config(threads, compute))


# The function ``check_compiles`` runs in the child (``module:function``; tests point it elsewhere).
COMPILE_CHECK_TARGET = f"{__name__}:compile_in_this_process"


class LazyOvRunner(LazyRunner[OvRunner]):
    """An ``OvRunner`` compiled on first use (thread-safe, ``runtime.backends.base.LazyRunner``): the graphs only
    some requests need (the streaming flow estimator). The file is checked at once; ``load()`` compiles it."""

    def __init__(
        self,
        path: str | Path,
        name: str,
        threads: int | None = None,
        compute: str = "fp32",
        trusted: bool = False,
    ):
        super().__init__(name)
        self._path, self._threads, self._compute, self._trusted = Path(path), threads, compute, trusted
        if not self._path.is_file():
            raise EngineMismatchError(
                f"OpenVINO model {self._path} for graph '{name}' does not exist. Rebuild it with "
                "`trt-cosy build --backend openvino`."
            )

    def _create(self) -> OvRunner:
        return OvRunner.from_path(self._path, self.name, self._threads, self._compute, trusted=self._trusted)


class OvKVDecoder:
    """Decode through an ``LLM``-contract model with the KV cache kept in OpenVINO tensors.

    Two infer requests take turns: each step reads the cache the other request's previous step
    wrote (``present_keys``/``present_values`` bound as ``past_keys``/``past_values``, no copy)
    and writes its own. A request's output memory is only rewritten by its own next step, by which
    time the other request has read it. Only the logits are copied out. One decoder holds one
    request's cache: create one per request (the compiled model is shared).

    Args:
        runner: the ``OvRunner`` of the LLM graph.
        cache_shape: the empty cache ``(L, 1, H, 0, Dh)``.
    """

    def __init__(self, runner: OvRunner, cache_shape: tuple[int, ...]):
        ov = load_openvino()
        self._tensor = ov.Tensor
        self._requests = (runner.compiled.create_infer_request(), runner.compiled.create_infer_request())
        self._turn = 0
        self._keys = ov.Tensor(np.zeros(cache_shape, dtype=np.float32))  # [L, 1, H, 0, Dh]
        self._values = ov.Tensor(np.zeros(cache_shape, dtype=np.float32))
        self.cached = 0  # positions in the cache

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """Feed ``inputs_embeds`` [1, T, D] after the cached positions; return the logits [1, T, V]."""
        inputs = np.array(inputs_embeds, dtype=np.float32, order="C")  # [1, T, D], a writable copy
        request = self._requests[self._turn]
        self._turn ^= 1
        request.set_tensor("inputs_embeds", self._tensor(inputs, shared_memory=True))
        request.set_tensor("past_keys", self._keys)
        request.set_tensor("past_values", self._values)
        request.infer()
        self._keys = request.get_tensor("present_keys")  # [L, 1, H, P + T, Dh], the request's memory
        self._values = request.get_tensor("present_values")
        self.cached += inputs.shape[1]
        return request.get_tensor("logits").data.copy()  # [1, T, V]
