"""TensorRT plan records: what a ``plans/<graph>.plan`` was built from and for (house style P8).

``plans/<graph>.json`` holds a ``PlanRecord``; ``plan_mismatch`` says why a plan must not run on this
system with these engines (another GPU, compute capability or TensorRT version; another checkpoint,
precision, profile set, ONNX graph; fewer slots than wanted). No TensorRT import here.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "PLANS_DIR",
    "TENSOR_ALIGNMENT",
    "PlanRecord",
    "checkpoint_digest",
    "current_system",
    "plan_mismatch",
]

PLANS_DIR: Final = "plans"  # per GPU and TensorRT version: <graph>.plan, <graph>.json, timing.cache


# IExecutionContext::setTensorAddress: "The pointer must have at least 256-byte alignment."
TENSOR_ALIGNMENT: Final = 256


@dataclass(frozen=True)
class PlanRecord:
    """``plans/<graph>.json``: what a plan was built from and for (house style P8)."""

    graph: str
    onnx: str
    onnx_sha256: str
    precision: str
    checkpoint: str  # checkpoint_digest() of the release files' sha256
    profiles: dict[str, Any]  # GraphProfiles.to_dict()
    plan: str | None = None
    system: dict[str, str] | None = None  # current_system(): gpu, compute_capability, tensorrt
    trt_cosy_version: str = ""
    slots: int = 1  # concurrent execution contexts: the plan holds every profile this many times

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> PlanRecord:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


def checkpoint_digest(hashes: Mapping[str, str]) -> str:
    """One sha256 over a release's per-file sha256 (``manifest.hash_checkpoint``)."""
    text = json.dumps(dict(sorted(hashes.items())), separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def current_system(trt: Any, device: int = 0) -> dict[str, str]:
    """What a plan is tied to: GPU name, compute capability and TensorRT version."""
    from .cuda import device_info

    info = device_info(device)
    return {
        "gpu": info["name"],
        "compute_capability": info["compute_capability"],
        "tensorrt": str(trt.__version__),
    }


def plan_mismatch(
    record: PlanRecord,
    system: Mapping[str, str],
    *,
    checkpoint: str | None = None,
    precision: str | None = None,
    profiles: Mapping[str, Any] | None = None,
    onnx_sha256: str | None = None,
    slots: int | None = None,
) -> str | None:
    """Why ``record``'s plan must not run on ``system`` with these inputs, or None when it may
    (``slots``: the concurrent contexts wanted; a plan built for more serves fewer)."""
    built = record.system or {}
    if not built:
        return "no plan was built (--onnx-only)"
    for key, label in (
        ("gpu", "GPU"),
        ("compute_capability", "compute capability"),
        ("tensorrt", "TensorRT"),
    ):
        if str(built.get(key)) != str(system.get(key)):
            return f"built for {label} {built.get(key)}, this is {system.get(key)}"
    checks = (
        ("checkpoint", checkpoint, record.checkpoint),
        ("precision", precision, record.precision),
        ("profiles", profiles, record.profiles),
        ("ONNX graph", onnx_sha256, record.onnx_sha256),
    )
    for label, wanted, found in checks:
        if wanted is not None and wanted != found:
            return f"the {label} changed since the plan was built"
    if slots is not None and int(record.slots) < int(slots):
        return f"built for {record.slots} concurrent slot(s), {slots} wanted"
    return None
