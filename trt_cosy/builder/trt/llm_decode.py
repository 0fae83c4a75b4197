"""Export of ``llm_decode`` (contract ``runtime.llm_decode``), the batched decode step for TensorRT,
from the reference model's ``llm`` graph module (same weights), into a TensorRT engines directory.

Checked like every export (``export_graph``: ONNX Runtime against torch on the sample and parity
feeds); tests/test_trt_llm_decode.py compares it with the batch-1 ``llm`` graph row by row.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
from torch.export import Dim

from ...config import ModelConfig
from ...runtime.llm_decode import LLM_DECODE_NAME, cache_input_names, llm_decode_spec
from ..export import ExportResult, GraphPlan, Progress, export_graph
from ..modules.llm_decode import decode_graph

__all__ = ["llm_decode_plan", "export_llm_decode"]

_LOGGER = logging.getLogger(__name__)


def llm_decode_plan(config: ModelConfig, seed: int = 0) -> GraphPlan:
    """Sample and parity feeds (mixed row lengths, NaN beyond each row's length) and dynamic dims."""
    qwen = config.llm.qwen
    rng = np.random.default_rng(seed)
    names = cache_input_names(qwen.num_layers)

    def feed(lengths: list[int], window: int, capacity: int) -> dict[str, np.ndarray]:
        rows = len(lengths)
        out: dict[str, Any] = {
            "inputs_embeds": rng.standard_normal((rows, 1, qwen.hidden_size), dtype=np.float32),  # [B, 1, D]
            "past_lengths": np.asarray(lengths, np.int32),  # [B]
            "key_positions": np.arange(window, dtype=np.int32),  # [P]
        }
        for name in names:
            cache = rng.standard_normal((rows, qwen.num_kv_heads, capacity, qwen.head_dim), dtype=np.float32)
            for row, length in enumerate(lengths):
                cache[row, :, length:] = np.nan  # [H, C - length, Dh]: must never reach a result
            out[name] = cache  # [B, H, C, Dh]
        return out

    rows, window, capacity = Dim("B", min=1), Dim("P", min=1), Dim("C", min=1)
    dynamic: dict[str, dict[int, Any]] = {
        "inputs_embeds": {0: rows},
        "past_lengths": {0: rows},
        "key_positions": {0: window},
    }
    dynamic.update({name: {0: rows, 2: capacity} for name in names})
    sample = feed([5, 9, 3], 10, 13)
    parity = (feed([1], 1, 4), feed([0, 7], 8, 8), feed([12, 2, 6, 4], 12, 16))
    return GraphPlan(sample, parity, dynamic)


def export_llm_decode(
    llm_module: Any, config: ModelConfig, out_dir: Path, progress: Progress | None = None
) -> ExportResult:
    """Export ``<out_dir>/llm_decode.onnx`` from the ``llm`` graph module (``LLMGraph``)."""
    plan = llm_decode_plan(config)
    return export_graph(
        llm_decode_spec(config.llm.qwen.num_layers),
        decode_graph(llm_module),
        plan.sample,
        Path(out_dir) / f"{LLM_DECODE_NAME}.onnx",
        plan.dynamic_shapes,
        parity_inputs=plan.parity,
        progress=progress,
    )
