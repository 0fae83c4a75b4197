"""The TensorRT backend: ``TrtRunner``, one deserialized engine with one execution context per slot.

Imported lazily: ``tensorrt`` and ``cuda.bindings`` are only imported by ``TrtRunner.from_plan``
(after a CUDA device-count check: creating TensorRT objects without a GPU crashes the process) and
by the helpers in ``runtime/cuda.py``; the class itself works over any engine-like object, which
is how the CPU tests drive its bookkeeping with fakes.

Hot path (house style P6/P7): ``set_shapes`` picks the optimization profile and sets input shapes
(only those that changed) and returns the output shapes, allocating nothing; ``enqueue`` binds the
slot's preallocated device buffers (``set_tensor_address`` only when a pointer changed) and calls
``execute_async_v3`` on the slot's stream (the stream its profile was switched on), returning at
once. I/O buffers are sized at load from the profile maxima and never move afterwards; host staging
buffers are pinned. ``infer`` (the Runner interface) is set_shapes + copy in + enqueue + copy out +
one stream synchronize, on a free slot.

Concurrency: each slot owns its context, stream, buffers and activation memory; ``infer`` takes a
free slot from a queue, so several threads may share one runner (one request per slot at a time).
Contexts in concurrent use must use separate optimization profiles (``NvInferRuntime.h``,
``class IExecutionContext``), so a plan built for S slots holds its P profiles S times and slot k
uses profiles k·P … k·P + P − 1 (``build.tensorrt.build_plan(slots=S)``). Activation memory is
user-managed (``ExecutionContextAllocationStrategy.USER_MANAGED``): each slot holds one grow-only
block sized by ``get_device_memory_size_for_profile_v2`` for the largest profile it has selected,
so a slot that only ever streams never reserves the activations of the long profile.
"""

from __future__ import annotations

import json
import logging
import queue
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import EngineMismatchError, InputError, TrtCosyError
from .cuda import DeviceBuffer, Event, PinnedBuffer, Stream
from .profiles import PROFILES_NAME, GraphProfiles, read_profiles
from .trt_plans import (
    PLANS_DIR,
    TENSOR_ALIGNMENT,
    PlanRecord,
    checkpoint_digest,
    current_system,
    plan_mismatch,
)
from .trt_shared import load_tensorrt, shared_runtime, trt_logger

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
    "shared_runtime",
    "TENSOR_ALIGNMENT",
]

_LOGGER = logging.getLogger(__name__)


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
        if plan_mismatch(record, system, slots=slots) is not None:
            raise EngineMismatchError(
                f"TensorRT plan for '{name}' in {engines_dir} was built for {record.slots} concurrent "
                f"slot(s), {slots} asked for. Use fewer slots or rebuild the plans: run "
                f"`python -m trt_cosy.build.tensorrt {engines_dir} --slots {slots}`."
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


def _engine_io(engine: Any, trt: Any, graph: str) -> list[TensorInfo]:
    infos = []
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        if engine.is_shape_inference_io(name):
            # Shape tensors are read from host memory (IExecutionContext::setTensorAddress, kHOST);
            # every tensor here is bound in device memory.
            raise TrtCosyError(
                f"TensorRT plan of '{graph}' has the shape tensor '{name}' (its values decide other tensors' "
                "shapes, so TensorRT wants it in host memory); trt-cosy binds all I/O in device memory. "
                f"Export the graph so that '{name}' is an ordinary data tensor, then rebuild the engines."
            )
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        infos.append(TensorInfo(name, is_input, np.dtype(trt.nptype(engine.get_tensor_dtype(name)))))
    return infos


def _nbytes(shape: Sequence[int], dtype: np.dtype) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * dtype.itemsize


def _dims(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


@dataclass
class _Slot:
    """One concurrent user of the engine: its context, stream, buffers and what was last set."""

    index: int
    context: Any
    stream: Stream
    first_profile: int  # the engine profile of this slot's local profile 0 (index · profiles per slot)
    workspace: DeviceBuffer  # the context's activation memory (USER_MANAGED), grow-only
    retired: list[tuple[DeviceBuffer, Event]] = field(default_factory=list)  # outgrown, maybe in use
    memory_given: bool = False  # set_device_memory has been called
    device: dict[str, DeviceBuffer] = field(default_factory=dict)
    host: dict[str, PinnedBuffer] = field(default_factory=dict)
    profile: int = -1  # local profile index (into GraphProfiles.profiles)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    addresses: dict[str, int] = field(default_factory=dict)
    output_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


class TrtRunner:
    """A ``Runner`` over a TensorRT engine (see the module docstring for the hot-path contract).

    Output-buffer contract: ``infer`` returns fresh arrays owned by the caller. ``device_tensor``
    exposes a slot's device buffers for stage-to-stage hand-off without host copies; their pointers
    never change after load, and their contents stay valid until the slot's next ``enqueue``.
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
        self._keep_alive = keep_alive  # e.g. the plan's bytes' owner; the trt.Runtime is process-wide
        self._io = {info.name: info for info in _engine_io(engine, trt, name)}
        count = max(1, int(slots))
        self._check_profiles(count)
        per_slot = len(profiles.profiles)
        self._workspace_need = [self._workspace_size(index) for index in range(count * per_slot)]
        sizes = self._max_bytes()
        self._slots = [self._make_slot(i, sizes) for i in range(count)]
        self._free: queue.Queue[_Slot] = queue.Queue()
        for slot in self._slots:
            self._free.put(slot)

    @classmethod
    def from_plan(cls, path: str | Path, name: str, profiles: GraphProfiles, slots: int = 1) -> TrtRunner:
        """Deserialize a plan written by ``trt-cosy build --backend tensorrt`` (``slots`` ≤ the plan's)."""
        trt = load_tensorrt()
        path = Path(path)
        if not path.is_file():
            raise EngineMismatchError(
                f"TensorRT plan {path} for graph '{name}' does not exist. Rebuild it with "
                "`trt-cosy build --backend tensorrt`."
            )
        engine = shared_runtime(trt).deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise EngineMismatchError(
                f"TensorRT could not load {path} (built by another TensorRT version or for another GPU?). Rebuild "
                "it with `trt-cosy build --backend tensorrt`."
            )
        return cls(engine, name, profiles, trt=trt, slots=slots)

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

        Inputs beyond the largest profile raise ``InputError`` before TensorRT sees them. Allocates nothing,
        except the first time the slot selects a profile that needs more activation memory than it holds.
        """
        state = self._slots[slot]
        if state.retired:
            self._release_retired(state)
        missing = [n for n in self.input_names if n not in shapes]
        if missing:
            raise InputError(f"graph '{self.name}' needs inputs {list(self.input_names)}; missing {missing}.")
        wanted = {n: tuple(int(d) for d in shapes[n]) for n in self.input_names}
        profile = self.profiles.select(wanted)
        if profile != state.profile:
            self._switch_profile(state, profile)
        for name, shape in wanted.items():
            if state.shapes.get(name) != shape:
                self._call(state.context.set_input_shape(name, shape), f"set input '{name}' to {shape}")
                state.shapes[name] = shape
        state.output_shapes = {n: _dims(state.context.get_tensor_shape(n)) for n in self.output_names}
        unresolved = {n: s for n, s in state.output_shapes.items() if any(d < 0 for d in s)}
        if unresolved:
            state.shapes = {}  # set them again next time: TensorRT may have kept only part of them
            raise TrtCosyError(f"graph '{self.name}': TensorRT left output shapes unresolved {unresolved}.")
        return dict(state.output_shapes)

    def copy_inputs(self, arrays: Mapping[str, np.ndarray], slot: int = 0) -> None:
        """Stage ``arrays`` in the slot's pinned buffers and copy them to its device buffers (async)."""
        state = self._slots[slot]
        for name in self.input_names:
            array = np.ascontiguousarray(arrays[name], dtype=self._io[name].dtype)
            self._check_room(state, name, array.nbytes)
            if array.nbytes:
                state.host[name].view(array.dtype, array.shape)[...] = array
                state.device[name].copy_from_async(state.host[name], array.nbytes, state.stream)

    def enqueue(self, slot: int = 0, addresses: Mapping[str, int] | None = None) -> None:
        """Launch the engine on the slot's stream and return at once.

        The launch always goes to the stream the slot's profile was switched on: the header calls a
        launch on an unsynchronised other stream undefined behaviour (``setOptimizationProfileAsync``).
        Order other work with ``record``/``wait``. ``addresses`` binds device pointers the caller owns
        (e.g. another stage's ``device_tensor``; 256-byte aligned) instead of the slot's buffers.
        Addresses are set only when they differ from the last launch. Never allocates.
        """
        state = self._slots[slot]
        for name in self.output_names:
            self._check_room(state, name, _nbytes(state.output_shapes[name], self._io[name].dtype))
        for name in (*self.input_names, *self.output_names):
            ptr = int(addresses[name]) if addresses and name in addresses else state.device[name].ptr
            if ptr % TENSOR_ALIGNMENT:
                raise TrtCosyError(
                    f"graph '{self.name}': the address bound to '{name}' ({ptr:#x}) is not "
                    f"{TENSOR_ALIGNMENT}-byte aligned, as TensorRT requires; offset it by a multiple of "
                    f"{TENSOR_ALIGNMENT} bytes."
                )
            if state.addresses.get(name) != ptr:
                self._call(state.context.set_tensor_address(name, ptr), f"bind '{name}'")
                state.addresses[name] = ptr
        self._call(state.context.execute_async_v3(state.stream.ptr), "execute_async_v3")

    def copy_outputs(self, slot: int = 0) -> dict[str, np.ndarray]:
        """Queue device -> pinned copies of every output; the views are valid after a synchronize."""
        state, views = self._slots[slot], {}
        for name in self.output_names:
            shape, dtype = state.output_shapes[name], self._io[name].dtype
            nbytes = _nbytes(shape, dtype)
            self._check_room(state, name, nbytes)
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

    def device_memory(self) -> list[dict[str, int]]:
        """Per slot (execution context), device bytes: ``activations`` held now, ``activations_max``
        (the largest profile's need), ``io`` (the preallocated input/output buffers) and ``total``."""
        per_slot = len(self.profiles.profiles)
        report = []
        for state in self._slots:
            needs = self._workspace_need[state.first_profile : state.first_profile + per_slot]
            io = sum(buffer.nbytes for buffer in state.device.values())
            held = state.workspace.nbytes
            report.append({"activations": held, "activations_max": max(needs), "io": io, "total": held + io})
        return report

    def free(self) -> None:
        """Release every buffer and stream (the runner is unusable afterwards)."""
        for state in self._slots:
            state.stream.synchronize()  # queued launches may still use the memory below
            state.context = None  # the context goes before the activation memory it was given
            self._release_retired(state, wait=True)
            for buffer in (*state.device.values(), *state.host.values(), state.workspace):
                buffer.free()
            state.stream.free()
        self._slots = []

    def __enter__(self) -> TrtRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    # -- internals --------------------------------------------------------------------------------

    def _check_profiles(self, slots: int) -> None:
        """The plan must hold profiles.json's profiles once per slot (slot k: k·P … k·P + P − 1)."""
        rebuild = "Rebuild the plans: run `python -m trt_cosy.build.tensorrt ENGINES_DIR --force`."
        if set(self.input_names) != set(self.profiles.input_names):
            raise EngineMismatchError(
                f"TensorRT plan of '{self.name}' has inputs {sorted(self.input_names)}, the "
                f"profiles name {sorted(self.profiles.input_names)}. {rebuild}"
            )
        total, per_slot = int(self.engine.num_optimization_profiles), len(self.profiles.profiles)
        if total < per_slot or total % per_slot:
            raise EngineMismatchError(
                f"TensorRT plan of '{self.name}' has {total} profiles; profiles.json lists {per_slot} (a plan "
                f"holds them once per slot). {rebuild}"
            )
        if slots > total // per_slot:
            raise EngineMismatchError(
                f"TensorRT plan of '{self.name}' was built for {total // per_slot} concurrent slot(s); {slots} "
                "were asked for (contexts in concurrent use need separate profiles). Use fewer slots or "
                f"rebuild: `python -m trt_cosy.build.tensorrt ENGINES_DIR --slots {slots}`."
            )
        for index in range(total):
            profile = self.profiles.profiles[index % per_slot]
            for name, expected in profile.shapes.items():
                found = tuple(_dims(d) for d in self.engine.get_tensor_profile_shape(name, index))
                if found != tuple(expected):
                    raise EngineMismatchError(
                        f"TensorRT plan of '{self.name}': profile {index} gives '{name}' min/opt/max {found}, "
                        f"profiles.json's '{profile.name}' says {tuple(expected)}. {rebuild}"
                    )

    def _workspace_size(self, index: int) -> int:
        size = int(self.engine.get_device_memory_size_for_profile_v2(index))
        if size < 0:
            raise TrtCosyError(
                f"TensorRT reports no device memory size for profile {index} of '{self.name}'."
            )
        return size

    def _make_slot(self, index: int, sizes: Mapping[str, int]) -> _Slot:
        strategy = self._trt.ExecutionContextAllocationStrategy.USER_MANAGED
        context = self.engine.create_execution_context(strategy)
        if context is None:
            raise TrtCosyError(
                f"TensorRT could not create execution context {index} for '{self.name}' "
                "(out of device memory?). Use fewer slots."
            )
        state = _Slot(index, context, Stream(), index * len(self.profiles.profiles), DeviceBuffer())
        for name, nbytes in sizes.items():
            state.device[name], state.host[name] = DeviceBuffer(nbytes), PinnedBuffer(nbytes)
        self._provide_workspace(state, 0)  # memory for the first profile before any profile is selected
        return state

    def _provide_workspace(self, state: _Slot, profile: int) -> None:
        """Grow the slot's activation memory to what ``profile`` needs and hand it to the context.

        The old block may still be in use by launches queued on the slot's stream: it is retired with
        an event and freed once that event has passed (``_release_retired``), never with a host sync.
        """
        need = self._workspace_need[state.first_profile + profile]
        if state.memory_given and need <= state.workspace.nbytes:
            return
        if state.workspace.ptr:
            state.retired.append((state.workspace, Event().record(state.stream)))
        state.workspace = DeviceBuffer(need)  # need 0: a null pointer, which the header allows
        state.context.set_device_memory(state.workspace.ptr, state.workspace.nbytes)
        state.memory_given = True
        _LOGGER.debug(
            "%s slot %d: %.1f MiB of activation memory",
            self.name,
            state.index,
            state.workspace.nbytes / 2**20,
        )

    @staticmethod
    def _release_retired(state: _Slot, wait: bool = False) -> None:
        """Free the activation blocks whose last launches have finished (all of them with ``wait``)."""
        keep = []
        for buffer, event in state.retired:
            if wait or event.done():
                buffer.free()
                event.free()
            else:
                keep.append((buffer, event))
        state.retired = keep

    def _switch_profile(self, state: _Slot, profile: int) -> None:
        self._provide_workspace(state, profile)
        engine_profile = state.first_profile + profile
        what = f"select optimization profile {engine_profile} ('{self.profiles.profiles[profile].name}')"
        try:  # the binding raises RuntimeError where the C++ API returns false (pyCore.cpp)
            ok = state.context.set_optimization_profile_async(engine_profile, state.stream.ptr)
        except RuntimeError as exc:
            state.profile = -1
            raise TrtCosyError(f"TensorRT failed to {what} for graph '{self.name}': {exc}") from exc
        self._call(ok, what)
        # A profile switch invalidates the shapes; addresses are set again too (the header does not
        # promise that they survive, and Polygraphy compares against get_tensor_address()).
        state.profile, state.shapes, state.addresses = profile, {}, {}

    def _max_bytes(self) -> dict[str, int]:
        """Bytes per tensor at the profile maxima (outputs: shapes TensorRT reports for max inputs).

        The probe context is USER_MANAGED: it only infers shapes (allowed before device memory is set,
        ``IExecutionContext::updateDeviceMemorySizeForShapes``), so it reserves no activation memory.
        """
        sizes = {n: _nbytes(s, self._io[n].dtype) for n, s in self.profiles.max_shapes().items()}
        strategy = self._trt.ExecutionContextAllocationStrategy.USER_MANAGED
        probe = self.engine.create_execution_context(strategy)
        if probe is None:
            raise TrtCosyError(f"TensorRT could not create an execution context for '{self.name}'.")
        try:
            with Stream() as stream:
                for index, profile in enumerate(self.profiles.profiles):
                    self._probe_profile(probe, stream, index, profile, sizes)
                stream.synchronize()
        finally:
            del probe  # released before the slots select their profiles
        return sizes

    def _probe_profile(
        self, probe: Any, stream: Stream, index: int, profile: Any, sizes: dict[str, int]
    ) -> None:
        where = f"TensorRT plan of '{self.name}', profile {index} ('{profile.name}')"
        try:
            ok = probe.set_optimization_profile_async(index, stream.ptr)
        except RuntimeError as exc:
            raise EngineMismatchError(f"{where} cannot be selected: {exc}. Rebuild the plans.") from exc
        if ok is False:
            raise EngineMismatchError(f"{where} cannot be selected. Rebuild the plans.")
        for name, (_, _, high) in profile.shapes.items():
            if not probe.set_input_shape(name, high):
                raise EngineMismatchError(
                    f"{where} rejects its own maximum shape {high} for '{name}': the plan does not match "
                    "profiles.json. Rebuild the plans."
                )
        for name in self.output_names:
            shape = _dims(probe.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise TrtCosyError(
                    f"{where}: output '{name}' has shape {shape} at the maximum inputs; TensorRT cannot size "
                    "it before running (data-dependent output shapes are not supported)."
                )
            sizes[name] = max(sizes.get(name, 0), _nbytes(shape, self._io[name].dtype))

    def _check_room(self, state: _Slot, name: str, nbytes: int) -> None:
        """Buffers never move after load (device pointers may be captured, e.g. by ``DeviceEulerLoop``)."""
        if nbytes > state.device[name].nbytes:
            raise TrtCosyError(
                f"graph '{self.name}': '{name}' needs {nbytes} bytes, more than the {state.device[name].nbytes} "
                "sized from the profile maxima at load. Rebuild the plans."
            )

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
