"""``manifest.json`` of an engines directory: what was built, from which checkpoint, and how to check it.

numpy/json only (no torch, no onnx): the runtime reads and checks it before loading any graph.
``Manifest.check`` turns every way engines can be stale (missing or resized files, another
trt-cosy version, backend or precision, a changed checkpoint) into ``EngineMismatchError`` whose
message gives the ``trt-cosy build`` command that fixes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Final

from ..config import QWEN_DIR, YAML_BY_FAMILY
from ..errors import EngineMismatchError, ModelDirError
from ..family_lookup import family_named, family_of_release
from ..version import __version__
from .tuning_record import TuningRecord

__all__ = [
    "MANIFEST_NAME",
    "CHECKPOINT_FILES",
    "CHECKPOINT_FILES_BY_FAMILY",
    "OPTIONAL_CHECKPOINT_FILES",
    "checkpoint_files",
    "TensorRecord",
    "GraphRecord",
    "Manifest",
    "file_sha256",
    "hash_checkpoint",
    "model_config_from_dict",
]

_LOGGER = logging.getLogger(__name__)

MANIFEST_NAME: Final = "manifest.json"
_FORMAT: Final = 1
# The release files whose content decides what the engines compute, per family (CosyVoice 1 has no Qwen).
_WEIGHTS: Final = ("llm.pt", "flow.pt", "hift.pt")
CHECKPOINT_FILES_BY_FAMILY: Final = {
    "v1": (YAML_BY_FAMILY["v1"], *_WEIGHTS),
    "v2": (YAML_BY_FAMILY["v2"], *_WEIGHTS, f"{QWEN_DIR}/config.json"),
    "v3": (YAML_BY_FAMILY["v3"], *_WEIGHTS, f"{QWEN_DIR}/config.json"),
}
CHECKPOINT_FILES: Final = CHECKPOINT_FILES_BY_FAMILY["v2"]  # CosyVoice2 (the default release)
# Hashed when present: the -SFT/-Instruct preset speakers and the whisper ranks the engines carry
# (adding either to a release makes its engines stale, so the next build picks them up).
OPTIONAL_CHECKPOINT_FILES: Final = {"v1": ("spk2info.pt", "multilingual.tiktoken"), "v2": (), "v3": ()}
_FAMILY_NAMES: Final = {"v1": "CosyVoice-300M(-SFT/-Instruct)", "v2": "CosyVoice2", "v3": "Fun-CosyVoice3"}
_HASH_BLOCK: Final = 1 << 20


@dataclass(frozen=True)
class TensorRecord:
    """One graph input or output as exported: symbolic dims are strings (``"T"``, ``"P + T"``)."""

    name: str
    dtype: str
    shape: tuple[str | int, ...]


@dataclass(frozen=True)
class GraphRecord:
    """One exported graph: its file, its I/O and the ORT-vs-torch error measured at export.

    ``backend``: the runtime that runs this graph, set only in ``"mixed"`` engines (one backend per
    graph, ``runtime.engines``); None means the manifest's own backend. ``compute``: the precision
    this graph computes in when the build had to fall back from the engines' plan (an OpenVINO graph
    whose bf16 compile crashed on the build machine runs in fp32), with ``compute_reason`` saying why;
    None: the plan (``runtime.backends.openvino.runner.graph_precisions``).
    """

    file: str
    inputs: tuple[TensorRecord, ...]
    outputs: tuple[TensorRecord, ...]
    max_errors: dict[str, float] = field(default_factory=dict)
    backend: str | None = None
    compute: str | None = None
    compute_reason: str | None = None


@dataclass(frozen=True)
class Manifest:
    """The record of one ``trt-cosy build``; ``files`` maps each path (relative) to its size in bytes."""

    trt_cosy_version: str
    backend: str
    precision: str
    opset: int
    checkpoint: dict[str, str]  # release-relative path -> sha256
    graphs: dict[str, GraphRecord]
    files: dict[str, int]
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    format: int = _FORMAT
    # Why this backend/precision (``runtime.backend_choice``); optional: older manifests lack it.
    backend_reason: str | None = None
    # graph -> MatMulNBits block size along K of its n-bit weights (int8/int4 ONNX Runtime and mixed
    # engines; ``builder.quantize.engines.nbits_blocks``). None: fp32 or other engines, or a manifest written
    # before it was recorded (those engines hold block 32).
    nbits_blocks: dict[str, int] | None = None
    # The machine the build compiled each natively compiled graph on in a child process
    # (``runtime.native_guard``): ``{"machine": key, "cpu": ..., "backend_version": ..., "graphs": {name:
    # compute}}``. A load on a machine with the same key and library version compiles those graphs at
    # once; elsewhere each is checked in a child first. None: nothing checked (ONNX Runtime engines).
    compile_check: dict[str, Any] | None = None
    # What a tuned build measured and chose per stage (``runtime.tuning_record``); None: not tuned.
    tuning: TuningRecord | None = None

    def to_dict(self) -> dict[str, Any]:
        raw = dataclasses.asdict(self)
        if self.tuning is None:
            del raw["tuning"]
        else:
            raw["tuning"] = self.tuning.to_dict()
        if raw["nbits_blocks"] is None:  # engines without n-bit weights keep the manifest they always had
            del raw["nbits_blocks"]
        if raw["compile_check"] is None:
            del raw["compile_check"]
        for graph in raw["graphs"].values():  # single-backend engines keep the manifest they always had
            for optional in ("backend", "compute", "compute_reason"):
                if graph[optional] is None:
                    del graph[optional]
        return raw

    def graph_backend(self, name: str) -> str:
        """The backend that runs graph ``name``: its own (mixed engines) or the manifest's."""
        return self.graphs[name].backend or self.backend

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Manifest:
        graphs = {
            name: GraphRecord(
                file=str(graph["file"]),
                inputs=tuple(_tensor(t) for t in graph["inputs"]),
                outputs=tuple(_tensor(t) for t in graph["outputs"]),
                max_errors={k: float(v) for k, v in graph.get("max_errors", {}).items()},
                backend=None if graph.get("backend") is None else str(graph["backend"]),
                compute=None if graph.get("compute") is None else str(graph["compute"]),
                compute_reason=None if graph.get("compute_reason") is None else str(graph["compute_reason"]),
            )
            for name, graph in raw["graphs"].items()
        }
        return cls(
            trt_cosy_version=str(raw["trt_cosy_version"]),
            backend=str(raw["backend"]),
            precision=str(raw["precision"]),
            opset=int(raw["opset"]),
            checkpoint={str(k): str(v) for k, v in raw["checkpoint"].items()},
            graphs=graphs,
            files={str(k): int(v) for k, v in raw["files"].items()},
            created=str(raw["created"]),
            format=int(raw.get("format", _FORMAT)),
            backend_reason=None if raw.get("backend_reason") is None else str(raw["backend_reason"]),
            nbits_blocks=None
            if raw.get("nbits_blocks") is None
            else {str(k): int(v) for k, v in raw["nbits_blocks"].items()},
            compile_check=None if raw.get("compile_check") is None else dict(raw["compile_check"]),
            tuning=None if raw.get("tuning") is None else TuningRecord.from_dict(raw["tuning"]),
        )

    def write(self, engines_dir: Path) -> Path:
        path = Path(engines_dir) / MANIFEST_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    @classmethod
    def read(cls, engines_dir: Path) -> Manifest:
        """Read ``engines_dir/manifest.json``; missing or malformed raises ``EngineMismatchError``."""
        engines_dir = Path(engines_dir)
        path = engines_dir / MANIFEST_NAME
        if not path.is_file():
            what = "does not exist" if not engines_dir.is_dir() else f"has no {MANIFEST_NAME}"
            raise EngineMismatchError(f"engines directory {engines_dir} {what}. {_remedy(engines_dir)}")
        try:
            return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EngineMismatchError(
                f"{path} is unreadable or malformed ({exc!r}). {_remedy(engines_dir)}"
            ) from exc

    def check(
        self,
        engines_dir: Path,
        model_dir: Path | None = None,
        *,
        backend: str | None = None,
        precision: str | None = None,
        checkpoint_hashes: Mapping[str, str] | None = None,
    ) -> None:
        """Raise ``EngineMismatchError`` unless these engines are complete and current.

        Checks the trt-cosy version, ``backend``/``precision`` (when given), that every listed file
        exists with its recorded size, and — when ``model_dir`` (hashed here) or precomputed
        ``checkpoint_hashes`` are given — that the checkpoint is the one the engines were built from.
        """
        engines_dir = Path(engines_dir)
        remedy = _remedy(engines_dir, model_dir)
        if self.format != _FORMAT or self.trt_cosy_version != __version__:
            raise EngineMismatchError(
                f"engines in {engines_dir} were built by trt-cosy {self.trt_cosy_version} (manifest format "
                f"{self.format}); this is trt-cosy {__version__}. {remedy}"
            )
        for label, wanted, found in (
            ("backend", backend, self.backend),
            ("precision", precision, self.precision),
        ):
            if wanted is not None and wanted != found:
                raise EngineMismatchError(
                    f"engines in {engines_dir} were built for {label} '{found}', not '{wanted}'. {remedy}"
                )
        self._check_files(engines_dir, remedy)
        if checkpoint_hashes is None and model_dir is not None:
            checkpoint_hashes = hash_checkpoint(model_dir)
        if checkpoint_hashes is not None:
            changed = sorted(
                k
                for k in {*self.checkpoint, *checkpoint_hashes}
                if self.checkpoint.get(k) != checkpoint_hashes.get(k)
            )
            if changed:
                raise EngineMismatchError(
                    f"engines in {engines_dir} were built from another checkpoint: {', '.join(changed)} "
                    f"changed. {remedy}"
                )

    def _check_files(self, engines_dir: Path, remedy: str) -> None:
        for name, size in self.files.items():
            path = engines_dir / name
            if not path.is_file():
                raise EngineMismatchError(f"engines in {engines_dir} lack {name}. {remedy}")
            if path.stat().st_size != size:
                raise EngineMismatchError(
                    f"{path} has {path.stat().st_size} bytes, the manifest records {size} (a partial copy?). "
                    f"{remedy}"
                )
        missing = [graph.file for graph in self.graphs.values() if graph.file not in self.files]
        if missing:
            raise EngineMismatchError(f"{engines_dir}/{MANIFEST_NAME} lists no size for {missing}. {remedy}")


def _tensor(raw: Mapping[str, Any]) -> TensorRecord:
    shape = tuple(dim if isinstance(dim, str) else int(dim) for dim in raw["shape"])
    return TensorRecord(name=str(raw["name"]), dtype=str(raw["dtype"]), shape=shape)


def _remedy(engines_dir: Path, model_dir: Path | None = None) -> str:
    model = model_dir if model_dir is not None else "DIR"
    return f"Rebuild them: run `trt-cosy build --model-dir {model} --out {engines_dir}`."


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 1 MiB blocks (the LLM checkpoint is ~2 GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_HASH_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def checkpoint_files(model_dir: Path) -> tuple[str, ...]:
    """The files of ``model_dir`` whose sha256 identifies its engines: the family's required files
    (``CHECKPOINT_FILES_BY_FAMILY``) plus the optional ones it has. ``ModelDirError`` when one is missing."""
    model_dir = Path(model_dir)
    family = family_of_release(model_dir).name  # raises ModelDirError for a missing dir or one without a yaml
    required = CHECKPOINT_FILES_BY_FAMILY[family]
    missing = [name for name in required if not (model_dir / name).is_file()]
    if missing:
        raise ModelDirError(
            f"{model_dir} lacks {', '.join(missing)}; pass an official {_FAMILY_NAMES[family]} release "
            f"directory ({', '.join(required)})."
        )
    optional = [name for name in OPTIONAL_CHECKPOINT_FILES[family] if (model_dir / name).is_file()]
    return (*required, *optional)


def hash_checkpoint(model_dir: Path) -> dict[str, str]:
    """sha256 of each of ``checkpoint_files(model_dir)``; a missing required file raises ``ModelDirError``."""
    model_dir = Path(model_dir)
    return {name: file_sha256(model_dir / name) for name in checkpoint_files(model_dir)}


def model_config_from_dict(raw: Mapping[str, Any]) -> Any:
    """Rebuild a model config from its ``to_dict()`` (after a JSON round trip).

    ``raw["family"]`` picks the class (``Family.config_class``: ``V1ModelConfig``, ``ModelConfig``,
    ``V3ModelConfig``); an unknown family raises ``EngineMismatchError``. Nested dataclasses are rebuilt from their field types; lists
    become tuples where the field is a tuple. Missing fields take their defaults; unknown keys
    raise ``EngineMismatchError``.
    """
    family = raw.get("family", "v2") if isinstance(raw, Mapping) else "v2"
    cls = family_named(family).config_class
    try:
        return _from_dict(cls, raw)
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineMismatchError(
            f"model_config.json does not describe a model this trt-cosy knows ({exc!r}). Rebuild the engines "
            "with `trt-cosy build`."
        ) from exc


def _from_dict(cls: type, raw: Mapping[str, Any]) -> Any:
    if not isinstance(raw, Mapping):
        raise TypeError(f"{cls.__name__} needs an object, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(raw) - names
    if unknown:
        raise KeyError(f"unknown {cls.__name__} fields {sorted(unknown)}")
    return cls(**{name: _convert(hints[name], value) for name, value in raw.items()})


def _convert(hint: Any, value: Any) -> Any:
    origin = typing.get_origin(hint)
    if dataclasses.is_dataclass(hint):
        return _from_dict(hint, value)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], item) for item in value)
        return tuple(_convert(arg, item) for arg, item in zip(args, value, strict=True))
    return value
