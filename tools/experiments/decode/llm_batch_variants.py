"""Derive variants of an int4 ``llm_batch.onnx`` (or ``llm.onnx``) for ``tools/experiments/decode/llm_step_variants.py``.

    python tools/experiments/decode/llm_batch_variants.py --int4 INT4_ENGINES --fp32 FP32_ENGINES --out DIR \
        NAME=SPEC [NAME=SPEC ...] [--graph llm_batch|llm]

Writes ``DIR/NAME.onnx`` per variant (one file, no external data). SPEC is a comma list of:

* ``acc=N``: every MatMulNBits' ``accuracy_level`` (1 fp32, 3 bf16, 4 int8 activations);
* ``block=N`` / ``bits=4|8``: requantise every MatMulNBits weight from the fp32 engines' graph
  (symmetric, blocks of N along K, as ``trt-cosy build``'s quantiser does: int4 LLMs use block
  128, block 32 where the manifest records no ``nbits_blocks``);
* ``int8dyn``: every MatMulNBits becomes ``DynamicQuantizeMatMul`` with per-column symmetric int8
  weights from fp32 (int8 activations quantised per call, MLAS QGEMM);
* ``lmfp32``: the LM head (the last MatMulNBits) becomes an fp32 ``MatMul``;
* ``gateup``: each MLP's gate and up MatMulNBits (same input) become one with N = 2 x 4864 and a
  ``Split``; ``bias``: the QKV bias ``Add`` moves into MatMulNBits' ``bias`` input.

The fp32 weights are read from the fp32 graph's external data file by offset (memory-mapped), so a
variant costs well under 1 GB of memory. Variants are measurement material, not engines: the
manifest knows nothing of them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

MS_DOMAIN = "com.microsoft"


class _Graph:
    def __init__(self, int4: Path, fp32: Path, graph: str):
        self.model = onnx.load(str(int4 / f"{graph}.onnx"))
        self.graph = self.model.graph
        self.inits = {init.name: init for init in self.graph.initializer}
        self._fp32 = {
            i.name: i
            for i in onnx.load(str(fp32 / f"{graph}.onnx"), load_external_data=False).graph.initializer
        }
        self._fp32_dir = fp32

    def fp32_weight(self, quantized_name: str) -> np.ndarray:
        """The fp32 weight [K, N] a MatMulNBits weight (``<name>_Q4``) was quantised from."""
        init = self._fp32[quantized_name.removesuffix("_Q4")]
        ext = {entry.key: entry.value for entry in init.external_data}
        data = np.memmap(self._fp32_dir / ext["location"], dtype=np.uint8, mode="r")
        offset, length = int(ext["offset"]), int(ext["length"])
        return np.frombuffer(data[offset : offset + length].tobytes(), np.float32).reshape(list(init.dims))

    def replace(self, name: str, array: np.ndarray) -> None:
        old = self.inits.pop(name, None)
        if old is not None:
            self.graph.initializer.remove(old)
        tensor = numpy_helper.from_array(array, name)
        self.graph.initializer.append(tensor)
        self.inits[name] = tensor

    def drop(self, name: str) -> None:
        self.graph.initializer.remove(self.inits.pop(name))


def _attr(node: onnx.NodeProto, name: str):
    return next(helper.get_attribute_value(a) for a in node.attribute if a.name == name)


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    for attribute in [a for a in node.attribute if a.name == name]:
        node.attribute.remove(attribute)
    node.attribute.append(helper.make_attribute(name, value))


def quantize_blocks(weight: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric block quantisation of ``weight`` [K, N]: packed [N, K/block, block*bits/8] uint8 and
    scales [N, K/block] (K padded with zeros to whole blocks), MatMulNBits' layout."""
    k, n = weight.shape
    blocks = -(-k // block)
    if blocks * block != k:
        weight = np.pad(weight, ((0, blocks * block - k), (0, 0)))
    weight = np.ascontiguousarray(weight, np.float32)
    per_byte = 8 // bits
    packed = np.zeros((n, blocks, block // per_byte), np.uint8)
    zero_points = np.zeros((n, -(-blocks // per_byte)), np.uint8)  # unused: symmetric
    scales = np.zeros((n, blocks), np.float32)
    quantize = quantize_matmul_8bits if bits == 8 else quantize_matmul_4bits
    quantize(packed, weight, scales, zero_points, block, n, k, True)
    return packed, scales


def _requantize(model: _Graph, nodes: list[onnx.NodeProto], bits: int, block: int) -> None:
    for node in nodes:
        packed, scales = quantize_blocks(model.fp32_weight(node.input[1]), bits, block)
        model.replace(node.input[1], packed)
        model.replace(node.input[2], scales)
        _set_attr(node, "bits", bits)
        _set_attr(node, "block_size", block)


def _to_dynamic_int8(model: _Graph, node: onnx.NodeProto) -> onnx.NodeProto:
    weight = model.fp32_weight(node.input[1])  # [K, N]
    scale = np.maximum(np.abs(weight).max(axis=0), 1e-12) / 127.0  # [N]
    name = node.input[1]
    model.replace(name + "_i8", np.clip(np.round(weight / scale), -127, 127).astype(np.int8))
    model.replace(name + "_i8_scale", scale.astype(np.float32))
    model.replace(name + "_i8_zero", np.zeros(scale.shape, np.int8))
    for old in node.input[1:3]:
        model.drop(old)
    inputs = [node.input[0], name + "_i8", name + "_i8_scale", name + "_i8_zero"]
    return helper.make_node(
        "DynamicQuantizeMatMul", inputs, list(node.output), name=node.name + "_i8", domain=MS_DOMAIN
    )


def _to_fp32(model: _Graph, node: onnx.NodeProto) -> onnx.NodeProto:
    name = node.input[1]
    model.replace(name + "_f32", model.fp32_weight(name))
    for old in node.input[1:3]:
        model.drop(old)
    return helper.make_node(
        "MatMul", [node.input[0], name + "_f32"], list(node.output), name=node.name + "_f32"
    )


def _fuse_gate_up(model: _Graph) -> int:
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    count = 0
    for sigmoid in [n for n in graph.node if n.op_type == "Sigmoid"]:  # SiLU(gate) * up
        gate = producers[sigmoid.input[0]]
        silu = next(c for c in consumers[gate.output[0]] if c.op_type == "Mul")
        product = next(c for c in consumers[silu.output[0]] if c.op_type == "Mul")
        up = producers[next(i for i in product.input if i != silu.output[0])]
        if gate.op_type != "MatMulNBits" or up.op_type != "MatMulNBits" or gate.input[0] != up.input[0]:
            continue
        width = _attr(gate, "N")
        weights = [numpy_helper.to_array(model.inits[n.input[1]]) for n in (gate, up)]  # [N, blocks, bytes]
        scales = [numpy_helper.to_array(model.inits[n.input[2]]) for n in (gate, up)]  # [N, blocks]
        for name in (*gate.input[1:3], *up.input[1:3]):
            model.drop(name)
        model.replace(gate.input[1] + "_gate_up", np.concatenate(weights))
        model.replace(gate.input[2] + "_gate_up", np.concatenate(scales))
        model.replace(gate.output[0] + "_split", np.array([width, width], np.int64))
        fused = helper.make_node(
            "MatMulNBits",
            [gate.input[0], gate.input[1] + "_gate_up", gate.input[2] + "_gate_up"],
            [gate.output[0] + "_gate_up"],
            name=gate.name + "_gate_up",
            domain=MS_DOMAIN,
        )
        fused.attribute.extend(gate.attribute)
        _set_attr(fused, "N", 2 * width)
        split = helper.make_node(
            "Split", [fused.output[0], gate.output[0] + "_split"], [gate.output[0], up.output[0]], axis=-1,
            name=gate.name + "_split",
        )  # fmt: skip
        position = list(graph.node).index(gate)
        graph.node.insert(position, split)
        graph.node.insert(position, fused)
        graph.node.remove(gate)
        graph.node.remove(up)
        count += 1
    return count


def _fold_bias(model: _Graph) -> int:
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    count = 0
    for add in [n for n in graph.node if n.op_type == "Add" and n.name.endswith("/bias")]:
        matmul = producers.get(add.input[0])
        if matmul is None or matmul.op_type != "MatMulNBits":
            continue
        inputs = [
            *matmul.input,
            *[""] * (5 - len(matmul.input)),
            add.input[1],
        ]  # A, B, scales, zp, g_idx, bias
        del matmul.input[:]
        matmul.input.extend(inputs)
        matmul.output[0] = add.output[0]
        graph.node.remove(add)
        count += 1
    return count


def derive(int4: Path, fp32: Path, graph: str, spec: str) -> onnx.ModelProto:
    options = dict((part.split("=") + ["1"])[:2] for part in spec.split(",") if part)
    model = _Graph(int4, fp32, graph)
    nodes = [n for n in model.graph.node if n.op_type == "MatMulNBits"]
    if "block" in options or "bits" in options:
        _requantize(model, nodes, int(options.get("bits", 4)), int(options.get("block", 32)))
    if "acc" in options:
        for node in nodes:
            _set_attr(node, "accuracy_level", int(options["acc"]))
    replaced = []
    if "int8dyn" in options:
        replaced = [(node, _to_dynamic_int8(model, node)) for node in nodes]
    elif "lmfp32" in options:
        replaced = [(nodes[-1], _to_fp32(model, nodes[-1]))]
    for old, new in replaced:
        model.graph.node.insert(list(model.graph.node).index(old), new)
        model.graph.node.remove(old)
    if "gateup" in options:
        _fuse_gate_up(model)
    if "bias" in options:
        _fold_bias(model)
    return model.model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--int4", type=Path, required=True, help="int4 engines directory")
    parser.add_argument("--fp32", type=Path, required=True, help="fp32 engines of the same checkpoint")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--graph", default="llm_batch", choices=("llm_batch", "llm"))
    parser.add_argument("variants", nargs="+", help="NAME=SPEC")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for item in args.variants:
        name, _, spec = item.partition("=")
        path = args.out / f"{name}.onnx"
        onnx.save(derive(args.int4, args.fp32, args.graph, spec), str(path))
        print(f"wrote {path} ({spec or 'unchanged'})", flush=True)


if __name__ == "__main__":
    main()
