"""The Triton Python-backend model (``TritonPythonModel``) that ``trt-cosy triton-repo`` writes.

Runs only inside Triton's Python-backend stub (it imports ``triton_python_backend_utils``). One
``CosyVoice`` per model instance; requests of an instance run one after another (``--instances``
sets how many run at once). Decoupled (the default): one response per audio chunk and then the final
flag, or with ``stream`` false one response holding the whole audio. Bad input answers that request
with a Triton error carrying the CLI's message; the instance keeps serving.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from ..errors import InputError, TrtCosyError
from .triton_speech import DEFAULT_MAX_TEXT_CHARS, INPUT_NAMES, TritonSpeech

__all__ = ["TritonPythonModel"]

_LOGGER = logging.getLogger(__name__)


def check_numpy_abi() -> None:
    """Refuse a numpy 2 that the stub cannot read: stubs built with pybind11 < 2.12 (Triton 2.51 and
    earlier; fixed in triton-inference-server/python_backend#384) read numpy 2 input tensors as garbage
    (every element a copy of the first, BYTES inputs crash the stub), which would serve noise."""
    if int(np.__version__.split(".")[0]) < 2:
        return
    probe = np.arange(8, dtype=np.float32)  # probe: [8]
    try:
        # from_dlpack builds the array on the C++ side, as request inputs are built.
        back = pb_utils.Tensor.from_dlpack("probe", probe).as_numpy()
    except Exception as exc:  # noqa: BLE001 - a stub without this path: nothing to conclude
        _LOGGER.warning("could not check the stub's numpy support (%s); numpy %s", exc, np.__version__)
        return
    if back.shape != probe.shape or not np.array_equal(back, probe):
        raise TrtCosyError(
            f"this Triton Python-backend stub corrupts numpy {np.__version__} tensors (it was built for numpy "
            "1.x). Put numpy<2 first on the stub's path (`pip install --target DIR 'numpy<2'` and "
            "`trt-cosy triton-repo --python-path DIR ...`) or use a Triton release after 2.51."
        )


def _parameters(model_config: dict[str, Any]) -> dict[str, str]:
    return {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}


def _pin_gpu(args: dict[str, Any]) -> None:
    """KIND_GPU: this instance's stub process sees only its GPU (set before CUDA starts here)."""
    if args.get("model_instance_kind") != "GPU":
        return
    device = int(args["model_instance_device_id"])
    visible = [item for item in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if item.strip()]
    os.environ["CUDA_VISIBLE_DEVICES"] = visible[device] if device < len(visible) else str(device)
    _LOGGER.info("instance %s uses GPU %s", args.get("model_instance_name"), os.environ["CUDA_VISIBLE_DEVICES"])


def _pin_cpu(args: dict[str, Any], parameters: dict[str, str], threads: int | None) -> int | None:
    """KIND_CPU: pin this instance's stub process to its own cores (its slot of the machine's plan for
    ``cpu_instances`` instances, ``cpu_budget.pin_replica``); returns the threads per graph to load with."""
    if args.get("model_instance_kind") != "CPU" or not parameters.get("cpu_instances"):
        return threads
    from ..runtime.cpu_budget import pin_replica

    # One key per model of one repository, the same in every instance's stub process.
    repository = hashlib.sha1(str(args.get("model_repository", "")).encode()).hexdigest()[:12]
    key = f"triton-{args.get('model_name', 'model')}-{repository}"
    slot = pin_replica(int(parameters["cpu_instances"]), threads, key)
    if slot is None:
        return threads
    return slot.threads


class TritonPythonModel:
    """Triton's entry points: ``initialize``, ``execute``, ``finalize``."""

    def initialize(self, args: dict[str, Any]) -> None:
        check_numpy_abi()
        model_config = json.loads(args["model_config"])
        parameters = _parameters(model_config)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        _pin_gpu(args)
        from ..runtime.manifest import Manifest
        from ..synthesis import EngineConfig
        from ..tts import CosyVoice

        engines = Path(parameters["engines"])
        threads = int(parameters["threads"]) if parameters.get("threads") else None
        threads = _pin_cpu(args, parameters, threads)
        backend = Manifest.read(engines).backend
        tts = CosyVoice.load(engines, backend=backend, config=EngineConfig(threads=threads))
        voices = None
        if parameters.get("voices_dir"):
            from ..server.voices_store import VoiceStore

            voices = VoiceStore(parameters["voices_dir"], tts.model_id)
            voices.load()
        max_chars = int(parameters.get("max_text_chars") or DEFAULT_MAX_TEXT_CHARS)
        self.speech = TritonSpeech(tts, voices, max_chars)
        self.sample_rate = np.array([tts.sample_rate], dtype=np.int32)  # sample_rate: [1]
        self.text_streaming = parameters.get("text_streaming") == "true"
        self._sequences: dict[int, _Sequence] = {}  # text-streaming sequences by correlation id
        self._sequences_lock = threading.Lock()
        _LOGGER.info("%s ready: %s from %s (decoupled %s)", args["model_instance_name"], tts.model_id, engines,
                     self.decoupled)

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self.text_streaming:
            for request in requests:
                self._sequence_request(request, request.get_response_sender())
            return None
        if self.decoupled:
            for request in requests:
                self._stream(request, request.get_response_sender())
            return None
        return [self._single(request) for request in requests]

    def finalize(self) -> None:
        with self._sequences_lock:
            sequences = list(self._sequences.values())
        for sequence in sequences:
            sequence.text.abort()
        self.speech = None

    # ------------------------------------------------------------------ text streaming (sequences)

    def _sequence_request(self, request: Any, sender: Any) -> None:
        """One request of a text-streaming sequence. START: the voice and the first piece; its responses
        carry the audio (a thread sends them while later requests bring text). Others: a piece; END on
        the last. A non-START request is answered at once with an empty final response."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            start, end = bool(_control(request, "START")), bool(_control(request, "END"))
            corrid = int(_control(request, "CORRID"))
            inputs = _inputs(request)
            if start:
                text, chunks = self.speech.text_stream(inputs)
                sequence = _Sequence(text, chunks, sender, self._response, self.speech.max_text_chars)
                with self._sequences_lock:
                    previous = self._sequences.pop(corrid, None)
                    self._sequences[corrid] = sequence
                if previous is not None:  # a sequence restarted without END
                    previous.text.abort()
                sequence.start(lambda: self._forget(corrid, sequence))
                if end:
                    text.end()
                return
            with self._sequences_lock:
                sequence = self._sequences.get(corrid)
            if sequence is None:
                raise InputError(
                    f"sequence {corrid} has no text stream: its first request must have sequence_start set "
                    "(with the voice), or the stream has ended."
                )
            unknown = sorted(set(inputs) - {"text"})
            if unknown:
                raise InputError(f"after the first request of a sequence only 'text' is taken, got {unknown}.")
            if "text" in inputs:
                sequence.put(_text_piece(inputs["text"]))
            if end:
                sequence.text.end()
            sender.send(flags=final)
        except Exception as exc:  # noqa: BLE001 - this request is answered, the sequence and instance go on
            sender.send(pb_utils.InferenceResponse(error=_error(exc)), flags=final)

    def _forget(self, corrid: int, sequence: _Sequence) -> None:
        with self._sequences_lock:
            if self._sequences.get(corrid) is sequence:
                del self._sequences[corrid]

    # ------------------------------------------------------------------ decoupled

    def _stream(self, request: Any, sender: Any) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            inputs, chunks = self.speech.chunks(_inputs(request))
            if not inputs.stream:
                audio = _concatenate(chunks)
                sender.send(self._response(audio), flags=final)  # exactly one response (HTTP generate)
                return
            for audio in chunks:
                if _cancelled(sender):
                    chunks.close()
                    break
                sender.send(self._response(audio))
            sender.send(flags=final)
        except Exception as exc:  # noqa: BLE001 - every failure answers this request, the instance stays up
            sender.send(pb_utils.InferenceResponse(error=_error(exc)), flags=final)

    # ------------------------------------------------------------------ one response per request

    def _single(self, request: Any) -> Any:
        try:
            inputs, chunks = self.speech.chunks(_inputs(request))
            if inputs.stream:
                chunks.close()
                raise InputError(
                    "stream is true but this model is not decoupled; send stream false, or use the decoupled "
                    "model (`trt-cosy triton-repo` without --no-decoupled) with gRPC streaming."
                )
            return self._response(_concatenate(chunks))
        except Exception as exc:  # noqa: BLE001
            return pb_utils.InferenceResponse(error=_error(exc))

    def _response(self, audio: np.ndarray) -> Any:
        return pb_utils.InferenceResponse(
            output_tensors=[pb_utils.Tensor("audio", audio), pb_utils.Tensor("sample_rate", self.sample_rate)]
        )


class _Sequence:
    """A text-streaming sequence: its text, and the thread sending its audio on the START request's sender."""

    def __init__(self, text: Any, chunks: Any, sender: Any, response: Any, max_chars: int):
        self.text, self.chunks, self.sender, self.response = text, chunks, sender, response
        self.max_chars = max_chars

    def put(self, piece: str) -> None:
        if self.text.chars + len(piece) > self.max_chars:
            raise InputError(f"the sequence's text is longer than {self.max_chars} characters; end it and start another.")
        self.text.put(piece)

    def start(self, done: Any) -> None:
        threading.Thread(target=self._send, args=(done,), name="trt-cosy-triton-sequence", daemon=True).start()

    def _send(self, done: Any) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            for audio in self.chunks:
                if _cancelled(self.sender):
                    break
                self.sender.send(self.response(audio))
            self.sender.send(flags=final)
        except Exception as exc:  # noqa: BLE001 - answered on the START request's stream
            self.sender.send(pb_utils.InferenceResponse(error=_error(exc)), flags=final)
        finally:
            self.chunks.close()
            self.text.abort()
            done()


def _control(request: Any, name: str) -> int:
    """A sequence batcher control input (``START``, ``END``: 0/1; ``CORRID``), 0 when absent."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return int(tensor.as_numpy().reshape(-1)[0]) if tensor is not None else 0


def _text_piece(array: np.ndarray) -> str:
    value = np.asarray(array).reshape(-1)
    if value.size != 1:
        raise InputError(f"input 'text' must hold exactly one element, got {value.size}.")
    item = value[0]
    try:
        return bytes(item).decode("utf-8") if isinstance(item, bytes | np.bytes_) else str(item)
    except UnicodeDecodeError:
        raise InputError("input 'text' is not UTF-8 text; send it UTF-8 encoded.") from None


def _inputs(request: Any) -> dict[str, np.ndarray]:
    inputs = {}
    for name in INPUT_NAMES:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            inputs[name] = tensor.as_numpy()
    return inputs


def _concatenate(chunks: Any) -> np.ndarray:
    parts = list(chunks)
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)  # audio: [N]


def _cancelled(sender: Any) -> bool:
    is_cancelled = getattr(sender, "is_cancelled", None)
    return bool(is_cancelled()) if is_cancelled is not None else False


def _error(exc: Exception) -> Any:
    if isinstance(exc, TrtCosyError):
        message, code = str(exc), "INVALID_ARG"
    else:
        _LOGGER.error("internal error", exc_info=exc)
        message, code = f"internal error ({type(exc).__name__}: {exc}); see the Triton server log.", "INTERNAL"
    try:
        return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    except (AttributeError, TypeError):  # a stub without error codes
        return pb_utils.TritonError(message)
