"""One request's LLM decode on TensorRT with its KV cache kept in device memory (issue 29 item 2).

The ``LLM`` contract (``inputs_embeds`` [1, T, D], ``past_keys`` / ``past_values`` [L, 1, H, P, Dh]
-> ``logits`` [1, T, V], ``present_keys`` / ``present_values`` [L, 1, H, P + T, Dh]) feeds each
step's present cache back as the next step's past. Through ``infer`` that is a download and an
upload of the whole cache per token (about 50 MB each way at 4k positions, full size).
``TrtKVDecoder`` instead owns two pairs of device buffers and binds them by address: step k reads
its past from one pair and writes its present into the other, and step k + 1 swaps them (a graph
must never read and write one buffer in one launch). Per step only the new embeddings go up and
the logits come down, with one synchronize; the buffers grow (grow-only, no copy: the one written
next is an output) to what the request needs, never to the profile maximum.

CosyVoice2/3 on TensorRT decode in batches over ``runtime.backends.tensorrt.batch`` (the ``llm_decode`` plan);
this is the path of CosyVoice-300M and of ``llm_slots=0``. Numpy only; the runner is a
``TrtRunner`` (its hot-path methods), over fakes in tests/test_trt_device_counts.py.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import numpy as np

from ....errors import InputError
from .cuda import DeviceBuffer

__all__ = ["TrtKVDecoder"]

_LOGGER = logging.getLogger(__name__)
_PAST: Final = ("past_keys", "past_values")
_PRESENT: Final = ("present_keys", "present_values")


class TrtKVDecoder:
    """Step-by-step decoding of one request through an ``LLM``-contract ``TrtRunner``.

    Args:
        runner: the ``llm`` plan's runner (any slot is taken per step, so requests share its slots).
        cache_shape: the empty cache's shape [L, 1, H, 0, Dh] (``LLMStage._cache_shape``).
    """

    def __init__(self, runner: Any, cache_shape: tuple[int, ...]):
        names = set(runner.input_names) | set(runner.output_names)
        wanted = {"inputs_embeds", "logits", *_PAST, *_PRESENT}
        if not wanted <= names:
            raise InputError(f"graph '{runner.name}' is not an LLM graph: it lacks {sorted(wanted - names)}")
        self._runner = runner
        self._layers, _, self._heads, _, self._head_dim = (int(d) for d in cache_shape)
        self._dtype = np.dtype(runner.device_tensor("present_keys")[2])
        self.length = 0  # cached positions P
        # pairs[0]: the past of the next step, pairs[1]: where it writes its present
        self._pairs = [[DeviceBuffer(1), DeviceBuffer(1)], [DeviceBuffer(1), DeviceBuffer(1)]]

    def _nbytes(self, positions: int) -> int:
        return self._layers * self._heads * positions * self._head_dim * self._dtype.itemsize

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """``inputs_embeds`` [1, T, D] after the cached positions -> logits [1, T, V] (a fresh array)."""
        runner, new = self._runner, int(inputs_embeds.shape[1])
        past, present = self._pairs
        for buffer in present:  # written whole by this step: grow without keeping the old contents
            buffer.resize(self._nbytes(self.length + new))
        cache = (self._layers, 1, self._heads, self.length, self._head_dim)  # [L, 1, H, P, Dh]
        addresses = {
            **{name: buffer.ptr for name, buffer in zip(_PAST, past, strict=True)},
            **{name: buffer.ptr for name, buffer in zip(_PRESENT, present, strict=True)},
        }
        with runner.slot() as index:
            shapes = runner.set_shapes(
                {"inputs_embeds": inputs_embeds.shape, "past_keys": cache, "past_values": cache}, slot=index
            )
            runner.copy_inputs({"inputs_embeds": inputs_embeds}, slot=index, bound=_PAST)
            runner.enqueue(slot=index, addresses=addresses)
            views = runner.copy_outputs(slot=index, names=("logits",))
            runner.stream(index).synchronize()
            logits = np.array(views["logits"], copy=True).reshape(shapes["logits"])  # [1, T, V]
        self._pairs.reverse()  # this step's present is the next step's past
        self.length += new
        return logits

    def free(self) -> None:
        for pair in self._pairs:
            for buffer in pair:
                buffer.free()
