"""Stand-ins for the tuning tests (tests/test_tuning.py): candidate engine folders made by hand and a
timing child that crashes natively part-way (``builder.tuning.measure_in_child``'s ``target``)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from trt_cosy.runtime.manifest import GraphRecord, Manifest
from trt_cosy.runtime.tuning_record import Trial
from trt_cosy.version import __version__

ORT_FILES = {
    "llm": ("llm.onnx",),
    "llm_batch": ("llm_batch.onnx",),
    "flow_encoder": ("flow_encoder.onnx",),
    "flow_estimator": ("flow_estimator.onnx", "flow_estimator.onnx.data"),
    "hift": ("hift.onnx",),
}
OV_FILES = {
    "llm": ("llm.xml", "llm.bin"),
    "flow_encoder": ("flow_encoder.xml", "flow_encoder.bin"),
    "flow_estimator": ("flow_estimator.xml", "flow_estimator.bin"),
    "hift": ("hift.xml", "hift.bin"),
}
SHARED = ("text_embedding.npy", "model_config.json", "tokenizer/vocab.json")


def fake_candidate(out_dir: Path, backend: str, precision: str, checkpoint: dict[str, str]) -> Path:
    """An engines folder whose every file says which candidate wrote it, with a manifest that lists
    them (the graphs' I/O left empty: nothing here is loaded)."""
    out_dir.mkdir(parents=True)
    label = f"{backend}/{precision}"
    layout = ORT_FILES if backend == "onnxruntime" else OV_FILES
    for files in (*layout.values(), SHARED):
        for name in files:
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (out_dir / name).write_text(f"{label} {name}", encoding="utf-8")
    graphs = {name: GraphRecord(file=files[0], inputs=(), outputs=()) for name, files in layout.items()}
    files = {
        path.relative_to(out_dir).as_posix(): path.stat().st_size
        for path in out_dir.rglob("*")
        if path.is_file()
    }
    compile_check = None
    if backend == "openvino":
        compile_check = {
            "machine": "m",
            "cpu": "c",
            "backend_version": "v",
            "threads": [1, 2],
            "graphs": dict.fromkeys(layout, "bf16"),
        }
    Manifest(
        trt_cosy_version=__version__,
        backend=backend,
        precision=precision,
        opset=18,
        checkpoint=checkpoint,
        graphs=graphs,
        files=files,
        nbits_blocks={"llm": 32, "llm_batch": 32} if precision == "int4" else None,
        compile_check=compile_check,
    ).write(out_dir)
    return out_dir


def time_llm_then_crash(out: str, stages: list[str], **_: object) -> None:
    """A timing child that measures the LLM, starts on the flow and dies by SIGSEGV there."""
    trial = Trial("onnxruntime", "int4", "ok", (0.25, 0.27), {"llm_kl_mean": 0.001}).to_dict()
    Path(out).write_text(json.dumps({"trials": {"llm": trial}, "running": "flow"}), encoding="utf-8")
    os.kill(os.getpid(), signal.SIGSEGV)


def fail_with_error(**_: object) -> None:
    raise RuntimeError("the engines would not load here")
