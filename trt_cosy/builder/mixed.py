"""Mixed engines: each graph on the CPU runtime that runs it fastest, recorded per graph in the manifest.

``trt-cosy build --backend mixed --precision int4`` keeps the LLM on ONNX Runtime (its
``MatMulNBits`` + ``GroupQueryAttention`` graph and the batched ``llm_batch.onnx``, as in ONNX Runtime
engines of that precision) and converts every other graph (flow encoder, estimators, HiFT) to
OpenVINO IR, where they compute in bfloat16 (HiFT in float32) on CPUs with bf16 kernels
(``runtime.backends.openvino.runner.graph_precisions``); the bf16 graphs store float16 weights, which the CPU plugin
converts at compile time (the process then holds the bf16 copies and a half-size mapped file, not a
float32 one). ``--precision fp32`` keeps every graph float32 (for ``trt-cosy verify``). Measured at full size: docs/benchmarks.md, "Mixed engines".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Final

from ..runtime import graphs
from ..runtime.backends.openvino.runner import graph_precisions
from ..runtime.engines import ORT_BACKEND, OV_BACKEND
from ..runtime.manifest import GraphRecord
from .onnx.llm_batch import batch_graph_record, write_batched_llm
from .onnx.passes import rewrite_engine_graphs
from .openvino import convert_engine_graphs
from .quantize.engines import quantize_engines

__all__ = ["ORT_GRAPHS", "split_mixed_graphs"]

# The graphs that stay on ONNX Runtime in mixed engines (every family's LLM is named "llm").
ORT_GRAPHS: Final = frozenset({graphs.LLM.name, graphs.LLM_BATCH.name})

Progress = Callable[[str], None]
Feed = Mapping[str, object]


def split_mixed_graphs(
    staging: Path,
    records: Mapping[str, GraphRecord],
    precision: str,
    family: str,
    feeds_for: Callable[[str], Iterable[Feed]],
    progress: Progress | None = None,
) -> dict[str, GraphRecord]:
    """Turn the float32 exports of ``staging`` into mixed engines; return the manifest's graph records.

    Every graph outside ``ORT_GRAPHS`` becomes OpenVINO IR (float16 weights where the graph computes
    in bfloat16, float32 where it computes in float32: HiFT, every graph of fp32 engines); then the LLM gets ONNX
    Runtime's rewrites (proven equal), its ``precision`` weights (``builder.quantize.engines``) and the batched
    decode graph. ``records`` are the exports' records (I/O as exported); each returned record names
    its backend.
    """
    staging = Path(staging)
    ov_names = [name for name in records if name not in ORT_GRAPHS]
    computes = graph_precisions(precision, tuple(ov_names))
    fp16 = {name for name in ov_names if computes[name] == "bf16"}  # bf16 compute: fp16-stored weights
    ir_files = convert_engine_graphs(staging, ov_names, precision, progress=progress, fp16_weights=fp16)
    rewrite_engine_graphs(staging, feeds_for, progress=progress)  # only the LLM's .onnx is left
    if precision != "fp32":
        quantize_engines(staging, precision, family, progress=progress, only=ORT_GRAPHS)
    mixed = {
        name: dataclasses.replace(record, file=ir_files[name], backend=OV_BACKEND)
        if name in ir_files
        else dataclasses.replace(record, backend=ORT_BACKEND)
        for name, record in records.items()
    }
    batch = write_batched_llm(staging)  # continuous batching (stages.llm_batch), v2/v3
    if batch is not None:
        mixed[batch.stem] = dataclasses.replace(batch_graph_record(batch, staging), backend=ORT_BACKEND)
    return mixed
