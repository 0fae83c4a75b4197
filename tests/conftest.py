"""Shared fixtures: the golden tiny checkpoint and its reference outputs (copied into tests/data)."""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest

DATA = Path(__file__).parent / "data"


def pytest_configure(config):
    """Ctrl-C reaches the suite and the programs its tests start, however the suite was launched: a shell
    that starts a job in the background without job control (``cmd &`` in a script, some CI runners) starts
    it with SIGINT ignored, which every child inherits, so the tests that interrupt ``trt-cosy say`` /
    ``convert`` with SIGINT would wait for an exit that never comes."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
V2_TINY = DATA / "cosyvoice2-tiny"


@pytest.fixture(scope="session", autouse=True)
def _shared_exports(tmp_path_factory):
    """The session's builds export each distinct graph once (``builder.export_reuse``, through the
    environment so that the builds of ``trt-cosy`` child processes share too): the tiny checkpoints are
    built many times over (backends, precisions, families), and the torch exports were most of the
    suite's time. An export is reused only for the same module, weights, feeds and settings. Under
    pytest-xdist the folder is the run's, above each worker's base temp: the workers share it too (an
    export one worker is making is waited for, ``export_reuse.claimed``)."""
    import os

    from trt_cosy.builder.export_reuse import EXPORT_CACHE_ENV  # numpy only

    previous = os.environ.get(EXPORT_CACHE_ENV)
    base = tmp_path_factory.getbasetemp()
    run = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # xdist: <run>/popen-gw<N>
    os.environ[EXPORT_CACHE_ENV] = str(run / "shared-exports")
    yield
    if previous is None:
        os.environ.pop(EXPORT_CACHE_ENV, None)
    else:
        os.environ[EXPORT_CACHE_ENV] = previous


@pytest.fixture(scope="session")
def v2_tiny_dir() -> Path:
    return V2_TINY


@pytest.fixture(scope="session")
def v2_reference() -> dict[str, np.ndarray]:
    with np.load(V2_TINY / "reference.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(autouse=True)
def _portable_cpu_pick(monkeypatch):
    """Tests see the CPU default of a machine without OpenVINO bf16 kernels (ONNX Runtime int4), so
    their outcome does not depend on the CPU; tests/test_backend_choice.py tests the bf16 pick."""
    from trt_cosy.runtime import backend_choice

    monkeypatch.setattr(backend_choice, "cpu_has_bf16_kernels", lambda: False)
