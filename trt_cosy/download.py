"""Releases and engines in the local cache: ``trt-cosy download`` and the engines ``say`` builds on demand.

Cache layout (root ``~/.cache/trt-cosy``, or ``$TRT_COSY_CACHE``)::

    models/<name>/                                  a downloaded release (only the files inference needs)
    engines/<release name>-<key>/<backend>-<precision>/  engines built from a release (e.g. onnxruntime-int4,
                                                    tensorrt-fp16: runtime.backend_choice picks them); <key>
                                                    hashes the names, sizes and mtimes of its checkpoint files

huggingface_hub / modelscope are imported only when a download is needed (the ``download`` extra);
torch only when engines must be built (the ``build`` extra).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from .cache_dir import cache_root
from .errors import EngineMismatchError, InputError, ModelDirError, TrtCosyError, require
from .runtime.backend_choice import DEFAULT_PRECISIONS, BackendChoice, resolve_backend

__all__ = ["DEFAULT_MODEL", "SOURCES", "cache_root", "download_model", "engines_cache_dir", "prepare_engines"]

_LOGGER = logging.getLogger(__name__)

DEFAULT_MODEL: Final = "CosyVoice2-0.5B"
SOURCES: Final = ("huggingface", "modelscope")
# Short names -> repository id per source.
_KNOWN_MODELS: Final = {
    "CosyVoice2-0.5B": {"huggingface": "FunAudioLLM/CosyVoice2-0.5B", "modelscope": "iic/CosyVoice2-0.5B"},
}
# What inference needs from a CosyVoice2 release: not the 1 GB Qwen safetensors (llm.pt overwrites
# them), the TorchScript files or the pre-exported estimator.
_RELEASE_FILES: Final = (
    "cosyvoice2.yaml",
    "llm.pt",
    "flow.pt",
    "hift.pt",
    "campplus.onnx",
    "speech_tokenizer_v2.onnx",
    "CosyVoice-BlankEN/config.json",
    "CosyVoice-BlankEN/vocab.json",
    "CosyVoice-BlankEN/merges.txt",
)
_ALLOW_PATTERNS: Final = [*_RELEASE_FILES, "CosyVoice-BlankEN/*.json"]
_WEB: Final = {"huggingface": "https://huggingface.co/", "modelscope": "https://www.modelscope.cn/"}
# DEFAULT_PRECISIONS (runtime.backend_choice): what each backend builds when no --precision is given
# (docs/precision.md, "Default"): weight-only int4 LLM + int8 flow on CPUs, fp16 plans on GPUs.

Progress = Callable[[str], None]



def _repo_id(name: str, source: str) -> str:
    if source not in SOURCES:
        raise InputError(f"unknown download source {source!r}; use one of {', '.join(SOURCES)}.")
    if "/" in name:
        return name
    if name not in _KNOWN_MODELS:
        raise InputError(
            f"unknown model {name!r}; known: {', '.join(_KNOWN_MODELS)}, or pass a repository id "
            "such as FunAudioLLM/CosyVoice2-0.5B."
        )
    return _KNOWN_MODELS[name][source]


def _is_complete(release: Path) -> bool:
    return all((release / name).is_file() for name in _RELEASE_FILES)


class _Unreachable(OSError):
    """The source's host did not answer a connection (no network, DNS, firewall)."""


_PROBE_TIMEOUT_S: Final = 5.0
_HOSTS: Final = {  # (environment variable that relocates the hub, default address)
    "huggingface": ("HF_ENDPOINT", "https://huggingface.co"),
    "modelscope": ("MODELSCOPE_DOMAIN", "www.modelscope.cn"),
}
_CLIENTS: Final = {"huggingface": "huggingface_hub", "modelscope": "modelscope"}
_PROXY_VARIABLES: Final = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")


def _probe(source: str) -> None:
    """Fail within seconds when ``source``'s host cannot be reached (modelscope alone would retry for
    half a minute). Skipped behind a proxy, where only the hub client knows the way."""
    import socket
    from urllib.parse import urlsplit

    if any(os.environ.get(name) for name in _PROXY_VARIABLES):
        return
    variable, default = _HOSTS[source]
    address = os.environ.get(variable) or default
    parts = urlsplit(address if "//" in address else f"https://{address}")
    host, port = parts.hostname, parts.port or (80 if parts.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        raise _Unreachable(f"cannot reach {host}:{port}: {exc}") from exc


def _check_client(source: str) -> None:
    """Raise MissingDependencyError when ``source``'s client is not installed, without importing it
    (``import modelscope`` alone takes seconds, and it waits on the network when there is none)."""
    import importlib.util

    module = _CLIENTS[source]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a broken or blocked installation
        found = False
    if not found:
        require(module, "download")  # raises, naming the extra (or imports what find_spec missed)


def _is_network_error(exc: BaseException) -> bool:
    """True for the failures of an unreachable hub (each client has its own classes for them)."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    network = {"ConnectionError", "ConnectError", "Timeout", "TimeoutError", "TimeoutException",
               "LocalEntryNotFoundError", "ProxyError", "gaierror"}
    return isinstance(exc, (_Unreachable, ConnectionError, TimeoutError)) or bool(names & network)


def _offline_hint(repo: str, source: str) -> str:
    return (
        f"Without network access, download the release on another machine (`trt-cosy download`, or "
        f"`git lfs install && git clone {_WEB[source]}{repo}`: the checkpoints are git-lfs files, a clone "
        "without git-lfs has only pointers), copy it here and pass --model-dir DIR. To try trt-cosy offline "
        "meanwhile: `trt-cosy make-test-model --out models/tiny` writes a random-weight model (noise-like "
        "audio; needs the [build] extra), then `trt-cosy say ... --model-dir models/tiny`."
    )


def download_model(
    name: str = DEFAULT_MODEL,
    source: str = "huggingface",
    target: Path | None = None,
    progress: Progress | None = None,
) -> Path:
    """Fetch a release (only the files inference needs) into ``target`` and return it.

    ``target`` defaults to ``<cache>/models/<name>``; a complete release already there is reused.
    When ``source`` cannot be reached, a known model (``CosyVoice2-0.5B``) is tried from the other
    source (``progress`` says so). A folder this call created is removed again when nothing could be
    downloaded into it.

    Raises:
        InputError: unknown model or source.
        MissingDependencyError: huggingface_hub / modelscope is not installed.
        TrtCosyError: the download failed (no network...): the message says how to go on offline.
    """
    repo = _repo_id(name, source)
    target = Path(target) if target is not None else cache_root() / "models" / repo.rsplit("/", 1)[-1]
    if _is_complete(target):
        _LOGGER.info("release %s already in %s", repo, target)
        return target
    # A repository id names one source's repository; a known name has one on each source.
    sources = [source] + ([other for other in SOURCES if other != source] if "/" not in name else [])
    created = not target.exists()
    failures: list[str] = []
    try:
        for index, current in enumerate(sources):
            current_repo = _repo_id(name, current)
            try:
                _check_client(current)  # a missing client is said before any network wait
                _probe(current)
                target.mkdir(parents=True, exist_ok=True)
                _fetch(current_repo, current, target)
                break
            except Exception as exc:  # network, HTTP and hub errors have no common base class
                failures.append(f"{current} ({type(exc).__name__}: {exc})")
                if index + 1 < len(sources) and _is_network_error(exc):
                    if progress is not None:
                        progress(f"could not reach {current} ({exc}); trying {sources[index + 1]}")
                    continue
                if isinstance(exc, TrtCosyError) and len(failures) == 1:
                    raise
                raise TrtCosyError(
                    f"could not download {name} from {'; '.join(failures)}. {_offline_hint(repo, source)}"
                ) from exc
    except BaseException:
        if created:
            _remove_if_empty(target)
        raise
    missing = [name for name in _RELEASE_FILES if not (target / name).is_file()]
    if missing:
        raise ModelDirError(
            f"{repo} was downloaded to {target} but lacks {', '.join(missing)}; is it a CosyVoice2 release? "
            "Pass the folder of one with --model-dir."
        )
    return target


def _fetch(repo: str, source: str, target: Path) -> None:
    if source == "huggingface":
        hub = require("huggingface_hub", "download")
        hub.snapshot_download(repo, local_dir=str(target), allow_patterns=list(_ALLOW_PATTERNS))
        return
    require("modelscope", "download")
    from modelscope import snapshot_download

    try:
        snapshot_download(repo, local_dir=str(target), allow_patterns=list(_ALLOW_PATTERNS))
    except TypeError:  # modelscope releases before allow_patterns / local_dir
        snapshot_download(repo, local_dir=str(target))


def _remove_if_empty(target: Path) -> None:
    """Remove ``target`` when it holds no file of a release (only the hub clients' bookkeeping)."""
    import shutil

    if target.is_dir() and not any(path.is_file() and ".cache" not in path.parts for path in target.rglob("*")):
        shutil.rmtree(target, ignore_errors=True)


def _checkpoint_key(model_dir: Path) -> str:
    """A cheap fingerprint of a release: names, sizes and mtimes of its checkpoint files (any family)."""
    from .runtime.manifest import checkpoint_files

    stats = []
    for name in checkpoint_files(model_dir):  # raises ModelDirError naming what is missing
        stat = (model_dir / name).stat()
        stats.append([name, stat.st_size, stat.st_mtime_ns])
    return hashlib.sha256(json.dumps(stats).encode("utf-8")).hexdigest()[:16]


def engines_cache_dir(model_dir: Path, precision: str | None = None, backend: str = "onnxruntime") -> Path:
    """Where engines built from ``model_dir`` for ``backend`` at ``precision`` (default: the backend's
    default) live in the cache."""
    precision = precision or DEFAULT_PRECISIONS[backend]
    model_dir = Path(model_dir).resolve()
    return (
        cache_root()
        / "engines"
        / f"{model_dir.name}-{_checkpoint_key(model_dir)}"
        / f"{backend}-{precision}"
    )


def prepare_engines(
    model_dir: Path,
    progress: Progress | None = None,
    precision: str | None = None,
    backend: str | None = None,
) -> Path:
    """Engines for ``model_dir`` from the cache, built there first when missing or stale.

    ``backend`` None or ``"auto"``: the machine's pick (``runtime.backend_choice``: TensorRT fp16 with
    a CUDA GPU and TensorRT, else the fastest CPU engines), said in one ``progress`` line; an explicit
    backend wins. ``precision`` defaults to the backend's (``DEFAULT_PRECISIONS``).
    Current engines are used without torch; building needs the ``build`` extra (torch, onnx).
    """
    choice = resolve_backend(backend, precision)
    if progress is not None:
        progress(choice.line())
    return _prepare(model_dir, choice, progress)


def _prepare(model_dir: Path, choice: BackendChoice, progress: Progress | None) -> Path:
    from .runtime.manifest import Manifest

    backend, precision = choice.backend, choice.precision
    out_dir = engines_cache_dir(model_dir, precision, backend)
    try:
        Manifest.read(out_dir).check(out_dir, backend=backend, precision=precision)
        return out_dir
    except EngineMismatchError as exc:
        _LOGGER.info("building engines: %s", exc)
    if progress is not None:
        progress(
            f"building {backend}/{precision} engines for {model_dir} into {out_dir} (first use; takes a while)"
        )
    require("torch", "build")
    require("onnx", "build")
    from .builder.engines import build_engines

    return build_engines(
        model_dir, out_dir, backend=backend, precision=precision, progress=progress, backend_reason=choice.reason
    )
