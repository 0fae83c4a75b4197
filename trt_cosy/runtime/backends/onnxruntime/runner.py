"""The ONNX Runtime backend: one ``OrtRunner`` per graph, over one ``InferenceSession``."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np

from ....errors import EngineMismatchError, MissingDependencyError, ModelDirError, require
from ... import heap, run_scope
from ...cpu_budget import default_threads
from ..base import GraphRunner, KVDecoder, LazyRunner

__all__ = [
    "OrtRunner", "LazyOrtRunner", "OrtKVDecoder", "default_threads", "use_shared_arena",
    "check_engine_runtime", "MIN_ENGINE_ORT"
]

_LOGGER = logging.getLogger(__name__)
# LLM-contract outputs a decoder binds (``hidden`` is left unbound: ORT does not return it).
_DECODER_OUTPUTS: Final = ("logits", "present_keys", "present_values")
_SHARED_ARENA_LOCK: Final = threading.Lock()
# Engines use MultiHeadAttention with a head-broadcast attention_bias and GroupQueryAttention with
# rotary inside: 1.18 rejects the bias shape, 1.20 returns NaN for it; 1.22 matches 1.32 to 1e-6.
MIN_ENGINE_ORT: Final = (1, 22)
# The graphs whose runs end with an arena shrink (``_shrinks_after``): the vocoders, the last graph
# run of each chunk, and the flow encoders, whose relative-position attention makes the largest
# working set of a render (quadratic in the tokens: ~3.9 GB for 1637 tokens at full size) once per
# chunk, so a request cancelled before its vocoder runs does not leave it in the arena.
_VOCODER_GRAPHS: Final = frozenset({"hift", "hift_stream", "v1_hift"})
_SHRINK_AFTER_GRAPHS: Final = _VOCODER_GRAPHS | {"flow_encoder", "v1_flow_encoder"}
_shared_arena_state: list[bool] = []  # [registered?] once tried: one process-wide CPU arena


def check_engine_runtime(version: str) -> None:
    """Refuse an onnxruntime older than ``MIN_ENGINE_ORT`` for trt-cosy's engines (their contrib ops)."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    if tuple(parts) < MIN_ENGINE_ORT:
        wanted = ".".join(map(str, MIN_ENGINE_ORT))
        raise MissingDependencyError(
            f"onnxruntime {version} is too old for trt-cosy engines (they use its attention kernels from "
            f"{wanted} on). Upgrade it: pip install 'onnxruntime>={wanted}'"
        )


def use_shared_arena(options: Any) -> bool:
    """Make a session created with ``options`` allocate from one process-wide CPU arena.

    Each ``InferenceSession`` otherwise grows its own arena to its own peak and never returns it, so
    a process holding the LLM, flow and HiFT sessions keeps the sum of their peaks resident. The
    stages run one after another, so one shared arena (ONNX Runtime's environment allocator,
    registered on first use) only grows to the largest concurrent need. Returns whether the shared
    arena is registered; when registration fails the session keeps its own arena.
    """
    ort = require("onnxruntime", "cpu")
    with _SHARED_ARENA_LOCK:
        if not _shared_arena_state:
            info = ort.OrtMemoryInfo(
                "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
            )
            try:  # max_mem 0 (no limit); -1: ORT's defaults for extend strategy, chunk and dead bytes
                ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
                _shared_arena_state.append(True)
            # ORT raises a plain RuntimeError/Fail, e.g. when another library registered one first.
            except Exception as exc:
                _LOGGER.warning("no shared ONNX Runtime CPU arena (%s); each session keeps its own", exc)
                _shared_arena_state.append(False)
    if _shared_arena_state[0]:
        options.add_session_config_entry("session.use_env_allocators", "1")
    return _shared_arena_state[0]


def _shrinks_after(graph: str) -> bool:
    """Whether a request's run of ``graph`` ends with an arena shrink.

    ``TRT_COSY_ARENA_SHRINK``: ``1`` (default) after the vocoder and flow encoder graphs (once per
    chunk each), ``vocoder`` after the vocoder graphs only, ``all`` after every flow and vocoder run
    (slower: the Euler steps reallocate), ``0`` never.
    """
    mode = os.environ.get("TRT_COSY_ARENA_SHRINK", "1")
    if mode == "vocoder":
        return graph in _VOCODER_GRAPHS
    return mode == "all" or (mode != "0" and graph in _SHRINK_AFTER_GRAPHS)


def _load_error(exported: bool) -> tuple[type[Exception], str]:
    """The error class and remedy for a graph that cannot be loaded: one we built, or a release file."""
    if exported:
        return EngineMismatchError, "Rebuild it with `trt-cosy build`."
    return ModelDirError, "Re-download the model release."


def _numpy_dtype(ort_type: str) -> np.dtype | None:
    """``'tensor(int32)'`` -> int32; None for types numpy lacks (string, bfloat16), which are fed as given."""
    name = ort_type.removeprefix("tensor(").removesuffix(")")
    try:
        return np.dtype("float32" if name == "float" else name)  # ORT "float" is float32, numpy's is float64
    except TypeError:
        return None


class OrtRunner(GraphRunner):
    """A ``Runner`` over an ONNX Runtime ``InferenceSession``.

    Input and output names come from the model. ``infer`` casts every feed to the dtype the model
    declares (e.g. int64 token ids to int32), so callers need not know each exported graph's dtypes.
    Outputs are fresh arrays owned by the caller. ``InferenceSession.run`` is thread-safe, so one
    runner may be shared by several threads running ``infer`` concurrently.
    """

    def __init__(self, session: Any, name: str):
        self.name = name
        self.session = session
        self._specs = {
            node.name: (tuple(node.shape), _numpy_dtype(node.type)) for node in session.get_inputs()
        }
        self._outputs = tuple(node.name for node in session.get_outputs())

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        name: str,
        threads: int | None = None,
        providers: Sequence[str] | None = None,
        *,
        exported: bool = False,
        shared_arena: bool = True,
    ) -> OrtRunner:
        """Load ``path`` (ORT_ENABLE_ALL, sequential, ``threads`` intra-op threads, default physical cores).

        ``providers`` defaults to CPU only. ``shared_arena`` allocates from the process-wide CPU arena
        (``use_shared_arena``) instead of a per-session one. A missing or unreadable file raises
        ``ModelDirError``, or ``EngineMismatchError`` when ``exported`` (a graph ``trt-cosy build``
        wrote, not a release file).
        """
        ort = require("onnxruntime", "cpu")
        if exported:
            check_engine_runtime(ort.__version__)
        path = Path(path)
        error, remedy = _load_error(exported)
        if not path.is_file():
            raise error(f"ONNX model {path} for graph '{name}' does not exist. {remedy}")
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.intra_op_num_threads = default_threads() if threads is None else int(threads)
        options.inter_op_num_threads = 1  # sequential execution never runs two nodes at once
        if shared_arena:
            use_shared_arena(options)
        providers = list(providers or ["CPUExecutionProvider"])
        try:
            session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        # ORT's pybind errors (InvalidProtobuf, NoSuchFile, Fail, ...) derive from Exception only.
        except Exception as exc:
            raise error(f"ONNX Runtime could not load {path} for graph '{name}' ({exc}). {remedy}") from exc
        # The model file's bytes and the initializers copied before prepacking are free now but still
        # resident in glibc's heap: return them (full-size CosyVoice3: -130 MiB after the DiT's load).
        heap.release_free()
        _LOGGER.debug("loaded %s as '%s' (%d intra-op threads)", path, name, options.intra_op_num_threads)
        return cls(session, name)

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        session_feed = self._feed(feed)
        scope = run_scope.current()
        if scope is None:
            outputs = self.session.run(list(self._outputs), session_feed)
            return dict(zip(self._outputs, outputs, strict=True))
        # A request's scope: its cancel() sets ``terminate`` and ORT stops at the next node.
        options = require("onnxruntime", "cpu").RunOptions()
        if _shrinks_after(self.name):
            # Return the arena's free regions after the flow encoder and the vocoder (once per chunk
            # each): a long render's working memory is not kept for good ("Memory under load").
            options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
        scope.register(options)
        try:
            outputs = self.session.run(list(self._outputs), session_feed, options)
        except Exception:
            if scope.cancelled:
                raise run_scope.RunCancelled(f"graph '{self.name}' stopped: request cancelled") from None
            raise
        finally:
            scope.unregister(options)
        return dict(zip(self._outputs, outputs, strict=True))

    def kv_decoder(self, cache_shape: tuple[int, ...]) -> OrtKVDecoder:
        """A step-by-step decoder for a graph of the ``LLM`` contract (see ``OrtKVDecoder``)."""
        return OrtKVDecoder(self, cache_shape)


class LazyOrtRunner(LazyRunner[OrtRunner]):
    """An ``OrtRunner`` whose session is created on first use (thread-safe), e.g. a graph only some
    requests need (the chunk-attention flow estimator of streaming synthesis).

    The file is checked at once (``check_now=False``: at first use, for optional frontend models); the
    session is created (once, costing its load time) by the first
    ``infer``, ``input_names``, ``output_names`` or ``input_specs``, or by ``load()``, which a server
    can call in the background after start-up (``runtime.backends.base.LazyRunner``). On Python < 3.12
    ``isinstance(runner, Runner)`` reads the properties, so it creates the session too.
    """

    def __init__(
        self,
        path: str | Path,
        name: str,
        threads: int | None = None,
        *,
        exported: bool = False,
        check_now: bool = True,
    ):
        super().__init__(name)
        self._path, self._threads, self._exported = Path(path), threads, exported
        if check_now and not self._path.is_file():
            error, remedy = _load_error(exported)
            raise error(f"ONNX model {self._path} for graph '{name}' does not exist. {remedy}")

    def _create(self) -> OrtRunner:
        return OrtRunner.from_path(self._path, self.name, self._threads, exported=self._exported)


class OrtKVDecoder(KVDecoder):
    """Decode through an ``LLM``-contract session with the KV cache kept inside ONNX Runtime
    (``base.KVDecoder``).

    Each step binds the previous step's ``present_keys``/``present_values`` ORT values as the next
    ``past_keys``/``past_values`` (IOBinding): a step costs no conversion copies and no host
    concatenation.

    Args:
        runner: the ``OrtRunner`` of the LLM graph.
        cache_shape: the empty cache ``(L, 1, H, 0, Dh)``.
    """

    def __init__(self, runner: OrtRunner, cache_shape: tuple[int, ...]):
        super().__init__()
        ort = require("onnxruntime", "cpu")
        self._session = runner.session
        self._binding = runner.session.io_binding()
        empty = np.zeros(cache_shape, dtype=np.float32)  # [L, 1, H, 0, Dh]
        self._keys = ort.OrtValue.ortvalue_from_numpy(empty)
        self._values = ort.OrtValue.ortvalue_from_numpy(empty.copy())

    def _step(self, inputs: np.ndarray) -> np.ndarray:
        binding = self._binding
        binding.bind_cpu_input("inputs_embeds", inputs)
        binding.bind_ortvalue_input("past_keys", self._keys)
        binding.bind_ortvalue_input("past_values", self._values)
        binding.clear_binding_outputs()
        for name in _DECODER_OUTPUTS:
            binding.bind_output(name, "cpu")
        self._session.run_with_iobinding(binding)
        logits, self._keys, self._values = binding.get_outputs()
        return logits.numpy()  # [1, T, V]
