"""Compile graphs whose backend can crash natively in a child process first.

A native crash in a dependency (OpenVINO 2026.4's CPU plugin raises SIGFPE compiling the tiny
CosyVoice2 LLM in bfloat16 on Intel AMX CPUs) is no Python exception: no ``try`` catches it, and it
takes down whatever process compiles the graph (a server at start-up, a Triton instance, the test
suite). So the first compile of a graph on a machine runs in a short-lived child process
(``run_in_child``): a child that dies by a signal becomes a ``NativeCrashError`` naming the graph,
backend, precision, signal, CPU and library version, and what to do instead; a child that finishes
lets this process compile the same graph (cheaply: the child filled OpenVINO's compiled-model cache).

What a check found is kept, so each graph is checked once per machine:

* in this process (``_checked``);
* on disk, ``<trt-cosy cache>/native-checks.json``, keyed by backend version, machine, graph file,
  precision and threads (``CompileChecks``), so a server restart does not check again;
* in the engines' manifest (``Manifest.compile_check``): ``trt-cosy build`` checks every graph on the
  machine that builds them (falling back to a precision that compiles, ``builder``'s OpenVINO step), and
  a load on a machine with the same CPU signature and library version trusts that record.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Final

from ..cache_dir import cache_root
from ..errors import NativeCrashError

__all__ = [
    "ChildOutcome",
    "CompileChecks",
    "Machine",
    "machine",
    "run_in_child",
    "run_each_in_child",
    "file_identity",
    "checked_compile",
    "crash_message",
]

_LOGGER = logging.getLogger(__name__)

CHECKS_NAME: Final = "native-checks.json"
CHILD_TIMEOUT_S: Final = 900.0  # a full-size graph compiles in seconds; a loaded machine is slower
# The ISA flags that decide which native kernels a backend picks (what a crash depends on).
_ISA_FLAG: Final = re.compile(r"^(avx|amx|fma|f16c|sse4|vnni|bf16)")
_STDERR_TAIL: Final = 1200  # characters of a failed child's stderr kept in the message
_EACH: Final = "@each"  # target suffix: run the function once per payload of a list (run_each_in_child)
_DONE_LINE: Final = "trt-cosy-child-done\n"  # printed (and flushed) by the child after each payload
_checked: dict[str, bool] = {}  # key -> compiled in a child (True) / crashed (False), this process
_CHECK_LOCK: Final = threading.Lock()


@dataclass(frozen=True)
class Machine:
    """What a native compile depends on: the CPU model and its ISA flags."""

    cpu: str
    flags: tuple[str, ...]

    @property
    def key(self) -> str:
        """A short stable digest of the model and flags (what manifests and the disk record keep)."""
        text = self.cpu + "|" + " ".join(self.flags)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self) -> str:
        return f"{self.cpu} ({' '.join(self.flags) or 'no ISA flags read'})"


@lru_cache(maxsize=1)
def machine(cpuinfo: str = "/proc/cpuinfo") -> Machine:
    """This machine's CPU model name and sorted ISA flags (``/proc/cpuinfo``; the platform's
    processor name elsewhere)."""
    model, flags = "", set()
    try:
        for line in Path(cpuinfo).read_text(errors="replace").splitlines():
            field, _, value = line.partition(":")
            field = field.strip()
            if field == "model name" and not model:
                model = value.strip()
            elif field in ("flags", "Features") and not flags:
                flags = {flag for flag in value.split() if _ISA_FLAG.match(flag)}
    except OSError:
        pass
    if not model:
        import platform

        model = platform.processor() or platform.machine() or "unknown CPU"
    return Machine(cpu=model, flags=tuple(sorted(flags)))


@dataclass(frozen=True)
class ChildOutcome:
    """How a child process ended: ``ok``, killed by ``signal`` (its name), or failed with an exception
    (``returncode`` > 0, ``detail`` its stderr's tail)."""

    ok: bool
    returncode: int
    signal: str | None = None
    detail: str = ""
    stdout: str = ""

    @property
    def crashed(self) -> bool:
        return self.signal is not None


def run_in_child(target: str, payload: Mapping[str, Any], timeout: float = CHILD_TIMEOUT_S) -> ChildOutcome:
    """Run ``target`` (``"package.module:function"``) with ``**payload`` (JSON-able) in a new Python
    process that imports what this one imports (its ``sys.path``); report how it ended.

    A child still running after ``timeout`` seconds is killed and reported as ``SIGKILL``.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
    command = [sys.executable, "-m", __name__, target]
    try:
        done = subprocess.run(
            command,
            input=json.dumps(dict(payload)),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-_STDERR_TAIL:]
        detail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        return ChildOutcome(
            False, -int(signal.SIGKILL), "SIGKILL", f"timed out after {timeout:.0f} s; {detail}", out
        )
    detail = (done.stderr or "")[-_STDERR_TAIL:]
    if done.returncode < 0:
        return ChildOutcome(False, done.returncode, _signal_name(-done.returncode), detail, done.stdout or "")
    return ChildOutcome(done.returncode == 0, done.returncode, None, detail, done.stdout or "")


def run_each_in_child(
    target: str, payloads: list[Mapping[str, Any]], timeout: float = CHILD_TIMEOUT_S
) -> tuple[int, ChildOutcome]:
    """Run ``target(**payload)`` for each payload in order, in one child process; return how many
    finished and how the child ended. A crash stops the child at ``payloads[finished]``: the caller
    decides what to do with that one and runs the rest in a new child."""
    outcome = run_in_child(f"{target}{_EACH}", {"payloads": [dict(payload) for payload in payloads]}, timeout)
    return outcome.stdout.count(_DONE_LINE), outcome


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def file_identity(path: Path) -> str:
    """A graph file's identity for the check records: the digest of its bytes (the IR's ``.xml``,
    small) and the size of its weights file beside it (``.bin``) when there is one."""
    path = Path(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    weights = path.with_suffix(".bin")
    size = weights.stat().st_size if weights.is_file() and weights != path else 0
    return f"{digest}+{size}"


class CompileChecks:
    """The on-disk record of compile checks on this machine (``<cache>/native-checks.json``): ``key ->
    {"ok": bool, "signal": name}``. Best effort: an unwritable cache only costs a check per process."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else cache_root() / CHECKS_NAME

    def get(self, key: str) -> dict[str, Any] | None:
        entry = self._read().get(key)
        return entry if isinstance(entry, dict) else None

    def put(self, key: str, entry: Mapping[str, Any]) -> None:
        records = self._read()
        records[key] = dict(entry)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                json.dump(records, file, indent=1, sort_keys=True)
            os.replace(temporary, self.path)  # atomic: a reader sees the old or the new record
        except OSError as exc:
            _LOGGER.info("compile checks not recorded in %s: %r", self.path, exc)

    def _read(self) -> dict[str, Any]:
        try:
            records = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return records if isinstance(records, dict) else {}


def crash_message(
    backend: str, version: str, graph: str, path: Path, compute: str, outcome: ChildOutcome, remedy: str
) -> str:
    """The ``NativeCrashError`` message: what crashed, where, and what to do."""
    return (
        f"{backend} {version} crashed ({outcome.signal}) compiling graph '{graph}' ({path}) in {compute} "
        f"on this CPU: {machine().describe()}. The crash happened in a child process, so this one "
        f"goes on. {remedy}"
    )


def checked_compile(
    *,
    backend: str,
    version: str,
    graph: str,
    path: Path,
    compute: str,
    threads: int,
    target: str,
    payload: Mapping[str, Any],
    remedy: str,
    records: CompileChecks | None = None,
) -> None:
    """Make sure compiling ``graph`` (file ``path``, computing in ``compute`` with ``threads``
    threads on ``backend`` ``version``) does not crash this process: look the check up (this process,
    then ``records``), else run ``target(**payload)`` in a child; a crash raises ``NativeCrashError``
    (with ``remedy``, the advice on what to use instead). A child that fails with a Python exception is
    not recorded: compiling in this process then raises that error the usual way."""
    key = f"{backend} {version}|{machine().key}|{file_identity(path)}|{compute}|{threads}"
    with _CHECK_LOCK:
        known = _checked.get(key)
    records = records if records is not None else CompileChecks()
    if known is None:
        entry = records.get(key)
        if entry is not None:
            known = bool(entry.get("ok"))
            outcome = ChildOutcome(known, 0, entry.get("signal"))
    if known is None:
        _LOGGER.info("checking that %s compiles graph '%s' in %s, in a child process", backend, graph, compute)
        outcome = run_in_child(target, payload)
        if not outcome.ok and not outcome.crashed:  # an ordinary error: this process reports it
            _LOGGER.debug("graph '%s' failed to compile in the child:\n%s", graph, outcome.detail)
            return
        known = outcome.ok
        records.put(key, {"ok": outcome.ok, "signal": outcome.signal, "graph": graph, "compute": compute})
    with _CHECK_LOCK:
        _checked[key] = known
    if not known:
        raise NativeCrashError(crash_message(backend, version, graph, path, compute, outcome, remedy))


def _main(argv: list[str]) -> int:
    """The child: run ``argv[0]`` (``module:function``) with the JSON object on stdin as keywords."""
    target = argv[0]
    each = target.endswith(_EACH)
    module_name, _, function_name = target.removesuffix(_EACH).partition(":")
    function = getattr(importlib.import_module(module_name), function_name)
    arguments = json.loads(sys.stdin.read() or "{}")
    for payload in arguments["payloads"] if each else [arguments]:
        function(**payload)
        sys.stdout.write(_DONE_LINE)
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
