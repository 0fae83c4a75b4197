"""The ONNX Runtime backend: one ``OrtRunner`` per graph, over one ``InferenceSession``."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from ..errors import EngineMismatchError, InputError, ModelDirError, require

__all__ = ["OrtRunner", "OrtKVDecoder", "default_threads", "physical_cores"]

_LOGGER = logging.getLogger(__name__)
_CPU_SYSFS: Final = Path("/sys/devices/system/cpu")
# LLM-contract outputs a decoder binds (``hidden`` is left unbound: ORT does not return it).
_DECODER_OUTPUTS: Final = ("logits", "present_keys", "present_values")


def physical_cores() -> int | None:
    """Physical cores among the CPUs this process may run on (Linux sysfs), or None when unknown.

    SMT siblings share one core's FMA units, so they count once: a second thread per core only adds
    contention to kernels that already saturate them.
    """
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    cores = set()
    for cpu in cpus:
        try:
            cores.add((_CPU_SYSFS / f"cpu{cpu}" / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            return None
    return len(cores) or None


def default_threads() -> int:
    """Intra-op threads per session: the physical cores this process may use (at least 1).

    Where the topology is unknown (no Linux sysfs), half the logical CPUs, assuming 2-way SMT.
    """
    cores = physical_cores()
    if cores is not None:
        return max(1, cores)
    return max(1, (os.cpu_count() or 2) // 2)


def _numpy_dtype(ort_type: str) -> np.dtype | None:
    """``'tensor(int32)'`` -> int32; None for types numpy lacks (string, bfloat16), which are fed as given."""
    name = ort_type.removeprefix("tensor(").removesuffix(")")
    try:
        return np.dtype("float32" if name == "float" else name)  # ORT "float" is float32, numpy's is float64
    except TypeError:
        return None


class OrtRunner:
    """A ``Runner`` over an ONNX Runtime ``InferenceSession``.

    Input and output names come from the model. ``infer`` casts every feed to the dtype the model
    declares (e.g. int64 token ids to int32), so callers need not know each exported graph's dtypes.
    Outputs are fresh arrays owned by the caller. ``InferenceSession.run`` is thread-safe, so one
    runner may be shared by several threads running ``infer`` concurrently.
    """

    def __init__(self, session: Any, name: str):
        self.name = name
        self.session = session
        self._inputs = {node.name: node for node in session.get_inputs()}
        self._outputs = tuple(node.name for node in session.get_outputs())
        self._dtypes = {key: _numpy_dtype(node.type) for key, node in self._inputs.items()}

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        name: str,
        threads: int | None = None,
        providers: Sequence[str] | None = None,
        *,
        exported: bool = False,
    ) -> OrtRunner:
        """Load ``path`` (ORT_ENABLE_ALL, sequential, ``threads`` intra-op threads, default physical cores).

        ``providers`` defaults to CPU only. A missing or unreadable file raises ``ModelDirError``, or
        ``EngineMismatchError`` when ``exported`` (a graph ``trt-cosy build`` wrote, not a release file).
        """
        ort = require("onnxruntime", "cpu")
        path = Path(path)
        error = EngineMismatchError if exported else ModelDirError
        remedy = "Rebuild it with `trt-cosy build`." if exported else "Re-download the model release."
        if not path.is_file():
            raise error(f"ONNX model {path} for graph '{name}' does not exist. {remedy}")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.intra_op_num_threads = default_threads() if threads is None else int(threads)
        options.inter_op_num_threads = 1  # sequential execution never runs two nodes at once
        providers = list(providers or ["CPUExecutionProvider"])
        try:
            session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        # ORT's pybind errors (InvalidProtobuf, NoSuchFile, Fail, ...) derive from Exception only.
        except Exception as exc:
            raise error(f"ONNX Runtime could not load {path} for graph '{name}' ({exc}). {remedy}") from exc
        _LOGGER.debug("loaded %s as '%s' (%d intra-op threads)", path, name, options.intra_op_num_threads)
        return cls(session, name)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(self._inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._outputs

    def input_specs(self) -> dict[str, tuple[tuple[int | str | None, ...], np.dtype | None]]:
        """Each input's declared shape (a str or None marks a dynamic axis) and numpy dtype."""
        return {key: (tuple(node.shape), self._dtypes[key]) for key, node in self._inputs.items()}

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [key for key in self._inputs if key not in feed]
        if missing:
            raise InputError(
                f"graph '{self.name}' needs inputs {list(self._inputs)}; missing {missing}. "
                "Feed every input by name."
            )
        session_feed = {key: self._cast(key, feed[key]) for key in self._inputs}
        outputs = self.session.run(list(self._outputs), session_feed)
        return dict(zip(self._outputs, outputs, strict=True))

    def _cast(self, key: str, value: np.ndarray) -> np.ndarray:
        array, dtype = np.asarray(value), self._dtypes[key]
        if dtype is None or array.dtype == dtype:
            return np.ascontiguousarray(array)
        try:  # same_kind allows int64 -> int32 and float64 -> float32, refuses float -> int
            return np.ascontiguousarray(array.astype(dtype, casting="same_kind"))
        except TypeError as exc:
            raise InputError(
                f"graph '{self.name}' input '{key}' is {dtype}; got {array.dtype}, which does not "
                f"convert safely. Pass {dtype} values."
            ) from exc

    def kv_decoder(self, cache_shape: tuple[int, ...]) -> OrtKVDecoder:
        """A step-by-step decoder for a graph of the ``LLM`` contract (see ``OrtKVDecoder``)."""
        return OrtKVDecoder(self, cache_shape)


class OrtKVDecoder:
    """Decode through an ``LLM``-contract session with the KV cache kept inside ONNX Runtime.

    Each step binds the previous step's ``present_keys``/``present_values`` ORT values as the next
    ``past_keys``/``past_values`` (IOBinding): the cache never round-trips through numpy, so a step
    costs no conversion copies and no host concatenation; only the logits come back as numpy. One
    decoder holds one request's cache: create one per request (the session itself is shared).

    Args:
        runner: the ``OrtRunner`` of the LLM graph.
        cache_shape: the empty cache ``(L, 1, H, 0, Dh)``.
    """

    def __init__(self, runner: OrtRunner, cache_shape: tuple[int, ...]):
        ort = require("onnxruntime", "cpu")
        self._session = runner.session
        self._binding = runner.session.io_binding()
        empty = np.zeros(cache_shape, dtype=np.float32)  # [L, 1, H, 0, Dh]
        self._keys = ort.OrtValue.ortvalue_from_numpy(empty)
        self._values = ort.OrtValue.ortvalue_from_numpy(empty.copy())
        self.cached = 0  # positions in the cache

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """Feed ``inputs_embeds`` [1, T, D] after the cached positions; return the logits [1, T, V]."""
        inputs = np.ascontiguousarray(inputs_embeds, dtype=np.float32)  # [1, T, D]
        binding = self._binding
        binding.bind_cpu_input("inputs_embeds", inputs)
        binding.bind_ortvalue_input("past_keys", self._keys)
        binding.bind_ortvalue_input("past_values", self._values)
        binding.clear_binding_outputs()
        for name in _DECODER_OUTPUTS:
            binding.bind_output(name, "cpu")
        self._session.run_with_iobinding(binding)
        logits, self._keys, self._values = binding.get_outputs()
        self.cached += inputs.shape[1]
        return logits.numpy()  # [1, T, V]
