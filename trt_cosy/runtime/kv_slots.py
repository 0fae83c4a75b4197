"""Preallocated KV cache slots for batched decoding, and the ONNX Runtime runs of the ``LLM_BATCH``
graph over them (``graphs.LLM_BATCH``; see ``stages.llm_batch`` for the scheduler that drives it).

``KVSlots`` holds one key and one value buffer per layer, [slots, H, capacity, Dh] float32,
reserved once (anonymous memory: the pages are committed as rows fill). The active rows of a batch
are always the first ``count`` slots, so a step passes the views ``buffer[:count]`` (contiguous, no
copy); when a row leaves, the last active row moves into its place (one copy of that row's
cached positions) and the row freed at the end gives its pages back to the OS (``madvise``), so the
slots hold only what the active rows use: after a burst of long requests RSS returns.

``OrtBatchLLM`` runs the graph with IOBinding, each layer's present bound to the very buffer of its
past: ONNX Runtime's GroupQueryAttention sees the shared buffer and writes the new positions in
place, so a decode step copies no cache at all.

A step runs the active rows only (batch = ``count``), or, with ``fixed_shapes``
(``EngineConfig.deterministic``), every row of the buffers at every step: ``rows`` = the slots
rounded up to a multiple of ``ROW_GROUP``, the inactive ones fed a zero input at position 0 and their
logits dropped. A step then has the same batch size whatever the load, so no kernel can pick another
row blocking for a row because other requests came or went. Why (measured on an AMX Xeon,
docs/determinism.md): ONNX Runtime's int4 ``MatMulNBits`` (block 128, int8 compute) computes rows in
pairs, and the last row of an odd batch alone with other rounding (up to 2e-6 per matmul), which
sampling turns into another token now and then; whole groups of ``ROW_GROUP`` rows keep every slot
inside a full pair (or group of 4). The attention length stays the longest row's: ONNX Runtime's
GroupQueryAttention reads each row's own ``seqlens_k``, and the rotary table it is given is computed
element by element (measured: every length's table is the prefix of the 8012-position one).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from ..errors import InputError
from .graphs import LLM_BATCH

__all__ = ["KVSlots", "PrefillCache", "OrtBatchLLM", "ROW_GROUP"]

_LOGGER = logging.getLogger(__name__)
ROW_GROUP: Final = 4  # fixed-shape steps run a multiple of this many rows (kernels block rows in 1, 2 or 4)


class PrefillCache:
    """One request's cache after its batch-1 prefill: per layer keys/values [1, H, T, Dh]."""

    def __init__(self, layers: int, kv_heads: int, length: int, head_dim: int):
        shape = (1, kv_heads, length, head_dim)
        self.keys = [np.zeros(shape, np.float32) for _ in range(layers)]  # each [1, H, T, Dh]
        self.values = [np.zeros(shape, np.float32) for _ in range(layers)]
        self.length = length


class KVSlots:
    """``slots`` rows of ``capacity`` cached positions each, for ``layers`` layers (not thread-safe:
    one owner, the decode scheduler, changes it). The buffers hold ``rows`` rows (``slots`` rounded up
    to ``ROW_GROUP``); the rows past ``slots`` are never filled (fixed-shape steps run them empty)."""

    def __init__(self, slots: int, layers: int, kv_heads: int, capacity: int, head_dim: int):
        if slots < 1 or capacity < 1:
            raise InputError(f"KV slots need slots >= 1 and capacity >= 1, got {slots} and {capacity}.")
        self.slots, self.capacity = slots, capacity
        self.rows = -(-slots // ROW_GROUP) * ROW_GROUP  # rows of the buffers (>= slots; a fixed-shape step's batch)
        shape = (self.rows, kv_heads, capacity, head_dim)
        self._maps: list[mmap.mmap] = []  # the anonymous mappings under the buffers (when madvise exists)
        self.keys = [self._zeros(shape) for _ in range(layers)]  # each [R, H, C, Dh], R = rows
        self.values = [self._zeros(shape) for _ in range(layers)]
        self.lengths = np.zeros(slots, np.int32)  # cached positions per row (0: inactive)
        self.count = 0  # active rows: 0 .. count-1

    def _zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        """A zeroed float32 buffer whose pages can be given back (an anonymous mapping), or np.zeros
        where ``madvise`` is missing."""
        nbytes = int(np.prod(shape)) * 4
        if not hasattr(mmap, "MADV_DONTNEED"):
            return np.zeros(shape, np.float32)
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # MADV_DONTNEED frees it
        self._maps.append(mapping)
        return np.frombuffer(mapping, np.float32).reshape(shape)

    def release(self, row: int) -> None:
        """Give the pages of an inactive ``row`` back to the OS (they read as zeros afterwards)."""
        if not self._maps:
            return
        row_bytes = self.keys[0][0].nbytes
        start = -(-row * row_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the row only
        end = (row + 1) * row_bytes // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            for mapping in self._maps:
                mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    @property
    def nbytes(self) -> int:
        """Bytes reserved for the buffers (virtual: pages are committed as they are written)."""
        return sum(buffer.nbytes for buffer in (*self.keys, *self.values))

    def add(self, cache: PrefillCache) -> int:
        """Copy a prefilled cache into the next free row; returns the row."""
        if self.count >= self.slots:
            raise InputError(f"all {self.slots} KV slots are in use")
        if cache.length > self.capacity:
            raise InputError(f"a cache of {cache.length} positions exceeds the slot capacity {self.capacity}")
        row, length = self.count, cache.length
        for buffers, parts in ((self.keys, cache.keys), (self.values, cache.values)):
            for buffer, part in zip(buffers, parts, strict=True):
                buffer[row, :, :length] = part[0]  # [H, T, Dh]
        self.lengths[row] = length
        self.count += 1
        return row

    def export(self, row: int) -> PrefillCache:
        """A copy of ``row``'s cached positions (a row that leaves the batch for a while and comes back
        with ``add``: a streamed request waiting for text)."""
        length = int(self.lengths[row])
        layers, (_, kv_heads, _, head_dim) = len(self.keys), self.keys[0].shape
        cache = PrefillCache(layers, kv_heads, length, head_dim)
        for buffers, parts in ((self.keys, cache.keys), (self.values, cache.values)):
            for buffer, part in zip(buffers, parts, strict=True):
                part[0] = buffer[row, :, :length]  # [H, T, Dh]
        return cache

    def remove(self, row: int) -> int | None:
        """Free ``row``; the last active row moves into it. Returns the row that moved there (its old
        index was ``count`` after this call), or None when ``row`` was the last one."""
        last = self.count - 1
        self.count = last
        if row == last:
            self.lengths[last] = 0
            self.release(last)
            return None
        length = int(self.lengths[last])
        for buffer in (*self.keys, *self.values):
            buffer[row, :, :length] = buffer[last, :, :length]  # [H, P, Dh]
        self.lengths[row] = length
        self.lengths[last] = 0
        self.release(last)
        return last


class OrtBatchLLM:
    """The ``llm_batch`` ONNX Runtime session: batch-1 prefill into a ``PrefillCache`` (any thread)
    and batched decode steps over ``KVSlots`` (the scheduler's thread)."""

    def __init__(self, runner: Any, layers: int):
        self.runner = runner
        self.layers = layers
        names = set(runner.input_names)
        wanted = {spec.name for spec in LLM_BATCH.inputs} | {f"past_key_{i}" for i in range(layers)}
        if not wanted <= names:
            raise InputError(f"graph '{runner.name}' lacks the batched decode inputs {sorted(wanted - names)}")

    def _bind_cache(self, binding: Any, keys: Sequence[np.ndarray], values: Sequence[np.ndarray]) -> None:
        for layer in range(self.layers):
            for kind, buffer in (("key", keys[layer]), ("value", values[layer])):
                shape, pointer = buffer.shape, buffer.ctypes.data
                binding.bind_input(f"past_{kind}_{layer}", "cpu", 0, np.float32, shape, pointer)
                binding.bind_output(f"present_{kind}_{layer}", "cpu", 0, np.float32, shape, pointer)

    def prefill(self, inputs_embeds: np.ndarray, cache: PrefillCache) -> np.ndarray:
        """Run ``inputs_embeds`` [1, T, D] from position 0, filling ``cache`` (length T); returns the
        logits of the last position [V]."""
        inputs = np.ascontiguousarray(inputs_embeds, dtype=np.float32)  # [1, T, D]
        length = inputs.shape[1]
        session = self.runner.session
        binding = session.io_binding()
        binding.bind_cpu_input("inputs_embeds", inputs)
        binding.bind_cpu_input("seqlens_k", np.array([length - 1], np.int32))
        binding.bind_cpu_input("total_sequence_length", np.array(length, np.int32))
        binding.bind_output("logits", "cpu")  # first: get_outputs() follows the binding order
        self._bind_cache(binding, cache.keys, cache.values)
        session.run_with_iobinding(binding)
        logits = binding.get_outputs()[0].numpy()  # [1, T, V]
        return logits[0, -1]

    def decoder(self, slots: KVSlots, vocab: int, fixed_shapes: bool = False) -> _SlotStepper:
        """A stepper over ``slots`` with its own IOBinding and logits buffer (one thread uses it);
        ``fixed_shapes``: every step over all slots (``_SlotStepper.fixed_shapes``)."""
        return _SlotStepper(self, slots, vocab, fixed_shapes)


class _SlotStepper:
    def __init__(self, model: OrtBatchLLM, slots: KVSlots, vocab: int, fixed_shapes: bool = False):
        self._model, self._slots = model, slots
        self._session = model.runner.session
        self._logits = np.zeros((slots.rows, 1, vocab), np.float32)  # [R, 1, V]
        self._inputs: np.ndarray | None = None  # fixed shapes: [R, 1, D], the inactive rows zero
        self._binding: Any = None  # reused while the batch size stays the same
        self._rows = -1  # the batch size ``_binding`` was made for
        self.fixed_shapes = fixed_shapes
        """Every step over all ``slots.rows`` rows (batch-invariant logits); False: the active rows only
        (faster with fewer requests than slots)."""

    def _bound(self, rows: int) -> Any:
        """The IOBinding of a step over the first ``rows`` slots (cache views and logits buffer)."""
        if rows != self._rows:  # the cache views and the logits buffer depend only on the batch size
            slots, logits = self._slots, self._logits[:rows]  # [B, 1, V]
            binding = self._session.io_binding()
            self._model._bind_cache(binding, [k[:rows] for k in slots.keys], [v[:rows] for v in slots.values])
            binding.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
            self._binding, self._rows = binding, rows
        return self._binding

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """One new position for each of the ``count`` active rows: ``inputs_embeds`` [B, 1, D] ->
        logits [B, V] (a view valid until the next step). Each row's length grows by one."""
        slots = self._slots
        rows = slots.count
        if inputs_embeds.shape[0] != rows:
            raise InputError(f"{inputs_embeds.shape[0]} inputs for {rows} active rows")
        if rows == 0:
            return self._logits[:0, 0]
        if int(slots.lengths[:rows].max()) >= slots.capacity:
            raise InputError("a row reached the KV slot capacity")
        if self.fixed_shapes:
            batch = slots.rows
            if self._inputs is None or self._inputs.shape[2] != inputs_embeds.shape[2]:
                self._inputs = np.zeros((batch, 1, inputs_embeds.shape[2]), np.float32)  # [R, 1, D]
            inputs = self._inputs
            inputs[:rows] = inputs_embeds
            inputs[rows:] = 0.0
            seqlens = np.zeros(batch, np.int32)  # [R]: the inactive rows' lengths are 0
            seqlens[:rows] = slots.lengths[:rows]
        else:
            batch = rows
            inputs = np.ascontiguousarray(inputs_embeds, dtype=np.float32)  # [B, 1, D]
            seqlens = slots.lengths[:rows].astype(np.int32)  # cached + 1 new - 1: [B]
        total = int(seqlens.max()) + 1  # the rotary table's length (GroupQueryAttention reads seqlens_k per row)
        binding = self._bound(batch)
        binding.bind_cpu_input("inputs_embeds", inputs)
        binding.bind_cpu_input("seqlens_k", seqlens)
        binding.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        self._session.run_with_iobinding(binding)
        slots.lengths[:rows] += 1
        return self._logits[:rows, 0]  # [B, V]
