"""``BatchedLLMStage`` on TensorRT: the shared decode loop of ``stages.llm_batch`` over the
``llm_decode`` plan and device KV slots (``runtime.backends.tensorrt.batch``); prefill runs the ``llm`` plan at
batch 1 in the request's thread, as decoding alone does."""

from __future__ import annotations

import logging
from typing import Any

from ..runtime.backends.base import Runner
from ..runtime.backends.tensorrt.batch import DeviceKVSlots, TrtBatchLLM, cache_dtype, decode_limits
from .llm_batch import BatchedLLMStage

__all__ = ["TrtBatchedLLMStage"]

_LOGGER = logging.getLogger(__name__)


class TrtBatchedLLMStage(BatchedLLMStage):
    """``BatchedLLMStage`` whose batch runs on the ``llm_decode`` TensorRT plan (``batch_runner``).

    The slots and positions are capped by the plan's profiles (batch <= ``ProfileLimits.max_batch``,
    positions <= ``max_context``); the KV slots are one device allocation made here, once.
    """

    def _batch_backend(self, batch_runner: Runner, slots: int, positions: int) -> tuple[Any, Any]:
        layers, kv_heads, head_dim = self._shape
        max_batch, max_window = decode_limits(batch_runner)
        if slots > max_batch or positions > max_window:
            _LOGGER.info(
                "llm_decode plan takes batches <= %d of <= %d positions: %d slots of %d positions asked, using %d of %d",
                max_batch, max_window, slots, positions, min(slots, max_batch), min(positions, max_window),
            )  # fmt: skip
        kv = DeviceKVSlots(
            min(slots, max_batch), layers, kv_heads, min(positions, max_window), head_dim, cache_dtype(batch_runner)
        )
        return TrtBatchLLM(self.runner, batch_runner, layers), kv
