"""The batched decode graph ``llm_batch`` (contract ``graphs.LLM_BATCH``), derived from a finished
ONNX Runtime ``llm.onnx`` whose attention is ``GroupQueryAttention`` (``ort_llm_rewrites``).

Same weights and nodes; only the attention's cache plumbing changes:

* one ``past_key_<i>`` / ``past_value_<i>`` input [B, H, P, Dh] per layer instead of the stacked
  ``past_keys`` [L, 1, H, P, Dh], and each layer's ``present_key_<i>`` / ``present_value_<i>``
  output [B, H, P, Dh] (the same length as the past buffer): the caller binds each present to its
  past buffer, so GroupQueryAttention writes the new positions in place
  (``past_present_share_buffer``) and a step copies no cache;
* ``seqlens_k`` [B] int32 (per row: positions already cached + new positions - 1) and
  ``total_sequence_length`` [] int32 (the largest ``seqlens_k + 1``) are inputs, so every row of a
  batch has its own length: a row attends to its first ``seqlens_k + 1`` positions only, and
  whatever lies beyond them in the padded buffer never reaches its result;
* the rotary tables cover positions ``0 … total_sequence_length - 1``;
* ``hidden`` and the stacked presents are no longer outputs (``logits`` [B, T, V] is).

Prefill runs through the same graph at batch 1 (T new positions, a past buffer of length T,
``seqlens_k = T - 1``, ``total_sequence_length = T``); decode steps at batch B with T = 1.
The graph is derived after quantisation, so it carries whatever precision ``llm.onnx`` has.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Final

import onnx
from onnx import TensorProto, helper

from ...errors import InputError
from ...runtime.graphs import LLM_BATCH
from ...runtime.manifest import MANIFEST_NAME, GraphRecord, Manifest
from ..export import graph_record
from .files import save_onnx
from .graph import MS_DOMAIN, drop_dead_nodes

__all__ = ["derive_batched_llm", "write_batched_llm", "batch_graph_record", "add_batched_llm", "BATCH_FILE"]

_LOGGER = logging.getLogger(__name__)
BATCH_FILE: Final = f"{LLM_BATCH.name}.onnx"
_TOTAL: Final = "ort_llm_rewrites/total"  # [1] int64: P + T in the batch-1 graph (feeds the rotary Range)
_TAG: Final = "ort_llm_batch/"


def _set_dims(value: onnx.ValueInfoProto, dims: tuple[str | int, ...]) -> None:
    shape = value.type.tensor_type.shape
    del shape.dim[:]
    for dim in dims:
        entry = shape.dim.add()
        if isinstance(dim, str):
            entry.dim_param = dim
        else:
            entry.dim_value = dim


def derive_batched_llm(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The batched decode form of a GQA-rewritten ``llm`` graph (in place), or None when it has no
    ``GroupQueryAttention`` (CosyVoice 1's LLM, TensorRT graphs): those decode one request at a time."""
    graph = model.graph
    sites = [n for n in graph.node if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    producers = {out: node for node in graph.node for out in node.output}
    if not sites or _TOTAL not in producers:
        return None
    width = next(i for i in graph.input if i.name == "inputs_embeds").type.tensor_type.shape.dim[2].dim_value
    kv_heads = int(next(a.i for a in sites[0].attribute if a.name == "kv_num_heads"))
    past = next(i for i in graph.input if i.name == "past_keys")  # [L, 1, H, P, Dh]
    head_dim = past.type.tensor_type.shape.dim[4].dim_value
    inputs = [helper.make_tensor_value_info("inputs_embeds", TensorProto.FLOAT, ("B", "T", width))]
    outputs = [next(o for o in graph.output if o.name == "logits")]
    _set_dims(outputs[0], ("B", "T", outputs[0].type.tensor_type.shape.dim[2].dim_value))
    for layer, node in enumerate(sites):
        names = (f"past_key_{layer}", f"past_value_{layer}", f"present_key_{layer}", f"present_value_{layer}")
        for name in names[:2]:
            inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ("B", kv_heads, "P", head_dim)))
        for name in names[2:]:
            outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, ("B", kv_heads, "P", head_dim)))
        node.input[3], node.input[4] = names[0], names[1]
        node.input[5], node.input[6] = "seqlens_k", "total_sequence_length"
        node.output[1], node.output[2] = names[2], names[3]
    inputs.append(helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ("B",)))
    inputs.append(helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, ()))
    # The rotary tables' length now comes from total_sequence_length, not from the past's shape.
    total = producers[_TOTAL]
    position = list(graph.node).index(total)
    graph.node.remove(total)
    shape_1 = helper.make_tensor(_TAG + "shape_1", TensorProto.INT64, (1,), [1])
    graph.initializer.append(shape_1)
    graph.node.insert(position, helper.make_node("Cast", ["total_sequence_length"], [_TAG + "total64"],
                                                 to=TensorProto.INT64, name=_TAG + "cast"))  # fmt: skip
    graph.node.insert(position + 1, helper.make_node("Reshape", [_TAG + "total64", _TAG + "shape_1"], [_TOTAL],
                                                     name=_TAG + "reshape"))  # fmt: skip
    del graph.input[:]
    graph.input.extend(inputs)
    del graph.output[:]
    graph.output.extend(outputs)
    del graph.value_info[:]  # inferred with batch 1 and the stacked cache: stale now
    drop_dead_nodes(graph)
    graph.name = LLM_BATCH.name
    return model


def write_batched_llm(directory: Path) -> Path | None:
    """Write ``<directory>/llm_batch.onnx`` from ``<directory>/llm.onnx``; None (nothing written) when
    the LLM has no GroupQueryAttention."""
    directory = Path(directory)
    if not (directory / "llm.onnx").is_file():
        return None
    model = onnx.load(str(directory / "llm.onnx"))
    derived = derive_batched_llm(model)
    if derived is None:
        return None
    path = directory / BATCH_FILE
    path.unlink(missing_ok=True)  # may be a hard link into the fp32 engines (quantize.derive_engines)
    path = save_onnx(derived, path)
    _LOGGER.info("wrote the batched decode graph %s", path)
    return path


def batch_graph_record(path: Path, root: Path) -> GraphRecord:
    """The manifest record of ``llm_batch.onnx`` (derived from ``llm.onnx``, which passed the torch
    parity check; tests/test_llm_batch.py compares the two graphs row by row)."""
    return graph_record(path, root)


def add_batched_llm(engines_dir: Path) -> Path:
    """Add ``llm_batch.onnx`` to an existing ONNX Runtime engines directory of this version (built
    before the graph was part of every build) and record it in the manifest."""
    engines_dir = Path(engines_dir)
    manifest = Manifest.read(engines_dir)
    manifest.check(engines_dir, backend="onnxruntime")
    path = write_batched_llm(engines_dir)
    if path is None:
        raise InputError(f"{engines_dir}/llm.onnx has no GroupQueryAttention: this model decodes one request at a time.")
    files = {
        item.relative_to(engines_dir).as_posix(): item.stat().st_size
        for item in sorted(engines_dir.rglob("*"))
        if item.is_file() and item.name != MANIFEST_NAME and item.relative_to(engines_dir).parts[0] != "plans"
    }
    graphs = {**manifest.graphs, path.stem: batch_graph_record(path, engines_dir)}
    dataclasses.replace(manifest, graphs=graphs, files=files).write(engines_dir)
    return path
