"""The TensorRT backend: ``TrtRunner``, one deserialized engine with one execution context per slot.

Imported lazily: ``tensorrt`` and ``cuda.bindings`` are only imported by ``TrtRunner.from_plan``
(after a CUDA device-count check: creating TensorRT objects without a GPU crashes the process) and
by the helpers in ``runtime/backends/tensorrt/cuda.py``; the class itself works over any engine-like object, which
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
uses profiles k·P … k·P + P − 1 (``builder.trt.plans.build_plan(slots=S)``). Activation memory is
user-managed (``ExecutionContextAllocationStrategy.USER_MANAGED``): each slot holds one grow-only
block sized by ``get_device_memory_size_for_profile_v2`` for the largest profile it has selected,
so a slot that only ever streams never reserves the activations of the long profile.

What a plan looks like to the runner (I/O tensors, the profile check against ``profiles.json``, the
buffer sizes from a probe context, feed casting) is checked at load by ``bindings.PlanIO``.
"""

from __future__ import annotations

import json
import logging
import queue
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np

from ....errors import EngineMismatchError, InputError, TrtCosyError
from ...graphs import FLOW_ESTIMATOR_INCREMENTAL, FLOW_STEP_INCREMENTAL
from ...llm_decode import LLM_DECODE_NAME, device_cache_inputs
from ...profiles import PROFILES_NAME, GraphProfiles, read_profiles
from ..base import NamesFrom, engine_file
from .bindings import PlanIO, TensorInfo, dims, nbytes
from .cuda import CudaError, CudaGraph, DeviceBuffer, Event, PinnedBuffer, Stream
from .kv import TrtKVDecoder
from .plans import PLANS_DIR, TENSOR_ALIGNMENT, PlanRecord, checkpoint_digest, current_system, plan_mismatch
from .shared import load_tensorrt, shared_runtime, trt_logger

__all__ = [
    "PLANS_DIR",
    "TrtRunner",
    "TensorInfo",
    "PlanIO",
    "PlanRecord",
    "checkpoint_digest",
    "current_system",
    "plan_mismatch",
    "load_plan_runners",
    "checked_plans",
    "trt_logger",
    "load_tensorrt",
    "shared_runtime",
    "TENSOR_ALIGNMENT",
]

_LOGGER = logging.getLogger(__name__)
MAX_GRAPHS: Final = 128  # captured CUDA graphs kept per slot (least recently made dropped first)
# Inputs a plan reads from device memory that its caller owns (bound by address at every enqueue).
BOUND_INPUTS: Final[Mapping[str, tuple[str, ...]]] = {
    FLOW_ESTIMATOR_INCREMENTAL.name: ("past_blocks",),
    FLOW_STEP_INCREMENTAL.name: ("past_blocks", "past_tails"),  # the segment's store and its tails
}


def load_plan_runners(
    engines_dir: Path, slots: int = 1, checkpoint: str | None = None
) -> dict[str, TrtRunner]:
    """One ``TrtRunner`` per plan of ``engines_dir/plans``; a plan built for another GPU, TensorRT
    version, checkpoint or profile set raises ``EngineMismatchError`` (never used). Deferred
    deserialisation: ``runtime.backends.tensorrt.lazy.load_plans``."""
    return {
        name: TrtRunner.from_plan(path, name, graph, slots=slots, external=external)
        for name, (path, graph, external) in checked_plans(engines_dir, slots, checkpoint).items()
    }


def checked_plans(
    engines_dir: Path, slots: int = 1, checkpoint: str | None = None
) -> dict[str, tuple[Path, GraphProfiles, tuple[str, ...]]]:
    """``{graph: (plan path, profiles, inputs bound by address)}`` for every plan of ``engines_dir``,
    each record checked against this system, ``checkpoint``, its profiles and ``slots``; a stale or
    missing plan raises ``EngineMismatchError``. Nothing is deserialised."""
    engines_dir = Path(engines_dir)
    trt = load_tensorrt()
    system, profiles = current_system(trt), read_profiles(engines_dir / PROFILES_NAME)
    plans = {}
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
                f"`python -m trt_cosy.builder.trt.plans {engines_dir} --slots {slots}`."
            )
        path = engines_dir / PLANS_DIR / str(record.plan)
        if not path.is_file():
            raise EngineMismatchError(
                f"TensorRT plan {path} for graph '{name}' does not exist. Rebuild it with "
                "`trt-cosy build --backend tensorrt`."
            )
        # llm_decode reads the KV slots where runtime.backends.tensorrt.batch keeps them, the incremental estimator its
        # cache where stages.flow_incremental keeps it on the device: no buffers of their own for them
        external = BOUND_INPUTS.get(name, ())
        if name == LLM_DECODE_NAME:
            external = device_cache_inputs(graph.input_names)
        plans[name] = (path, graph, tuple(external))
    return plans


@dataclass
class _Slot:
    """One concurrent user of the engine: its context, stream, buffers and what was last set."""

    index: int
    context: Any
    stream: Stream
    first_profile: int  # the engine profile of this slot's local profile 0 (index · profiles per slot)
    workspace: DeviceBuffer  # the context's activation memory (USER_MANAGED), grow-only
    retired: list[tuple[DeviceBuffer, Event]] = field(default_factory=list)  # outgrown, maybe in use
    memory_bound: bool = False  # set_device_memory holds since the last profile switch
    device: dict[str, DeviceBuffer] = field(default_factory=dict)
    host: dict[str, PinnedBuffer] = field(default_factory=dict)
    profile: int = -1  # local profile index (into GraphProfiles.profiles)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    addresses: dict[str, int] = field(default_factory=dict)
    output_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    fresh: bool = True  # an input shape or the profile changed since the last plain launch
    graphs: OrderedDict[tuple, _Captured] = field(default_factory=OrderedDict)  # enqueue(graph=...)


@dataclass
class _Captured:
    """A slot's captured launch: the graph and the shapes and addresses it was captured with."""

    graph: CudaGraph
    shapes: tuple
    addresses: tuple


class TrtRunner(NamesFrom):
    """A ``Runner`` over a TensorRT engine (see the module docstring for the hot-path contract).

    Output-buffer contract: ``infer`` returns fresh arrays owned by the caller. ``device_tensor``
    exposes a slot's device buffers for stage-to-stage hand-off without host copies; their pointers
    never change after load, and their contents stay valid until the slot's next ``enqueue``.

    ``external`` inputs get no buffers of their own: every ``enqueue`` binds them to caller-owned
    device memory (``addresses``), e.g. the KV slots of ``runtime.backends.tensorrt.batch``; ``infer`` cannot feed them.
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
        external: Collection[str] = (),
    ):
        self.name, self.engine, self.profiles, self._trt = name, engine, profiles, trt
        self._keep_alive = keep_alive  # e.g. the plan's bytes' owner; the trt.Runtime is process-wide
        self._plan = PlanIO(engine, name, profiles, trt)
        self._io: dict[str, TensorInfo] = self._plan._io
        self.external = frozenset(external)
        if not self.external <= set(self.input_names):
            raise TrtCosyError(
                f"graph '{name}' has no inputs {sorted(self.external - set(self.input_names))}."
            )
        count = max(1, int(slots))
        self._plan.check_profiles(count)
        per_slot = len(profiles.profiles)
        self._workspace_need = [self._workspace_size(index) for index in range(count * per_slot)]
        sizes = {n: size for n, size in self._plan.max_bytes().items() if n not in self.external}
        self._slots = [self._make_slot(i, sizes) for i in range(count)]
        self._graphs = True  # CUDA graphs for enqueue(graph=...), until a capture fails
        self.graph_counts = dict.fromkeys(("plain", "captured", "updated", "replayed"), 0)
        self._free: queue.Queue[_Slot] = queue.Queue()
        for slot in self._slots:
            self._free.put(slot)

    @classmethod
    def from_plan(
        cls,
        path: str | Path,
        name: str,
        profiles: GraphProfiles,
        slots: int = 1,
        external: Collection[str] = (),
    ) -> TrtRunner:
        """Deserialize a plan written by ``trt-cosy build --backend tensorrt`` (``slots`` ≤ the plan's)."""
        trt = load_tensorrt()
        path = engine_file(path, "TensorRT plan", name, "tensorrt")
        engine = shared_runtime(trt).deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise EngineMismatchError(
                f"TensorRT could not load {path} (built by another TensorRT version or for another GPU?). Rebuild "
                "it with `trt-cosy build --backend tensorrt`."
            )
        return cls(engine, name, profiles, trt=trt, slots=slots, external=external)

    # -- Runner interface -------------------------------------------------------------------------

    @property
    def _names(self) -> PlanIO:
        return self._plan

    @property
    def slots(self) -> int:
        return len(self._slots)

    def input_specs(self) -> dict[str, tuple[tuple[int | str | None, ...], np.dtype]]:
        return {n: (tuple(self.profiles.max_shapes()[n]), self._io[n].dtype) for n in self.input_names}

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.external:
            raise TrtCosyError(
                f"graph '{self.name}' reads {sorted(self.external)} from bound device memory; use enqueue."
            )
        arrays = self._plan.prepare(feed)
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
                state.fresh = True
        state.output_shapes = {n: dims(state.context.get_tensor_shape(n)) for n in self.output_names}
        unresolved = {n: s for n, s in state.output_shapes.items() if any(d < 0 for d in s)}
        if unresolved:
            state.shapes = {}  # set them again next time: TensorRT may have kept only part of them
            raise TrtCosyError(f"graph '{self.name}': TensorRT left output shapes unresolved {unresolved}.")
        return dict(state.output_shapes)

    def copy_inputs(
        self, arrays: Mapping[str, np.ndarray], slot: int = 0, bound: Collection[str] = ()
    ) -> None:
        """Stage ``arrays`` in the slot's pinned buffers and copy them to its device buffers (async);
        ``external`` inputs and those named in ``bound`` (the caller binds them by address at
        ``enqueue``, e.g. a table already on the device) are not copied."""
        state = self._slots[slot]
        for name in self.input_names:
            if name in self.external or name in bound:
                continue
            array = np.ascontiguousarray(arrays[name], dtype=self._io[name].dtype)
            self._check_room(state, name, array.nbytes)
            if array.nbytes:
                state.host[name].view(array.dtype, array.shape)[...] = array
                state.device[name].copy_from_async(state.host[name], array.nbytes, state.stream)

    def enqueue(
        self, slot: int = 0, addresses: Mapping[str, int] | None = None, graph: Hashable = False
    ) -> None:
        """Launch the engine on the slot's stream and return at once.

        The launch always goes to the stream the slot's profile was switched on: the header calls a
        launch on an unsynchronised other stream undefined behaviour (``setOptimizationProfileAsync``).
        Order other work with ``record``/``wait``. ``addresses`` binds device pointers the caller owns
        (e.g. another stage's ``device_tensor``; 256-byte aligned) instead of the slot's buffers.
        Addresses are set only when they differ from the last launch. Never allocates.

        ``graph``: launch through a CUDA graph of this launch (one ``cudaGraphLaunch`` instead of
        TensorRT's kernel launches). ``True``: one graph per profile, shapes, bound addresses and
        activation memory, replayed as it is. Any other hashable (e.g. ``("euler", step)``): one graph
        per that key, profile and activation memory, replayed as it is while the shapes and addresses
        are those it was captured with, else captured again and updated in place
        (``CudaGraph.update``: new addresses without a new instantiation). The first launch after a
        shape change or a profile switch always runs plainly: trtexec enqueues once before it
        captures "to avoid capturing initialization calls" (``samples/common/sampleInference.cpp``).
        A failed capture turns graphs off for this runner (one warning) and launches plainly.
        """
        state = self._slots[slot]
        for name in self.output_names:
            self._check_room(state, name, nbytes(state.output_shapes[name], self._io[name].dtype))
        for name in (*self.input_names, *self.output_names):
            if name in self.external and not (addresses and name in addresses):
                raise TrtCosyError(
                    f"graph '{self.name}': '{name}' is bound by address; pass it in addresses."
                )
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
        if not state.memory_bound:  # after every profile switch or growth, right before the launch
            self._bind_workspace(state)
        if graph is not False and self._graphs and not state.fresh:
            self._launch_graph(state, graph)
            return
        self._call(state.context.execute_async_v3(state.stream.ptr), "execute_async_v3")
        state.fresh = False
        self.graph_counts["plain"] += 1

    def _launch_graph(self, state: _Slot, tag: Hashable) -> None:
        shapes, addresses = tuple(sorted(state.shapes.items())), tuple(sorted(state.addresses.items()))
        exact = tag is True  # one graph per shapes and addresses; else per tag, updated when they change
        key = (state.profile, state.workspace.ptr, *((shapes, addresses) if exact else (tag,)))

        def launch() -> None:
            ok = state.context.execute_async_v3(state.stream.ptr)
            self._call(ok, "execute_async_v3 while capturing a CUDA graph")

        entry = state.graphs.get(key)
        try:
            if entry is None:
                entry = _Captured(CudaGraph.capture(state.stream, launch), shapes, addresses)
                self._keep_graph(state, key, entry)
                self.graph_counts["captured"] += 1
            elif (entry.shapes, entry.addresses) != (shapes, addresses):
                entry.graph.update(state.stream, launch)
                entry.shapes, entry.addresses = shapes, addresses
                self.graph_counts["updated"] += 1
            else:
                self.graph_counts["replayed"] += 1
        except (CudaError, TrtCosyError) as exc:
            _LOGGER.warning("%s: CUDA graph capture failed (%s); launching without graphs", self.name, exc)
            self._graphs = False
            state.graphs.pop(key, None)
            if entry is not None:
                state.stream.synchronize()  # once: a launch of it may be queued
                entry.graph.free()
            self._call(state.context.execute_async_v3(state.stream.ptr), "execute_async_v3")
            self.graph_counts["plain"] += 1
            return
        state.graphs.move_to_end(key)
        entry.graph.launch(state.stream)

    @staticmethod
    def _keep_graph(state: _Slot, key: tuple, entry: _Captured) -> None:
        """Keep at most ``MAX_GRAPHS`` per slot, dropping the least recently launched."""
        while len(state.graphs) >= MAX_GRAPHS:
            _, dropped = state.graphs.popitem(last=False)
            state.stream.synchronize()  # it may still be running (rare: past MAX_GRAPHS keys)
            dropped.graph.free()
        state.graphs[key] = entry

    def copy_outputs(self, slot: int = 0, names: Collection[str] | None = None) -> dict[str, np.ndarray]:
        """Queue device -> pinned copies of every output (or of ``names``); the views are valid after a
        synchronize."""
        state, views = self._slots[slot], {}
        for name in self.output_names if names is None else names:
            shape, dtype = state.output_shapes[name], self._io[name].dtype
            size = nbytes(shape, dtype)
            self._check_room(state, name, size)
            if size:
                state.device[name].copy_to_async(state.host[name], size, state.stream)
            views[name] = state.host[name].view(dtype, shape)
        return views

    def kv_decoder(self, cache_shape: tuple[int, ...]) -> TrtKVDecoder:
        """A step-by-step decoder for an ``LLM``-contract plan whose KV cache stays in device memory
        (``runtime.backends.tensorrt.kv``): per step only the new embeddings go up and the logits come down."""
        return TrtKVDecoder(self, cache_shape)

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
            for captured in state.graphs.values():
                captured.graph.free()
            state.graphs = OrderedDict()
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
        for name, size in sizes.items():
            state.device[name], state.host[name] = DeviceBuffer(size), PinnedBuffer(size)
        self._provide_workspace(state, 0)  # memory for the first profile before any profile is selected
        return state

    def _provide_workspace(self, state: _Slot, profile: int) -> None:
        """Grow the slot's activation memory to what ``profile`` needs and hand it to the context.

        The old block may still be in use by launches queued on the slot's stream: it is retired with
        an event and freed once that event has passed (``_release_retired``), never with a host sync.
        """
        need = self._workspace_need[state.first_profile + profile]
        if need <= state.workspace.nbytes and (state.workspace.ptr or not need):
            return  # it fits (enqueue binds it again after a switch)
        if state.workspace.ptr:
            state.retired.append((state.workspace, Event().record(state.stream)))
        state.workspace = DeviceBuffer(need)  # need 0: a null pointer, which the header allows
        self._bind_workspace(state)
        _LOGGER.debug(
            "%s slot %d: %.1f MiB of activation memory",
            self.name,
            state.index,
            state.workspace.nbytes / 2**20,
        )

    @staticmethod
    def _bind_workspace(state: _Slot) -> None:
        """``set_device_memory`` with the slot's block. The header does not say that the binding
        survives ``setOptimizationProfileAsync``; Polygraphy's runner binds right before every
        ``execute_async_v3``, and so does ``enqueue`` after every switch (``memory_bound``)."""
        state.context.set_device_memory(state.workspace.ptr, state.workspace.nbytes)
        state.memory_bound = True

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
        # A profile switch invalidates the shapes; addresses and the activation memory are set again
        # too (the header promises neither survives; Polygraphy re-binds both before every launch).
        state.profile, state.shapes, state.addresses = profile, {}, {}
        state.memory_bound, state.fresh = False, True

    def _check_room(self, state: _Slot, name: str, nbytes: int) -> None:
        """Buffers never move after load (device pointers may be captured, e.g. by ``DeviceEulerLoop``)."""
        if nbytes > state.device[name].nbytes:
            raise TrtCosyError(
                f"graph '{self.name}': '{name}' needs {nbytes} bytes, more than the {state.device[name].nbytes} "
                "sized from the profile maxima at load. Rebuild the plans."
            )

    def _call(self, ok: Any, what: str) -> None:
        if ok is False:
            raise TrtCosyError(
                f"TensorRT failed to {what} for graph '{self.name}' (see the TensorRT log above)."
            )
