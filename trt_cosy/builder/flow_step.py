"""Graph surgery: the CFM estimator graph -> one guided Euler step ("flow step"), no torch re-export.

The host loop (``stages.flow.solve_euler``) runs the estimator on the CFG pair, combines the two
velocities and updates x in numpy, so on TensorRT every step is a device -> host -> device round
trip. The step graph moves the per-step host work into the graph:

    v      = estimator(concat(x, x), mask, mu, expand(t, 2), spks, cond)   # [2, 80, F]
    x_next = x + dt * ((1 + cfg) * v[0] - cfg * v[1])                      # [1, 80, F]

so ``runtime.backends.tensorrt.euler.DeviceEulerLoop`` can chain the n steps on one stream. The added nodes compute
in float32 in the order ``solve_euler`` does (``guided * v0 - unguided * v1``, then ``x + dt * v``),
so both loops agree to float32 rounding. The estimator may be the fp32 export or the fp16 graph of
``builder.quantize.precision`` (its I/O stays float32 by default; fp16 I/O gets Casts at the border). Its
names get the ``estimator/`` prefix so they cannot clash with the wrapper's; the opset is kept.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Final

import numpy as np
import onnx
import onnx.compose
from onnx import TensorProto, helper, numpy_helper

from ..errors import TrtCosyError
from ..runtime.graphs import FLOW_ESTIMATOR, FLOW_STEP
from .onnx.files import save_onnx

__all__ = ["ESTIMATOR_PREFIX", "wrap_estimator_step", "write_flow_step"]

_LOGGER = logging.getLogger(__name__)

ESTIMATOR_PREFIX: Final = "estimator/"
_STEP: Final = "flow_step/"  # prefix of the wrapper's own nodes and tensors


def wrap_estimator_step(model: onnx.ModelProto, cfg_rate: float) -> onnx.ModelProto:
    """Turn an estimator graph (``FLOW_ESTIMATOR`` contract) into a ``FLOW_STEP`` graph.

    Args:
        model: the estimator, fp32 export or fp16 graph (not modified).
        cfg_rate: the classifier-free guidance rate (``cfm.inference_cfg_rate``, 0.7).

    Returns:
        A new model: inputs x [1, 80, F], mask [2, 1, F], mu [2, 80, F], t [1], dt [1],
        spks [2, 80], cond [2, 80, F]; output x_next [1, 80, F]; all float32. Checked by
        ``onnx.checker`` (weights kept in external files are not read).
    """
    _check_estimator(model)
    inner = onnx.compose.add_prefix(model, ESTIMATOR_PREFIX)  # a copy: nodes, edges, I/O, functions
    io = {v.name.removeprefix(ESTIMATOR_PREFIX): v for v in (*inner.graph.input, *inner.graph.output)}
    nodes, constants = _wrapper_nodes(io, cfg_rate)
    graph = helper.make_graph(
        [*nodes[0], *inner.graph.node, *nodes[1]],
        "flow_step",
        _step_inputs(io),
        [_float_info("x_next", io["x"], batch=1)],
        [*constants, *inner.graph.initializer],
        # the estimator's former I/O become inner tensors: keep their types and shapes
        value_info=[*inner.graph.value_info, *inner.graph.input, *inner.graph.output],
    )
    wrapped = helper.make_model(
        graph,
        opset_imports=list(model.opset_import),
        functions=list(inner.functions),
        ir_version=model.ir_version,
        producer_name="trt-cosy flow_step",
    )
    onnx.checker.check_model(wrapped)
    return wrapped


def write_flow_step(estimator_path: Path, out_path: Path, cfg_rate: float) -> Path:
    """Wrap the estimator graph at ``estimator_path`` and save the step graph at ``out_path``.

    Weights over 1 GiB go to ``<out_path>.data``. The saved file passes ``onnx.checker``.
    """
    estimator_path, out_path = Path(estimator_path), Path(out_path)
    model = onnx.load(str(estimator_path))  # external weights are read from the graph's directory
    wrapped = wrap_estimator_step(model, cfg_rate)
    save_onnx(wrapped, out_path, check=True)
    _LOGGER.info("flow step graph %s from %s (cfg rate %g)", out_path, estimator_path, cfg_rate)
    return out_path


def _check_estimator(model: onnx.ModelProto) -> None:
    inputs = tuple(v.name for v in model.graph.input)
    outputs = tuple(v.name for v in model.graph.output)
    if set(inputs) != set(FLOW_ESTIMATOR.input_names) or outputs != FLOW_ESTIMATOR.output_names:
        raise TrtCosyError(
            f"not an estimator graph: inputs {inputs}, outputs {outputs}; the flow step wraps the "
            f"'{FLOW_ESTIMATOR.name}' contract {FLOW_ESTIMATOR.input_names} -> {FLOW_ESTIMATOR.output_names}. "
            "Pass flow_estimator(.fp16).onnx or flow_estimator_stream(.fp16).onnx."
        )


def _wrapper_nodes(
    io: dict[str, onnx.ValueInfoProto], cfg_rate: float
) -> tuple[tuple[list[onnx.NodeProto], list[onnx.NodeProto]], list[onnx.TensorProto]]:
    """(nodes before the estimator, nodes after it) and the wrapper's constants."""
    guided, unguided = np.float32(1.0 + cfg_rate), np.float32(cfg_rate)  # as solve_euler rounds them
    constants = [
        numpy_helper.from_array(np.array([2], np.int64), _STEP + "pair_shape"),
        numpy_helper.from_array(np.array([1, 1], np.int64), _STEP + "pair_split"),
        numpy_helper.from_array(np.array(guided, np.float32), _STEP + "guided"),
        numpy_helper.from_array(np.array(unguided, np.float32), _STEP + "unguided"),
    ]
    node = helper.make_node
    before = [
        node("Concat", ["x", "x"], [_STEP + "x_pair"], name=_STEP + "x_pair", axis=0),  # [2, 80, F]
        node("Expand", ["t", _STEP + "pair_shape"], [_STEP + "t_pair"], name=_STEP + "t_pair"),  # [2]
    ]
    sources = {"x": _STEP + "x_pair", "t": _STEP + "t_pair"}
    for name in FLOW_ESTIMATOR.input_names:
        before.append(_convert(sources.get(name, name), ESTIMATOR_PREFIX + name, _elem_type(io[name])))
    out = FLOW_ESTIMATOR.output_names[0]
    velocity = _STEP + "velocity"  # [2, 80, F] float32
    after = [
        _convert(ESTIMATOR_PREFIX + out, velocity, TensorProto.FLOAT, _elem_type(io[out])),
        node(
            "Split",
            [velocity, _STEP + "pair_split"],
            [_STEP + "v_cond", _STEP + "v_uncond"],
            name=_STEP + "split",
            axis=0,
        ),  # 2 x [1, 80, F]
        node("Mul", [_STEP + "guided", _STEP + "v_cond"], [_STEP + "v_guided"], name=_STEP + "mul_guided"),
        node(
            "Mul",
            [_STEP + "unguided", _STEP + "v_uncond"],
            [_STEP + "v_unguided"],
            name=_STEP + "mul_unguided",
        ),
        node(
            "Sub", [_STEP + "v_guided", _STEP + "v_unguided"], [_STEP + "v"], name=_STEP + "combine"
        ),  # [1, 80, F]
        node("Mul", ["dt", _STEP + "v"], [_STEP + "dx"], name=_STEP + "mul_dt"),  # [1, 80, F]
        node("Add", ["x", _STEP + "dx"], ["x_next"], name=_STEP + "update"),  # [1, 80, F]
    ]
    return (before, after), constants


def _convert(source: str, target: str, to: int, source_type: int = TensorProto.FLOAT) -> onnx.NodeProto:
    """``target`` = ``source`` as dtype ``to`` (Identity when the types agree)."""
    if to == source_type:
        return helper.make_node("Identity", [source], [target], name=_STEP + "feed_" + target)
    return helper.make_node("Cast", [source], [target], name=_STEP + "cast_" + target, to=to)


def _elem_type(value: onnx.ValueInfoProto) -> int:
    return value.type.tensor_type.elem_type


def _float_info(name: str, like: onnx.ValueInfoProto, batch: int | None = None) -> onnx.ValueInfoProto:
    """A float32 value info with ``like``'s dims (symbolic names kept), dim 0 set to ``batch``."""
    dims: list[int | str | None] = []
    for dim in like.type.tensor_type.shape.dim:
        dims.append(dim.dim_param or (dim.dim_value if dim.HasField("dim_value") else None))
    if batch is not None:
        dims[0] = batch
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)


def _step_inputs(io: dict[str, onnx.ValueInfoProto]) -> list[onnx.ValueInfoProto]:
    """The ``FLOW_STEP`` inputs, in contract order, with the estimator's dims."""
    special = {
        "x": _float_info("x", io["x"], batch=1),  # [1, 80, F]
        "t": helper.make_tensor_value_info("t", TensorProto.FLOAT, [1]),
        "dt": helper.make_tensor_value_info("dt", TensorProto.FLOAT, [1]),
    }
    return [special.get(name) or _float_info(name, io[name]) for name in FLOW_STEP.input_names]
