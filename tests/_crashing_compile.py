"""A stand-in for OpenVINO's compile-check target that dies the way OpenVINO 2026.4 does on Intel AMX
CPUs (SIGFPE compiling the tiny CosyVoice2 LLM in bf16), for the graphs named in
``$TRT_COSY_TEST_CRASH`` (``"llm:bf16,llm:fp32"``); every other graph compiles for real."""

from __future__ import annotations

import os
import signal


def compile_or_crash(path: str, name: str, compute: str, threads: int) -> None:
    crash = {item for item in os.environ.get("TRT_COSY_TEST_CRASH", "").split(",") if item}
    if f"{name}:{compute}" in crash:
        os.kill(os.getpid(), signal.SIGFPE)
    from trt_cosy.runtime.backends.openvino.runner import compile_in_this_process

    compile_in_this_process(path, name, compute, threads)


def die_by_sigfpe() -> None:
    os.kill(os.getpid(), signal.SIGFPE)


def nothing_or_crash(name: str) -> None:
    """Returns at once, or dies by SIGFPE for the names in ``$TRT_COSY_TEST_CRASH``."""
    if name in os.environ.get("TRT_COSY_TEST_CRASH", "").split(","):
        os.kill(os.getpid(), signal.SIGFPE)
