"""What a TensorRT plan's I/O and profiles look like to the runner, checked at load (``PlanIO``),
apart from the runner's hot path (``runtime/backends/tensorrt/runner.py``): the engine's I/O tensors (``engine_io``),
the profile check against ``profiles.json`` (``check_profiles``), the buffer sizes at the profile
maxima from a ``USER_MANAGED`` probe context (``max_bytes``) and the casting of a feed to the
engine's dtypes (``prepare``). Works over any engine-like object (the CPU tests use fakes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ....errors import EngineMismatchError, InputError, TrtCosyError
from ...profiles import GraphProfiles
from .cuda import Stream

__all__ = ["TensorInfo", "PlanIO", "engine_io", "nbytes", "dims"]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorInfo:
    """One engine I/O tensor: name, direction and numpy dtype."""

    name: str
    is_input: bool
    dtype: np.dtype


def engine_io(engine: Any, trt: Any, graph: str) -> list[TensorInfo]:
    infos = []
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        if engine.is_shape_inference_io(name):
            # Shape tensors are read from host memory (IExecutionContext::setTensorAddress, kHOST);
            # every tensor here is bound in device memory.
            raise TrtCosyError(
                f"TensorRT plan of '{graph}' has the shape tensor '{name}' (its values decide other tensors' "
                "shapes, so TensorRT wants it in host memory); trt-cosy binds all I/O in device memory. "
                f"Export the graph so that '{name}' is an ordinary data tensor, then rebuild the engines."
            )
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        infos.append(TensorInfo(name, is_input, np.dtype(trt.nptype(engine.get_tensor_dtype(name)))))
    return infos


def nbytes(shape: Sequence[int], dtype: np.dtype) -> int:
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * dtype.itemsize


def dims(value: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in value)


class PlanIO:
    """One plan's I/O tensors and profiles (``name``: the graph), checked against ``profiles.json``."""

    def __init__(self, engine: Any, name: str, profiles: GraphProfiles, trt: Any):
        self.engine, self.name, self.profiles, self._trt = engine, name, profiles, trt
        self._io = {info.name: info for info in engine_io(engine, trt, name)}

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(n for n, info in self._io.items() if info.is_input)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(n for n, info in self._io.items() if not info.is_input)

    def dtype(self, name: str) -> np.dtype:
        return self._io[name].dtype

    def check_profiles(self, slots: int) -> None:
        """The plan must hold profiles.json's profiles once per slot (slot k: k·P … k·P + P − 1)."""
        rebuild = "Rebuild the plans: run `python -m trt_cosy.builder.trt.plans ENGINES_DIR --force`."
        if set(self.input_names) != set(self.profiles.input_names):
            raise EngineMismatchError(
                f"TensorRT plan of '{self.name}' has inputs {sorted(self.input_names)}, the "
                f"profiles name {sorted(self.profiles.input_names)}. {rebuild}"
            )
        total, per_slot = int(self.engine.num_optimization_profiles), len(self.profiles.profiles)
        if total < per_slot or total % per_slot:
            raise EngineMismatchError(
                f"TensorRT plan of '{self.name}' has {total} profiles; profiles.json lists {per_slot} (a plan "
                f"holds them once per slot). {rebuild}"
            )
        if slots > total // per_slot:
            raise EngineMismatchError(
                f"TensorRT plan of '{self.name}' was built for {total // per_slot} concurrent slot(s); {slots} "
                "were asked for (contexts in concurrent use need separate profiles). Use fewer slots or "
                f"rebuild: `python -m trt_cosy.builder.trt.plans ENGINES_DIR --slots {slots}`."
            )
        for index in range(total):
            profile = self.profiles.profiles[index % per_slot]
            for name, expected in profile.shapes.items():
                found = tuple(dims(d) for d in self.engine.get_tensor_profile_shape(name, index))
                if found != tuple(expected):
                    raise EngineMismatchError(
                        f"TensorRT plan of '{self.name}': profile {index} gives '{name}' min/opt/max {found}, "
                        f"profiles.json's '{profile.name}' says {tuple(expected)}. {rebuild}"
                    )

    def max_bytes(self) -> dict[str, int]:
        """Bytes per tensor at the profile maxima (outputs: shapes TensorRT reports for max inputs).

        The probe context is USER_MANAGED: it only infers shapes (allowed before device memory is set,
        ``IExecutionContext::updateDeviceMemorySizeForShapes``), so it reserves no activation memory.
        """
        sizes = {n: nbytes(s, self._io[n].dtype) for n, s in self.profiles.max_shapes().items()}
        strategy = self._trt.ExecutionContextAllocationStrategy.USER_MANAGED
        probe = self.engine.create_execution_context(strategy)
        if probe is None:
            raise TrtCosyError(f"TensorRT could not create an execution context for '{self.name}'.")
        try:
            with Stream() as stream:
                for index, profile in enumerate(self.profiles.profiles):
                    self._probe_profile(probe, stream, index, profile, sizes)
                stream.synchronize()
        finally:
            del probe  # released before the slots select their profiles
        return sizes

    def _probe_profile(
        self, probe: Any, stream: Stream, index: int, profile: Any, sizes: dict[str, int]
    ) -> None:
        where = f"TensorRT plan of '{self.name}', profile {index} ('{profile.name}')"
        try:
            ok = probe.set_optimization_profile_async(index, stream.ptr)
        except RuntimeError as exc:
            raise EngineMismatchError(f"{where} cannot be selected: {exc}. Rebuild the plans.") from exc
        if ok is False:
            raise EngineMismatchError(f"{where} cannot be selected. Rebuild the plans.")
        for name, (_, _, high) in profile.shapes.items():
            if not probe.set_input_shape(name, high):
                raise EngineMismatchError(
                    f"{where} rejects its own maximum shape {high} for '{name}': the plan does not match "
                    "profiles.json. Rebuild the plans."
                )
        for name in self.output_names:
            shape = dims(probe.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise TrtCosyError(
                    f"{where}: output '{name}' has shape {shape} at the maximum inputs; TensorRT cannot size "
                    "it before running (data-dependent output shapes are not supported)."
                )
            sizes[name] = max(sizes.get(name, 0), nbytes(shape, self._io[name].dtype))

    def prepare(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = {}
        for name in self.input_names:
            if name not in feed:
                raise InputError(
                    f"graph '{self.name}' needs inputs {list(self.input_names)}; missing '{name}'."
                )
            value, dtype = np.asarray(feed[name]), self._io[name].dtype
            try:  # same_kind: int64 -> int32 and float64 -> float32 pass, float -> int is refused
                arrays[name] = np.ascontiguousarray(value.astype(dtype, casting="same_kind", copy=False))
            except TypeError as exc:
                raise InputError(
                    f"graph '{self.name}' input '{name}' is {dtype}; got {value.dtype}."
                ) from exc
        return arrays
