"""A real ``tritonserver`` on loopback for the tests: find the binary and the Python backend, start
it on free ports, wait until ready, stop it. Skips (with the reason) only where the binary cannot run."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

_STUB_NUMPY = "numpy<2"


def _pytriton_root() -> Path | None:
    # Found, not imported: nvidia-pytriton is installed with --no-deps (its numpy<2 pin), so its own
    # Python package may not import; only the tritonserver binary it ships is used.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
    return root if (root / "bin" / "tritonserver").is_file() else None


def backend_dir(work: Path) -> tuple[Path, Path, dict[str, str]]:
    """(tritonserver binary, backends folder, extra environment): $TRT_COSY_TRITONSERVER with the backends
    next to it, else the server shipped in the nvidia-pytriton wheel with the stub of this Python."""
    explicit = os.environ.get("TRT_COSY_TRITONSERVER")
    if explicit:
        binary = Path(explicit)
        return binary, binary.parent.parent / "backends", {}
    root = _pytriton_root()
    if root is None:
        pytest.skip(
            "no tritonserver: `pip install --no-deps nvidia-pytriton==0.7.0` (ships Triton 2.51) or set "
            "TRT_COSY_TRITONSERVER"
        )
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        pytest.skip(f"nvidia-pytriton has no Python-backend stub for Python {version}")
    backends = work / "backends"
    python = backends / "python"
    python.mkdir(parents=True, exist_ok=True)
    for source in (root / "backends" / "python").glob("*"):
        if source.is_file():
            shutil.copy2(source, python / source.name)
    shutil.copy2(stub, python / "triton_python_backend_stub")
    libs = root.parent.parent / "nvidia_pytriton.libs"
    env = {"LD_LIBRARY_PATH": os.pathsep.join(filter(None, [str(libs), os.environ.get("LD_LIBRARY_PATH", "")]))}
    return root / "bin" / "tritonserver", backends, env


def stub_numpy_dir(config: pytest.Config, factory: pytest.TempPathFactory) -> Path | None:
    """A folder holding numpy<2 for the stub (Triton 2.51's stub corrupts numpy 2 arrays), made once with
    pip; None when this numpy is already 1.x. Kept in pytest's cache (``.pytest_cache/d/trt-cosy-triton``)
    where the cache plugin runs, else in the folder above the session's base temp (shared by pytest-xdist
    workers); an exclusive lock keeps two sessions or workers from installing into it at once."""
    if int(np.__version__.split(".")[0]) < 2:
        return None
    cache = getattr(config, "cache", None)  # None under `-p no:cacheprovider`
    if cache is not None:
        folder = Path(cache.mkdir("trt-cosy-triton"))
    else:
        folder = factory.getbasetemp().parent / "trt-cosy-triton"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "stub-numpy"
    with open(folder / "install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "numpy").is_dir():
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
            command = [*pip, "--target", str(target), _STUB_NUMPY]
            result = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if result.returncode != 0:
                reason = result.stderr.strip()[-300:]
                pytest.skip(f"cannot install {_STUB_NUMPY} for the Triton stub: {reason}")
    return target


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


class TritonServer:
    """``tritonserver`` serving ``repo`` on 127.0.0.1 (HTTP, gRPC and metrics on free ports)."""

    def __init__(self, repo: Path, work: Path, python_path: list[str]):
        self.binary, self.backends, self.env = backend_dir(work)
        self.repo = repo
        self.log_path = work / "tritonserver.log"
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.http_url = f"127.0.0.1:{self.http_port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.python_path = python_path
        self.process: subprocess.Popen | None = None

    def _launch(self) -> None:
        env = {**os.environ, **self.env, "PYTHONPATH": os.pathsep.join(self.python_path)}
        command = [
            str(self.binary), f"--model-repository={self.repo}", f"--backend-directory={self.backends}",
            "--http-address=127.0.0.1", "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1",
            f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}", f"--metrics-port={self.metrics_port}",
            "--exit-timeout-secs=5",
        ]
        with open(self.log_path, "wb") as log:
            try:
                self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
            except OSError as exc:
                pytest.skip(f"tritonserver cannot start here: {exc}")

    def run_until_exit(self, timeout_s: float = 180.0) -> str:
        """Start a server expected to stop by itself (a model that refuses to load); returns its log."""
        self._launch()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            pytest.fail(f"tritonserver kept running:\n{self.log_tail()}")
        return self.log_tail(chars=1 << 20)

    def start(self, timeout_s: float = 180.0) -> TritonServer:
        import tritonclient.http as http

        self._launch()
        client = http.InferenceServerClient(self.http_url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._exited()
            try:
                if client.is_server_ready():
                    return self
            except Exception:  # noqa: BLE001 - not listening yet
                pass
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"tritonserver was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def _exited(self) -> None:
        log = self.log_tail()
        if "failed to load" in log or "UNAVAILABLE" in log:
            pytest.fail(f"tritonserver started but a model failed to load:\n{log}")
        pytest.skip(f"tritonserver exited at start (status {self.process.returncode}):\n{log[-1500:]}")

    def log_tail(self, chars: int = 6000) -> str:
        return self.log_path.read_bytes().decode("utf-8", "replace")[-chars:]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
