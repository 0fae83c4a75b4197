"""How ONNX Runtime sessions are created: the shared CPU arena and deferred (lazy) sessions.

Fast tests run on a small onnx.helper model; the ``slow`` ones reuse the shared tiny engines build
(``shared_tiny_engines`` in tests/test_export.py) and check that a lazily created streaming
estimator and sessions on the shared arena give bit-identical outputs to plain eager sessions.
"""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnx", reason="needs the [build] extra (onnx)")

import onnxruntime as ort
from _support import save_test_graph
from onnx import TensorProto, helper, numpy_helper

from trt_cosy.errors import EngineMismatchError, ModelDirError
from trt_cosy.runtime.backends.base import Runner
from trt_cosy.runtime.backends.onnxruntime import runner as ort_module
from trt_cosy.runtime.backends.onnxruntime.runner import LazyOrtRunner, OrtRunner, use_shared_arena
from trt_cosy.runtime.engines import LAZY_GRAPHS, load_engines

WEIGHT = np.random.default_rng(3).standard_normal((16, 32)).astype(np.float32)  # WEIGHT: [D, H]


def _write_mlp(path: Path) -> Path:
    """``x`` float32 [1, T, 16] -> ``y`` float32 [1, T, 32] = tanh(x @ W)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),  # [1, T, 32]
        helper.make_node("Tanh", ["h"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", 32])],
        initializer=[numpy_helper.from_array(WEIGHT, "w")],
    )
    return save_test_graph(graph, path)


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory) -> Path:
    return _write_mlp(tmp_path_factory.mktemp("ort-loading") / "mlp.onnx")


def _feed(frames: int) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(frames).standard_normal((1, frames, 16), dtype=np.float32)}


def _max_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0


def test_shared_arena_sets_env_allocators():
    options = ort.SessionOptions()
    assert use_shared_arena(options), "the process-wide CPU arena could not be registered"
    assert options.get_session_config_entry("session.use_env_allocators") == "1"
    assert use_shared_arena(ort.SessionOptions())  # registered once, reused after


def test_shared_arena_outputs_identical(mlp_path):
    shared = OrtRunner.from_path(mlp_path, "mlp", threads=1)
    private = OrtRunner.from_path(mlp_path, "mlp", threads=1, shared_arena=False)
    assert shared.session.get_session_options().get_session_config_entry("session.use_env_allocators") == "1"
    for frames in (1, 7, 300):  # different sizes: the arena grows and reuses chunks
        feed = _feed(frames)
        got, want = shared.infer(feed)["y"], private.infer(feed)["y"]
        expected = np.tanh(feed["x"] @ WEIGHT)  # [1, T, 32]
        assert got.shape == (1, frames, 32)
        assert _max_error(got, want) == 0.0, f"shared vs private arena, T={frames}: {_max_error(got, want)}"
        assert _max_error(got, expected) < 1e-5, f"vs numpy, T={frames}: {_max_error(got, expected)}"


def test_lazy_runner_defers_session(mlp_path):
    lazy = LazyOrtRunner(mlp_path, "mlp", threads=1, exported=True)
    assert not lazy.loaded
    feed = _feed(5)
    got = lazy.infer(feed)["y"]
    assert lazy.loaded
    want = OrtRunner.from_path(mlp_path, "mlp", threads=1).infer(feed)["y"]
    assert _max_error(got, want) == 0.0, f"lazy vs eager: {_max_error(got, want)}"
    assert lazy.input_names == ("x",) and lazy.output_names == ("y",)
    assert lazy.input_specs()["x"][1] == np.float32
    assert isinstance(lazy, Runner)  # on Python < 3.12 this reads the properties, i.e. loads the session


def test_lazy_runner_missing_file_fails_at_once(tmp_path):
    with pytest.raises(EngineMismatchError, match="trt-cosy build"):
        LazyOrtRunner(tmp_path / "absent.onnx", "absent", exported=True)
    with pytest.raises(ModelDirError, match="Re-download"):
        LazyOrtRunner(tmp_path / "absent.onnx", "absent")


def test_lazy_runner_creates_one_session_under_concurrent_first_calls(mlp_path, monkeypatch):
    created = []
    original = OrtRunner.from_path.__func__

    def counting(cls, *args, **kwargs):
        created.append(args[1])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(ort_module.OrtRunner, "from_path", classmethod(counting))
    lazy = LazyOrtRunner(mlp_path, "mlp", threads=1)
    barrier = threading.Barrier(4)
    outputs: list[np.ndarray] = []

    def call() -> None:
        barrier.wait()
        outputs.append(lazy.infer(_feed(3))["y"])

    workers = [threading.Thread(target=call) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert created == ["mlp"], f"expected one session, created {len(created)}"
    assert len(outputs) == 4 and all(_max_error(out, outputs[0]) == 0.0 for out in outputs)


# --- tiny engines (slow: shares the session's tiny build with tests/test_export.py) -------------------


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory, v2_tiny_dir) -> Path:
    from _support import shared_tiny_engines

    return shared_tiny_engines(tmp_path_factory, v2_tiny_dir)[1]


def _estimator_feed(frames: int) -> dict[str, np.ndarray]:
    """The ``FLOW_ESTIMATOR`` contract's inputs for ``frames`` mel frames (CFG batch 2)."""
    rng = np.random.default_rng(frames)
    return {
        "x": rng.standard_normal((2, 80, frames), dtype=np.float32),  # [2, 80, F]
        "mask": np.ones((2, 1, frames), np.float32),  # [2, 1, F]
        "mu": rng.standard_normal((2, 80, frames), dtype=np.float32),  # [2, 80, F]
        "t": np.full(2, 0.3, np.float32),  # [2]
        "spks": rng.standard_normal((2, 80), dtype=np.float32),  # [2, 80]
        "cond": rng.standard_normal((2, 80, frames), dtype=np.float32),  # [2, 80, F]
    }


def _hift_feed(frames: int) -> dict[str, np.ndarray]:
    """The ``HIFT`` contract's inputs for ``frames`` mel frames, no cached source."""
    rng = np.random.default_rng(frames)
    return {
        "mel": rng.normal(-5.0, 2.0, (1, 80, frames)).astype(np.float32),  # [1, 80, F]
        "sine_noise": rng.standard_normal((1, 480 * frames, 9), dtype=np.float32),  # [1, 480F, 9]
        "cache_source": np.zeros((1, 1, 0), np.float32),  # [1, 1, 0]
    }


@pytest.mark.slow
def test_load_engines_defers_stream_estimator(tiny_engines):
    model = load_engines(tiny_engines, threads=1)
    lazy = model.runners["flow_estimator_stream"]
    assert "flow_estimator_stream" in LAZY_GRAPHS
    assert isinstance(lazy, LazyOrtRunner) and not lazy.loaded
    # With the batched decode graph, the two LLM graphs are created on first use too (one is used).
    lazy_names = (LAZY_GRAPHS & set(model.runners)) | ({"llm", "llm_batch"} if "llm_batch" in model.runners else set())
    lazy_names |= {"flow_estimator_incremental"} & set(model.runners)  # streaming's own graph, when built
    assert all(isinstance(model.runners[name], LazyOrtRunner) for name in lazy_names)
    assert all(
        isinstance(model.runners[name], OrtRunner) for name in model.runners if name not in lazy_names
    )
    eager = load_engines(tiny_engines, threads=1, lazy_graphs=())
    assert all(isinstance(runner, OrtRunner) for runner in eager.runners.values())
    for frames in (50, 130):
        feed = _estimator_feed(frames)
        want = eager.runners["flow_estimator_stream"].infer(feed)["estimator_out"]  # [2, 80, F]
        got = lazy.infer(feed)["estimator_out"]
        assert _max_error(got, want) == 0.0, f"lazy stream estimator, F={frames}: {_max_error(got, want)}"
    assert lazy.loaded


@pytest.mark.slow
def test_shared_arena_engines_match_private_sessions(tiny_engines):
    """Graphs on the shared arena, run in turn (so the arena is reused), equal private-arena sessions."""
    model = load_engines(tiny_engines, threads=1)
    cases = {"flow_estimator": _estimator_feed, "hift": _hift_feed}
    for frames in (40, 90):
        for name, make_feed in cases.items():
            private = OrtRunner.from_path(tiny_engines / f"{name}.onnx", name, threads=1, shared_arena=False)
            feed = make_feed(frames)
            want, got = private.infer(feed), model.runners[name].infer(feed)
            for key in want:
                error = _max_error(got[key], want[key])
                assert error == 0.0, f"{name}.{key}, F={frames}: the shared arena differs by {error}"


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("fastapi") is None, reason="the server's warm-up needs the [serve] extra (fastapi)"
)
def test_server_warm_up_creates_the_deferred_streaming_session(tiny_engines):
    from trt_cosy.server.app import warm_up
    from trt_cosy.tts import CosyVoice

    tts = CosyVoice.load(tiny_engines)
    # Streaming chunks run the incremental estimator where the engines have it, else the stream one.
    name = next(n for n in ("flow_estimator_incremental", "flow_estimator_stream") if n in tts.model.runners)
    deferred = tts.model.runners[name]
    assert isinstance(deferred, LazyOrtRunner) and not deferred.loaded  # plain loading leaves it for later
    warm_up(tts)
    assert deferred.loaded, "the warm-up's streamed sentence must create the chunk-attention session"
