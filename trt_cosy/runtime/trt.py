"""The TensorRT backend: ``TrtRunner``, one deserialized engine with one execution context per slot.

Imported lazily: ``tensorrt`` and ``cuda.bindings`` are only imported by ``TrtRunner.from_plan``
(after a CUDA device-count check: creating TensorRT objects without a GPU crashes the process) and
by the helpers in ``runtime/cuda.py``; the class itself works over any engine-like object, which
is how the CPU tests drive its bookkeeping with fakes.

Hot path (house style P6/P7): ``set_shapes`` picks the optimization profile and sets input shapes
(only those that changed) and returns the output shapes, allocating nothing; ``enqueue`` binds the
slot's preallocated device buffers (``set_tensor_address`` only when a pointer changed) and calls
``execute_async_v3`` on the slot's stream, returning at once. Device buffers are sized at load from
the profile maxima and only ever grow; host staging buffers are pinned. ``infer`` (the Runner
interface) is set_shapes + copy in + enqueue + copy out + one stream synchronize, on a free slot.

Concurrency: each slot owns its context, stream and buffers; ``infer`` takes a free slot from a
queue, so several threads may share one runner (one request per slot at a time).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EngineMismatchError, InputError, MissingDependencyError, TrtCosyError, require
from .cuda import DeviceBuffer, Event, PinnedBuffer, Stream, gpu_unavailable_reason
from .profiles import PROFILES_NAME, GraphProfiles, read_profiles

__all__ = [
    "PLANS_DIR",
    "TrtRunner",
    "TensorInfo",
    "PlanRecord",
    "checkpoint_digest",
    "current_system",
    "plan_mismatch",
    "load_plan_runners",
    "trt_logger",
    "load_tensorrt",
]

_LOGGER = logging.getLogger(__name__)

PLANS_DIR = "plans"  # per GPU and TensorRT version: <graph>.plan, <graph>.json, timing.cache


def load_tensorrt() -> Any:
    """Import tensorrt after checking a GPU is usable; else ``MissingDependencyError`` with the reason."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise MissingDependencyError(
            f"TensorRT cannot run here: {reason}. TensorRT plans need an NVIDIA GPU with tensorrt and "
            "cuda-python (pip install 'trt-cosy[gpu]'); use the onnxruntime backend elsewhere."
        )
    return require("tensorrt", "gpu")


def trt_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` that forwards TensorRT's messages to this module's logger."""

    class _Bridge(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            severities = trt.ILogger.Severity
            if severity in (severities.INTERNAL_ERROR, severities.ERROR):
                _LOGGER.error("TensorRT: %s", msg)
            elif severity == severities.WARNING:
                _LOGGER.warning("TensorRT: %s", msg)
            else:
                _LOGGER.debug("TensorRT: %s", msg)

    return _Bridge()


@dataclass(frozen=True)
class PlanRecord:
    """``plans/<graph>.json``: what a plan was built from and for (house style P8)."""

    graph: str
    onnx: str
    onnx_sha256: str
    precision: str
    checkpoint: str  # checkpoint_digest() of the release files' sha256
    profiles: dict[str, Any]  # GraphProfiles.to_dict()
    plan: str | None = None
    system: dict[str, str] | None = None  # current_system(): gpu, compute_capability, tensorrt
    trt_cosy_version: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PlanRecord:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


def checkpoint_digest(hashes: Mapping[str, str]) -> str:
    """One sha256 over a release's per-file sha256 (``manifest.hash_checkpoint``)."""
    text = json.dumps(dict(sorted(hashes.items())), separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def current_system(trt: Any, device: int = 0) -> dict[str, str]:
    """What a plan is tied to: GPU name, compute capability and TensorRT version."""
    from .cuda import device_info

    info = device_info(device)
    return {
        "gpu": info["name"],
        "compute_capability": info["compute_capability"],
        "tensorrt": str(trt.__version__),
    }


def plan_mismatch(
    record: PlanRecord,
    system: Mapping[str, str],
    *,
    checkpoint: str | None = None,
    precision: str | None = None,
    profiles: Mapping[str, Any] | None = None,
    onnx_sha256: str | None = None,
) -> str | None:
    """Why ``record``'s plan must not run on ``system`` with these inputs, or None when it may."""
    built = record.system or {}
    if not built:
        return "no plan was built (--onnx-only)"
    for key, label in (
        ("gpu", "GPU"),
        ("compute_capability", "compute capability"),
        ("tensorrt", "TensorRT"),
    ):
        if str(built.get(key)) != str(system.get(key)):
            return f"built for {label} {built.get(key)}, this is {system.get(key)}"
    checks = (
        ("checkpoint", checkpoint, record.checkpoint),
        ("precision", precision, record.precision),
        ("profiles", profiles, record.profiles),
        ("ONNX graph", onnx_sha256, record.onnx_sha256),
    )
    for label, wanted, found in checks:
        if wanted is not None and wanted != found:
            return f"the {label} changed since the plan was built"
    return None


def load_plan_runners(
    engines_dir: Path, slots: int = 1, checkpoint: str | None = None
) -> dict[str, TrtRunner]:
    """One ``TrtRunner`` per plan of ``engines_dir/plans``; a plan built for another GPU, TensorRT
    version, checkpoint or profile set raises ``EngineMismatchError`` (never used)."""
    engines_dir = Path(engines_dir)
    trt = load_tensorrt()
    system, profiles = current_system(trt), read_profiles(engines_dir / PROFILES_NAME)
    runners = {}
    for name, graph in profiles.items():
        record_path = engines_dir / PLANS_DIR / f"{name}.json"
        try:
            record = PlanRecord.from_dict(json.loads(record_path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as exc:
            raise EngineMismatchError(
                f"{record_path} is missing or unreadable ({exc}). Build the plans: run "
                f"`trt-cosy build --backend tensorrt --out {engines_dir}`."
            ) from exc
        reason = plan_mismatch(record, system, checkpoint=checkpoint, profiles=graph.to_dict())
        if reason is not None:
            raise EngineMismatchError(
                f"TensorRT plan for '{name}' in {engines_dir} is stale: {reason}. Rebuild it: "
                f"run `trt-cosy build --backend tensorrt --out {engines_dir}`."
            )
        runners[name] = TrtRunner.from_plan(
            engines_dir / PLANS_DIR / str(record.plan), name, graph, slots=slots
        )
    return runners


@dataclass(frozen=True)
class TensorInfo:
    """One engine I/O tensor: name, direction and numpy dtype."""

    name: str
    is_input: bool
    dtype: np.dtype


def _engine_io(engine: Any, trt: Any) -> list[TensorInfo]:
    infos = []
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        infos.append(TensorInfo(name, is_input, np.dtype(trt.nptype(engine.get_tensor_dtype(name)))))
    return infos


def _nbytes(shape: Sequence[int], dtype: np.dtype) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * dtype.itemsize


@dataclass
class _Slot:
    """One concurrent user of the engine: its context, stream, buffers and what was last set."""

    index: int
    context: Any
    stream: Stream
    device: dict[str, DeviceBuffer] = field(default_factory=dict)
    host: dict[str, PinnedBuffer] = field(default_factory=dict)
    profile: int = -1
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    addresses: dict[str, int] = field(default_factory=dict)
    output_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


class TrtRunner:
    """A ``Runner`` over a TensorRT engine (see the module docstring for the hot-path contract).

    Output-buffer contract: ``infer`` returns fresh arrays owned by the caller. ``device_tensor``
    exposes a slot's device buffers for stage-to-stage hand-off without host copies; those stay
    valid until the slot's next ``enqueue``.
    """

    def __init__(
        self,
        engine: Any,
        name: str,
        profiles: GraphProfiles,
        *,
        trt: Any,
        slots: int = 1,
        keep_alive: Any = None,
    ):
        self.name, self.engine, self.profiles, self._trt = name, engine, profiles, trt
        self._keep_alive = keep_alive  # the trt.Runtime (and its logger) must outlive the engine
        self._io = {info.name: info for info in _engine_io(engine, trt)}
        self._check_profiles()
        sizes = self._max_bytes()
        self._slots = [self._make_slot(i, sizes) for i in range(max(1, int(slots)))]
        self._free: queue.Queue[_Slot] = queue.Queue()
        for slot in self._slots:
            self._free.put(slot)

    @classmethod
    def from_plan(cls, path: str | Path, name: str, profiles: GraphProfiles, slots: int = 1) -> TrtRunner:
        """Deserialize a plan written by ``trt-cosy build --backend tensorrt``."""
        trt = load_tensorrt()
        path = Path(path)
        if not path.is_file():
            raise EngineMismatchError(
                f"TensorRT plan {path} for graph '{name}' does not exist. Rebuild it with "
                "`trt-cosy build --backend tensorrt`."
            )
        logger = trt_logger(trt)
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise EngineMismatchError(
                f"TensorRT could not load {path} (built by another TensorRT version or for another GPU?). Rebuild "
                "it with `trt-cosy build --backend tensorrt`."
            )
        return cls(engine, name, profiles, trt=trt, slots=slots, keep_alive=(runtime, logger))

    # -- Runner interface -------------------------------------------------------------------------

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(n for n, info in self._io.items() if info.is_input)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(n for n, info in self._io.items() if not info.is_input)

    @property
    def slots(self) -> int:
        return len(self._slots)

    def input_specs(self) -> dict[str, tuple[tuple[int | str | None, ...], np.dtype]]:
        return {n: (tuple(self.profiles.max_shapes()[n]), self._io[n].dtype) for n in self.input_names}

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = self._prepare(feed)
        with self.slot() as index:
            shapes = self.set_shapes({k: v.shape for k, v in arrays.items()}, slot=index)
            self.copy_inputs(arrays, slot=index)
            self.enqueue(slot=index)
            views = self.copy_outputs(slot=index)
            self._slots[index].stream.synchronize()
            return {
                name: np.array(views[name], copy=True).reshape(shapes[name]) for name in self.output_names
            }

    # -- hot path ---------------------------------------------------------------------------------

    @contextmanager
    def slot(self) -> Iterator[int]:
        """Take a free slot for the duration of the block (blocks while all are busy)."""
        taken = self._free.get()
        try:
            yield taken.index
        finally:
            self._free.put(taken)

    def set_shapes(self, shapes: Mapping[str, Sequence[int]], slot: int = 0) -> dict[str, tuple[int, ...]]:
        """Select the profile and set the input shapes that changed; return every output's shape.

        Inputs beyond the largest profile raise ``InputError`` before TensorRT sees them. Allocates nothing.
        """
        state = self._slots[slot]
        missing = [n for n in self.input_names if n not in shapes]
        if missing:
            raise InputError(f"graph '{self.name}' needs inputs {list(self.input_names)}; missing {missing}.")
        wanted = {n: tuple(int(d) for d in shapes[n]) for n in self.input_names}
        profile = self.profiles.select(wanted)
        if profile != state.profile:
            self._call(
                state.context.set_optimization_profile_async(profile, state.stream.ptr),
                f"set optimization profile {profile}",
            )
            state.profile, state.shapes = profile, {}  # a profile switch invalidates every shape
        for name, shape in wanted.items():
            if state.shapes.get(name) != shape:
                self._call(state.context.set_input_shape(name, shape), f"set input '{name}' to {shape}")
                state.shapes[name] = shape
        state.output_shapes = {
            n: tuple(int(d) for d in state.context.get_tensor_shape(n)) for n in self.output_names
        }
        unresolved = {n: s for n, s in state.output_shapes.items() if any(d < 0 for d in s)}
        if unresolved:
            raise TrtCosyError(f"graph '{self.name}': TensorRT left output shapes unresolved {unresolved}.")
        return dict(state.output_shapes)

    def copy_inputs(self, arrays: Mapping[str, np.ndarray], slot: int = 0) -> None:
        """Stage ``arrays`` in the slot's pinned buffers and copy them to its device buffers (async)."""
        state = self._slots[slot]
        for name in self.input_names:
            array = np.ascontiguousarray(arrays[name], dtype=self._io[name].dtype)
            self._ensure(state, name, array.nbytes)
            if array.nbytes:
                state.host[name].view(array.dtype, array.shape)[...] = array
                state.device[name].copy_from_async(state.host[name], array.nbytes, state.stream)

    def enqueue(
        self, slot: int = 0, stream: Stream | None = None, addresses: Mapping[str, int] | None = None
    ) -> None:
        """Launch the engine on ``stream`` (default: the slot's own) and return at once.

        ``addresses`` binds device pointers the caller owns (e.g. another stage's ``device_tensor``)
        instead of the slot's buffers. Addresses are set only when they differ from the last launch.
        """
        state = self._slots[slot]
        for name in self.output_names:
            self._ensure(state, name, _nbytes(state.output_shapes[name], self._io[name].dtype))
        for name in (*self.input_names, *self.output_names):
            ptr = int(addresses[name]) if addresses and name in addresses else state.device[name].ptr
            if state.addresses.get(name) != ptr:
                self._call(state.context.set_tensor_address(name, ptr), f"bind '{name}'")
                state.addresses[name] = ptr
        self._call(state.context.execute_async_v3((stream or state.stream).ptr), "execute_async_v3")

    def copy_outputs(self, slot: int = 0) -> dict[str, np.ndarray]:
        """Queue device -> pinned copies of every output; the views are valid after a synchronize."""
        state, views = self._slots[slot], {}
        for name in self.output_names:
            shape, dtype = state.output_shapes[name], self._io[name].dtype
            nbytes = _nbytes(shape, dtype)
            self._ensure(state, name, nbytes)
            if nbytes:
                state.device[name].copy_to_async(state.host[name], nbytes, state.stream)
            views[name] = state.host[name].view(dtype, shape)
        return views

    def device_tensor(self, name: str, slot: int = 0) -> tuple[int, tuple[int, ...], np.dtype]:
        """(device pointer, shape, dtype) of a slot's buffer, for another stage's ``enqueue(addresses=...)``."""
        state = self._slots[slot]
        shape = state.output_shapes.get(name) or state.shapes.get(name, ())
        return state.device[name].ptr, shape, self._io[name].dtype

    def record(self, slot: int = 0, event: Event | None = None) -> Event:
        """Record an event after the slot's queued work (the next stage waits on it)."""
        return (event or Event()).record(self._slots[slot].stream)

    def wait(self, event: Event, slot: int = 0) -> None:
        """Make the slot's later work wait for ``event`` without blocking the host."""
        self._slots[slot].stream.wait(event)

    def stream(self, slot: int = 0) -> Stream:
        return self._slots[slot].stream

    def free(self) -> None:
        """Release every buffer and stream (the runner is unusable afterwards)."""
        for state in self._slots:
            for buffer in (*state.device.values(), *state.host.values()):
                buffer.free()
            state.stream.free()
        self._slots = []

    def __enter__(self) -> TrtRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    # -- internals --------------------------------------------------------------------------------

    def _check_profiles(self) -> None:
        count = int(self.engine.num_optimization_profiles)
        if count != len(self.profiles.profiles):
            raise EngineMismatchError(
                f"TensorRT plan of '{self.name}' has {count} profiles, profiles.json lists "
                f"{len(self.profiles.profiles)}. Rebuild with `trt-cosy build --backend tensorrt`."
            )
        if set(self.input_names) != set(self.profiles.input_names):
            raise EngineMismatchError(
                f"TensorRT plan of '{self.name}' has inputs {sorted(self.input_names)}, the "
                f"profiles name {sorted(self.profiles.input_names)}. Rebuild the engines."
            )

    def _make_slot(self, index: int, sizes: Mapping[str, int]) -> _Slot:
        context = self.engine.create_execution_context()
        if context is None:
            raise TrtCosyError(
                f"TensorRT could not create execution context {index} for '{self.name}' "
                "(out of device memory?). Use fewer slots."
            )
        state = _Slot(index, context, Stream())
        for name, nbytes in sizes.items():
            self._ensure(state, name, nbytes)
        return state

    def _max_bytes(self) -> dict[str, int]:
        """Bytes per tensor at the profile maxima (outputs: shapes TensorRT reports for max inputs)."""
        sizes = {n: _nbytes(s, self._io[n].dtype) for n, s in self.profiles.max_shapes().items()}
        probe = self.engine.create_execution_context()  # a throwaway context: the slots start clean
        with Stream() as stream:
            for index, profile in enumerate(self.profiles.profiles):
                probe.set_optimization_profile_async(index, stream.ptr)
                for name, (_, _, high) in profile.shapes.items():
                    probe.set_input_shape(name, high)
                for name in self.output_names:
                    shape = tuple(int(d) for d in probe.get_tensor_shape(name))
                    sizes[name] = max(sizes.get(name, 0), _nbytes(shape, self._io[name].dtype))
            stream.synchronize()
        del probe
        return sizes

    @staticmethod
    def _ensure(state: _Slot, name: str, nbytes: int) -> None:
        """Grow-only: (re)allocate the device and pinned buffers of ``name`` when too small."""
        device = state.device.setdefault(name, DeviceBuffer())
        if device.resize(nbytes):
            state.addresses.pop(name, None)  # the pointer moved: bind again on the next enqueue
        state.host.setdefault(name, PinnedBuffer()).resize(nbytes)

    def _prepare(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = {}
        for name in self.input_names:
            if name not in feed:
                raise InputError(
                    f"graph '{self.name}' needs inputs {list(self.input_names)}; missing '{name}'."
                )
            value, dtype = np.asarray(feed[name]), self._io[name].dtype
            try:  # same_kind: int64 -> int32 and float64 -> float32 pass, float -> int is refused
                arrays[name] = np.ascontiguousarray(value.astype(dtype, casting="same_kind", copy=False))
            except TypeError as exc:
                raise InputError(
                    f"graph '{self.name}' input '{name}' is {dtype}; got {value.dtype}."
                ) from exc
        return arrays

    def _call(self, ok: Any, what: str) -> None:
        if ok is False:
            raise TrtCosyError(
                f"TensorRT failed to {what} for graph '{self.name}' (see the TensorRT log above)."
            )
