"""The render gate (bounded flow + vocoder work in flight) and the per-request run scope."""

from __future__ import annotations

import threading
import time

import pytest

from trt_cosy.runtime.run_scope import RunCancelled, RunScope, current
from trt_cosy.runtime.work_gate import GateCancelled, WorkGate


def _hold_in_thread(gate: WorkGate, weight: int, release: threading.Event, log: list, name: str):
    def body() -> None:
        with gate.hold(weight):
            log.append((name, gate.in_flight))
            release.wait(10)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def test_gate_admits_while_the_weights_fit_and_queues_the_rest():
    gate, release, log = WorkGate(100), threading.Event(), []
    first = _hold_in_thread(gate, 60, release, log, "a")
    _wait_for(lambda: gate.in_flight == 60)
    second = _hold_in_thread(gate, 30, release, log, "b")
    _wait_for(lambda: gate.in_flight == 90)
    third = _hold_in_thread(gate, 30, release, log, "c")  # 120 > 100: waits
    time.sleep(0.2)
    assert [name for name, _ in log] == ["a", "b"] and gate.in_flight == 90
    release.set()
    for thread in (first, second, third):
        thread.join(5)
    assert [name for name, _ in log] == ["a", "b", "c"]
    assert max(in_flight for _, in_flight in log) <= 100
    assert gate.in_flight == 0


def test_gate_runs_an_oversized_weight_alone():
    gate, release, log = WorkGate(100), threading.Event(), []
    small = _hold_in_thread(gate, 10, release, log, "small")
    _wait_for(lambda: gate.in_flight == 10)
    big = _hold_in_thread(gate, 500, release, log, "big")  # clipped to the capacity
    time.sleep(0.2)
    assert [name for name, _ in log] == ["small"]
    release.set()
    small.join(5)
    big.join(5)
    assert log[-1] == ("big", 100) and gate.in_flight == 0


def test_cancelled_waiter_leaves_without_holding():
    gate, release, log = WorkGate(10), threading.Event(), []
    holder = _hold_in_thread(gate, 10, release, log, "holder")
    _wait_for(lambda: gate.in_flight == 10)
    cancelled = threading.Event()
    threading.Timer(0.1, cancelled.set).start()
    started = time.monotonic()
    with pytest.raises(GateCancelled):
        with gate.hold(5, cancelled.is_set):
            pytest.fail("a cancelled waiter got room")
    assert time.monotonic() - started < 1.0
    release.set()
    holder.join(5)
    assert gate.in_flight == 0


class _Run:
    terminate = False


def test_run_scope_terminates_registered_runs_and_refuses_new_ones():
    scope, run = RunScope(), _Run()
    assert current() is None
    with scope.active():
        assert current() is scope
        scope.register(run)
        scope.cancel()
        assert run.terminate and scope.cancelled
        with pytest.raises(RunCancelled):
            scope.register(_Run())
    assert current() is None


def test_cancel_aborts_a_running_onnx_runtime_graph(tmp_path):
    """A scope's cancel() stops an ONNX Runtime run in the middle (RunOptions.terminate)."""
    pytest.importorskip("onnxruntime", reason="the ONNX Runtime backend is optional ([cpu] extra)")
    onnx = pytest.importorskip("onnx", reason="builds a test graph")
    import numpy as np
    from _support import save_test_graph
    from onnx import TensorProto, helper

    from trt_cosy.runtime.backends.onnxruntime.runner import OrtRunner

    # 400 chained 512x512 matmuls: long enough (hundreds of ms) to be cut off in the middle.
    nodes, previous = [], "x"
    weight = helper.make_tensor(
        "w", TensorProto.FLOAT, [512, 512], (np.eye(512, dtype=np.float32) * 0.999).ravel().tolist()
    )
    for index in range(400):
        nodes.append(helper.make_node("MatMul", [previous, "w"], [f"h{index}"]))
        previous = f"h{index}"
    nodes.append(helper.make_node("Identity", [previous], ["y"]))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [512, 512])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [512, 512])],
        [weight],
    )
    del onnx
    runner = OrtRunner.from_path(save_test_graph(graph, tmp_path / "chain.onnx"), "chain", threads=1)
    feed = {"x": np.ones((512, 512), np.float32)}
    started = time.perf_counter()
    runner.infer(feed)
    full_s = time.perf_counter() - started
    scope = RunScope()
    threading.Timer(full_s / 10, scope.cancel).start()
    started = time.perf_counter()
    with pytest.raises(RunCancelled), scope.active():
        runner.infer(feed)
    assert time.perf_counter() - started < full_s * 0.8, (time.perf_counter() - started, full_s)


def test_with_priorities_the_gate_lets_renders_in_by_render_order_not_arrival():
    """A server's earlier non-streamed request (number 0) goes through the gate before a later one
    (number 1) that queued first, so the render turns behind the gate see them in that order."""
    gate, order = WorkGate(100), []
    threads = []
    with gate.hold(100):  # full: everyone below queues
        for number, first in ((1, True), (0, False), (2, False)):

            def run(number=number, first=first) -> None:
                with gate.hold(80, None, (1, 500, number), first):
                    order.append(number)

            threads.append(threading.Thread(target=run, daemon=True))
            threads[-1].start()
            in_line = len(threads)
            _wait_for(lambda in_line=in_line: len(gate._queue) == in_line)
    for thread in threads:
        thread.join(5.0)
    assert order == [0, 1, 2]
