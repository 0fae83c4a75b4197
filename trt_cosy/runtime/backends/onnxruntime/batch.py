"""The ONNX Runtime runs of the ``LLM_BATCH`` graph over ``runtime.kv_slots.KVSlots``: batch-1 prefill
into a ``PrefillCache`` and batched decode steps (see ``stages.llm_batch`` for the scheduler).

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

from collections.abc import Sequence
from typing import Any

import numpy as np

from ....errors import InputError
from ...graphs import LLM_BATCH
from ...kv_slots import KVSlots, PrefillCache

__all__ = ["OrtBatchLLM"]


class OrtBatchLLM:
    """The ``llm_batch`` ONNX Runtime session: batch-1 prefill into a ``PrefillCache`` (any thread)
    and batched decode steps over ``KVSlots`` (the scheduler's thread)."""

    def __init__(self, runner: Any, layers: int):
        self.runner = runner
        self.layers = layers
        names = set(runner.input_names)
        wanted = {spec.name for spec in LLM_BATCH.inputs} | {f"past_key_{i}" for i in range(layers)}
        if not wanted <= names:
            raise InputError(
                f"graph '{runner.name}' lacks the batched decode inputs {sorted(wanted - names)}"
            )

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
        # the rotary table's length (GroupQueryAttention reads seqlens_k per row)
        total = int(seqlens.max()) + 1
        binding = self._bound(batch)
        binding.bind_cpu_input("inputs_embeds", inputs)
        binding.bind_cpu_input("seqlens_k", seqlens)
        binding.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        self._session.run_with_iobinding(binding)
        slots.lengths[:rows] += 1
        return self._logits[:rows, 0]  # [B, V]
