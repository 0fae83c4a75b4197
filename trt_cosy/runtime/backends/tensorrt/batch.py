"""Batched LLM decoding on TensorRT: the KV slots in device memory and the ``llm_decode`` plan's
steps over them (``runtime.llm_decode`` is the contract; ``stages.llm_batch`` drives it with the same
scheduler as on ONNX Runtime).

``DeviceKVSlots`` holds one device allocation, allocated once, laid out [2L, S, H, C, Dh] in the
plan's cache dtype (``cache_dtype``: float32 or float16, checked against the slots at every stepper;
keys of layers 0..L-1, then their values; S slots of C positions). Active rows are the first
``count`` slots, as in ``kv_slots.KVSlots``: the plan's ``past_key_<i>`` / ``past_value_<i>``
[B, H, C, Dh] are bound straight to each layer's first B slots (one address per layer, never a copy).
Each position of a row lives at [z, row, h, position]; moving data in and out is one
``cudaMemcpy3DAsync`` per row (depth 2L, height H):

* ``add``: a prefilled cache [2L, H, T, Dh] (pinned) -> the row's first T positions;
* ``remove``: the last active row's positions -> the freed row (device to device);
* each step: the plan's ``new_kv`` [B, 2L, H, Dh] row b -> position ``lengths[b]`` of slot b.

``TrtBatchLLM`` mirrors ``backends.onnxruntime.batch.OrtBatchLLM``: ``prefill`` runs the per-request ``llm`` graph at
batch 1 on any runner (any thread) into a host ``PrefillCache``; ``decoder`` returns the stepper the
scheduler calls. A step selects the profile by batch size B and position bucket P (the window read:
the longest row rounded up to ``WINDOW_STEP``, capped at the capacity), copies the small inputs
(embeddings and lengths; ``key_positions`` is bound from a device table), launches, writes the
new positions into the slots and downloads only the logits, with one synchronize. Layout and
copies are checked on CPUs over fake CUDA and a fake engine computing with the exported graph on
ONNX Runtime (tests/test_trt_llm_decode.py); bytes and synchronizes per step are counted in
tests/test_trt_device_counts.py; timings only a GPU can give.

With ``fixed_shapes`` (``EngineConfig.deterministic``) every step has one shape: batch = all ``slots``
(the inactive rows fed zeros at position 0, their outputs dropped) and window = ``capacity``, so
every step runs the same profile and the same shapes, hence the same kernels (tactics are chosen per
profile at build time and fixed in the plan). What TensorRT promises and what it does not is in
docs/determinism.md: a row's arithmetic then does not depend on how many rows share the step or on
their lengths; it may still depend on the slot a row sits in only if a kernel treats rows of one
batch differently, which no GEMM or reduction here does by row index.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import numpy as np

from ....errors import EngineMismatchError, InputError, TrtCosyError
from ...kv_slots import PrefillCache
from ...llm_decode import cache_input_names
from .cuda import DeviceBuffer, PinnedBuffer, Pitched, Stream, copy_3d_async

__all__ = ["DeviceKVSlots", "TrtBatchLLM", "WINDOW_STEP", "cache_dtype", "decode_limits"]

_LOGGER = logging.getLogger(__name__)
WINDOW_STEP: Final = 64  # key window P grows in steps of this many positions (fewer shape changes)
_CACHE_DTYPES: Final = (np.dtype(np.float32), np.dtype(np.float16))


def decode_limits(runner: Any) -> tuple[int, int]:
    """(largest batch, largest window P) the ``llm_decode`` plan's profiles accept."""
    shapes = runner.profiles.max_shapes()
    return int(shapes["past_lengths"][0]), int(shapes["key_positions"][0])


def cache_dtype(runner: Any) -> np.dtype:
    """The dtype of the ``llm_decode`` plan's KV cache: every ``past_key_<i>`` / ``past_value_<i>``
    input and the ``new_kv`` output must share it (the slots are copied into and bound as they are);
    a plan that mixes them, or keeps its cache in another type, raises ``EngineMismatchError``."""
    specs = runner.input_specs()
    cache = [name for name in specs if name.startswith(("past_key_", "past_value_"))]
    found = {name: np.dtype(specs[name][1]) for name in cache}
    found["new_kv"] = np.dtype(runner.device_tensor("new_kv")[2])
    kinds = set(found.values())
    if len(kinds) != 1 or not kinds <= set(_CACHE_DTYPES):
        raise EngineMismatchError(
            f"graph '{runner.name}' keeps its KV cache as {sorted({str(d) for d in kinds})}; the device KV "
            "slots need one of float32 / float16 for every past_key/past_value input and new_kv. Rebuild "
            "the plans (`trt-cosy build --backend tensorrt`)."
        )
    return kinds.pop()


class DeviceKVSlots:
    """``slots`` rows of ``capacity`` positions for ``layers`` layers in device memory (one owner: the
    decode scheduler's thread; same interface as ``kv_slots.KVSlots``). ``dtype``: the plan's cache
    dtype (``cache_dtype``); prefilled float32 caches are cast on their way in."""

    def __init__(
        self, slots: int, layers: int, kv_heads: int, capacity: int, head_dim: int, dtype: Any = np.float32
    ):
        if slots < 1 or capacity < 1:
            raise InputError(f"KV slots need slots >= 1 and capacity >= 1, got {slots} and {capacity}.")
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CACHE_DTYPES:
            raise InputError(f"KV slots hold float32 or float16, not {self.dtype}.")
        self.slots, self.capacity, self.layers = slots, capacity, layers
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.lengths = np.zeros(slots, np.int32)  # cached positions per row
        self.count = 0
        self.buffer = DeviceBuffer(self.nbytes)  # [2L, S, H, C, Dh]
        self._staging = PinnedBuffer()  # a prefilled cache on its way in, grow-only
        self._stream = Stream()

    @property
    def nbytes(self) -> int:
        positions = 2 * self.layers * self.slots * self.kv_heads * self.capacity
        return positions * self.head_dim * self.dtype.itemsize

    @property
    def _position_bytes(self) -> int:
        return self.head_dim * self.dtype.itemsize

    def row_address(self, row: int, position: int = 0) -> int:
        """Device address of (z = 0, ``row``, h = 0, ``position``)."""
        return self.buffer.ptr + (row * self.kv_heads * self.capacity + position) * self._position_bytes

    def _slots_view(self, ptr: int) -> Pitched:
        """A pitched view whose rows are (z, row, h) position lines and whose slices are z."""
        return Pitched(ptr, self.capacity * self._position_bytes, self.slots * self.kv_heads)

    def cache_addresses(self) -> dict[str, int]:
        """``past_key_<i>`` / ``past_value_<i>`` -> their layer's first slot (rows 0..B-1 are contiguous)."""
        layer_bytes = self.slots * self.kv_heads * self.capacity * self._position_bytes
        names = cache_input_names(self.layers)  # past_key_0, past_value_0, past_key_1, ...
        return {
            name: self.buffer.ptr + (index // 2 + (index % 2) * self.layers) * layer_bytes
            for index, name in enumerate(names)
        }

    def add(self, cache: PrefillCache) -> int:
        """Copy a prefilled cache into the next free row (one 3D copy; waits for it); returns the row."""
        if self.count >= self.slots:
            raise InputError(f"all {self.slots} KV slots are in use")
        if cache.length > self.capacity:
            raise InputError(f"a cache of {cache.length} positions exceeds the slot capacity {self.capacity}")
        row, length = self.count, cache.length
        if length:
            shape = (2 * self.layers, self.kv_heads, length, self.head_dim)  # [2L, H, T, Dh]
            self._staging.resize(int(np.prod(shape)) * self.dtype.itemsize)
            staged = self._staging.view(self.dtype, shape)  # float32 prefill cast on assignment
            staged[: self.layers] = np.stack([part[0] for part in cache.keys])  # [L, H, T, Dh]
            staged[self.layers :] = np.stack([part[0] for part in cache.values])
            width = length * self._position_bytes
            source = Pitched(self._staging.ptr, width, self.kv_heads)
            copy_3d_async(
                self._slots_view(self.row_address(row)), source, width, self.kv_heads, 2 * self.layers,
                self._stream, "to_device",
            )  # fmt: skip
            self._stream.synchronize()  # the staging buffer is reused by the next add
        self.lengths[row] = length
        self.count += 1
        return row

    def remove(self, row: int) -> int | None:
        """Free ``row``; the last active row moves into it (device to device). Returns the row that
        moved there, or None when ``row`` was the last one."""
        last = self.count - 1
        self.count = last
        if row == last:
            self.lengths[last] = 0
            return None
        length = int(self.lengths[last])
        if length:
            width = length * self._position_bytes
            copy_3d_async(
                self._slots_view(self.row_address(row)), self._slots_view(self.row_address(last)), width,
                self.kv_heads, 2 * self.layers, self._stream, "device",
            )  # fmt: skip
            self._stream.synchronize()  # the next step (on another stream) reads it
        self.lengths[row] = length
        self.lengths[last] = 0
        return last

    def write_new(self, new_kv: int, rows: int, stream: Stream) -> None:
        """Queue the copy of ``new_kv`` [B, 2L, H, Dh] (device) row b to position ``lengths[b]``."""
        line = self._position_bytes
        for row in range(rows):
            source = Pitched(new_kv + row * 2 * self.layers * self.kv_heads * line, line, self.kv_heads)
            target = self._slots_view(self.row_address(row, int(self.lengths[row])))
            copy_3d_async(target, source, line, self.kv_heads, 2 * self.layers, stream, "device")

    def free(self) -> None:
        self._stream.synchronize()
        for resource in (self.buffer, self._staging, self._stream):
            resource.free()


class TrtBatchLLM:
    """The per-request ``llm`` runner (prefill) and the ``llm_decode`` plan (batched steps)."""

    def __init__(self, runner: Any, decode_runner: Any, layers: int):
        self.runner, self.decode_runner, self.layers = runner, decode_runner, layers
        names = set(decode_runner.input_names)
        wanted = {"inputs_embeds", "past_lengths", "key_positions", *cache_input_names(layers)}
        if not wanted <= names:
            raise InputError(
                f"graph '{decode_runner.name}' lacks the batched decode inputs {sorted(wanted - names)}"
            )

    def prefill(self, inputs_embeds: np.ndarray, cache: PrefillCache) -> np.ndarray:
        """Run ``inputs_embeds`` [1, T, D] from position 0 on ``llm``, filling ``cache``; returns the
        logits of the last position [V]."""
        layers, (_, heads, _, head_dim) = len(cache.keys), cache.keys[0].shape  # each [1, H, T, Dh]
        empty = np.zeros((layers, 1, heads, 0, head_dim), np.float32)  # [L, 1, H, 0, Dh]
        out = self.runner.infer({"inputs_embeds": inputs_embeds, "past_keys": empty, "past_values": empty})
        for layer in range(layers):
            cache.keys[layer][...] = out["present_keys"][layer]  # [1, H, T, Dh]
            cache.values[layer][...] = out["present_values"][layer]
        return out["logits"][0, -1]

    def decoder(self, slots: DeviceKVSlots, vocab: int, fixed_shapes: bool = False) -> _DeviceStepper:
        return _DeviceStepper(self.decode_runner, slots, vocab, fixed_shapes)


class _DeviceStepper:
    def __init__(self, runner: Any, slots: DeviceKVSlots, vocab: int, fixed_shapes: bool = False):
        self._runner, self._slots, self._vocab = runner, slots, vocab
        self.fixed_shapes = fixed_shapes
        """Every step at batch ``slots.slots`` and window ``slots.capacity`` (one shape: batch-invariant);
        False: the active rows and the longest row's window bucket."""
        self._addresses = slots.cache_addresses()
        self._cache_names = tuple(self._addresses)
        plan_dtype = cache_dtype(runner)
        if plan_dtype != slots.dtype:
            raise EngineMismatchError(
                f"the KV slots hold {slots.dtype}, graph '{runner.name}' reads and writes its cache as "
                f"{plan_dtype}; make the slots with dtype=cache_dtype(runner)."
            )
        max_batch, max_window = decode_limits(runner)
        if slots.slots > max_batch or slots.capacity > max_window:
            raise InputError(
                f"{slots.slots} KV slots of {slots.capacity} positions exceed the llm_decode profiles "
                f"(batch <= {max_batch}, positions <= {max_window}); use fewer slots or positions."
            )
        # key_positions [P] is 0..P-1: one table of ``capacity`` positions on the device, bound by address
        # (its first P entries) at every step, so a step sends only what is new (issue 29 item 2).
        table = np.arange(slots.capacity, dtype=np.int32)  # [C]
        self._positions = DeviceBuffer(table.nbytes)
        with PinnedBuffer(table.nbytes) as staged:
            staged.view(np.int32, table.shape)[...] = table
            stream = runner.stream(0)
            self._positions.copy_from_async(staged, table.nbytes, stream)
            stream.synchronize()  # once, before the pinned table is freed
        self._addresses["key_positions"] = self._positions.ptr

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """One new position for each of the ``count`` active rows: ``inputs_embeds`` [B, 1, D] ->
        logits [B, V] (a fresh array). Each row's length grows by one."""
        slots, runner = self._slots, self._runner
        rows = slots.count
        if inputs_embeds.shape[0] != rows:
            raise InputError(f"{inputs_embeds.shape[0]} inputs for {rows} active rows")
        if rows == 0:
            return np.zeros((0, self._vocab), np.float32)
        longest = int(slots.lengths[:rows].max())
        if longest >= slots.capacity:
            raise InputError("a row reached the KV slot capacity")
        inputs = np.ascontiguousarray(inputs_embeds, dtype=np.float32)  # [B, 1, D]
        if self.fixed_shapes:  # all slots, the whole capacity: the same shapes at every step
            batch, window = slots.slots, slots.capacity
            lengths = np.zeros(batch, np.int32)  # [S]: the inactive rows' lengths are 0
            lengths[:rows] = slots.lengths[:rows]
            padded = np.zeros((batch, *inputs.shape[1:]), np.float32)  # [S, 1, D]
            padded[:rows] = inputs
            inputs = padded
        else:
            batch, lengths = rows, slots.lengths[:rows].copy()  # [B] int32
            window = min(slots.capacity, max(WINDOW_STEP, -(-longest // WINDOW_STEP) * WINDOW_STEP))
        cache_shape = (batch, slots.kv_heads, slots.capacity, slots.head_dim)  # [B, H, C, Dh]
        feed = {
            "inputs_embeds": inputs,  # [B, 1, D]
            "past_lengths": lengths,  # [B]
            "key_positions": np.arange(window, dtype=np.int32),  # [P]
        }
        with runner.slot() as index:
            shapes = runner.set_shapes(
                {**{n: v.shape for n, v in feed.items()}, **dict.fromkeys(self._cache_names, cache_shape)},
                slot=index,
            )
            runner.copy_inputs(feed, slot=index, bound=("key_positions",))
            runner.enqueue(slot=index, addresses=self._addresses, graph=True)  # one graph per (profile, B, P)
            new_kv, new_shape, _ = runner.device_tensor("new_kv", slot=index)
            if tuple(new_shape) != (batch, 2 * slots.layers, slots.kv_heads, slots.head_dim):
                raise TrtCosyError(f"llm_decode gave new_kv {tuple(new_shape)} for {batch} rows")
            slots.write_new(new_kv, rows, runner.stream(index))  # the active rows' new positions only
            views = runner.copy_outputs(slot=index, names=("logits",))
            runner.stream(index).synchronize()
            logits = np.array(views["logits"], copy=True).reshape(shapes["logits"])  # [B, 1, V]
        slots.lengths[:rows] += 1
        return logits[:rows, 0]  # [B, V]
