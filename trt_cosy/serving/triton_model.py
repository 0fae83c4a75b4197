"""The Triton Python-backend model (``TritonPythonModel``) that ``trt-cosy triton-repo`` writes.

Runs only inside Triton's Python-backend stub (it imports ``triton_python_backend_utils``). One
``CosyVoice`` per model instance. Decoupled (the default): one response per audio chunk and then the
final flag, or with ``stream`` false one response holding the whole audio. Bad input answers that request
with a Triton error carrying the CLI's message; the instance keeps serving.

Admission by expected work (``triton_admission``, the rule of ``trt-cosy serve``): the decoupled
``execute`` plans each request as it arrives, refuses at once what cannot finish within its timeout
(UNAVAILABLE with the seconds to wait, or INVALID_ARG when it never could here), and hands the rest to
the instance's ``max_concurrent`` worker threads in the predicted order, then returns: Triton's queue
stays empty and the model sees all the work. Without a decoupled policy ``execute`` must answer before
the next request is seen, so requests run one at a time per instance and wait in Triton's queue
(``default_queue_policy``); only what could never finish is refused there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from ..errors import InputError, TrtCosyError
from .triton_admission import PriorityWorkers, RequestTimedOut, TritonTicket, TritonWork
from .triton_speech import DEFAULT_MAX_TEXT_CHARS, INPUT_NAMES, TritonSpeech, samples_of

__all__ = ["TritonPythonModel"]

_LOGGER = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 300.0  # trt-cosy serve's request timeout
DEFAULT_MAX_CONCURRENT = 4


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
        timeout_s = float(parameters.get("request_timeout_s") or DEFAULT_TIMEOUT_S)
        enabled = parameters.get("work_admission", "true").lower() != "false"
        events = _TritonMetrics.create(args["model_name"], args["model_instance_name"])
        self.work = TritonWork(tts, timeout_s, enabled, events)
        if enabled:
            from ..server.work_model import warm_up

            self.work.calibrate(warm_up(tts))
        self.workers = None
        if self.decoupled:
            concurrent = int(parameters.get("max_concurrent") or DEFAULT_MAX_CONCURRENT)
            self.workers = PriorityWorkers(concurrent, f"{args['model_instance_name']}-worker")
        _LOGGER.info("%s ready: %s from %s (decoupled %s, timeout %.0f s, work admission %s)",
                     args["model_instance_name"], tts.model_id, engines, self.decoupled, timeout_s, enabled)

    def execute(self, requests: list[Any]) -> list[Any] | None:
        if self.text_streaming:
            for request in requests:
                self._sequence_request(request, request.get_response_sender())
            return None
        if self.decoupled:
            for request in requests:
                self._accept(request, request.get_response_sender())
            return None  # the workers answer; Triton sends the next requests meanwhile
        return [self._single(request) for request in requests]

    def finalize(self) -> None:
        with self._sequences_lock:
            sequences = list(self._sequences.values())
        for sequence in sequences:
            sequence.text.abort()
        if self.workers is not None:
            self.workers.close()
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

    def _accept(self, request: Any, sender: Any) -> None:
        """Plan the request and admit it to a worker, or answer it now (bad input, refused)."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        arrived = time.monotonic()
        try:
            inputs, chunks = self.speech.start(_inputs(request))
        except Exception as exc:  # noqa: BLE001 - every failure answers this request, the instance stays up
            sender.send(pb_utils.InferenceResponse(error=_error(exc)), flags=final)
            return
        try:
            timeout_s = self.work.timeout_for(_request_timeout_us(request))
            ticket = self.work.admit(chunks, inputs.stream, timeout_s)
        except Exception as exc:  # noqa: BLE001
            chunks.close()
            sender.send(pb_utils.InferenceResponse(error=_error(exc)), flags=final)
            return
        deadline = arrived + timeout_s
        self.workers.submit(ticket.priority, lambda: self._stream(inputs.stream, chunks, ticket, sender, deadline))

    def _stream(self, stream: bool, chunks: Any, ticket: TritonTicket, sender: Any, deadline: float) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        completed = False
        ticket.start()
        try:
            if not stream:
                audio = self._run(chunks, ticket, deadline, sender)
                if audio is not None:
                    sender.send(self._response(audio), flags=final)  # exactly one response (HTTP generate)
                    completed = True
                else:
                    sender.send(flags=final)
                return
            for chunk in chunks:
                ticket.progress(chunk)
                if _cancelled(sender):
                    break
                sender.send(self._response(samples_of(chunk)))
                _check_deadline(deadline)
            else:
                completed = True
            sender.send(flags=final)
        except Exception as exc:  # noqa: BLE001 - every failure answers this request, the instance stays up
            sender.send(pb_utils.InferenceResponse(error=_error(exc)), flags=final)
        finally:
            chunks.close()
            ticket.close(completed)

    def _run(self, chunks: Any, ticket: TritonTicket, deadline: float, sender: Any = None) -> np.ndarray | None:
        """The whole audio of a non-streamed request; None when its client cancelled it."""
        parts = []
        for chunk in chunks:
            ticket.progress(chunk)
            parts.append(samples_of(chunk))
            if sender is not None and _cancelled(sender):
                return None
            _check_deadline(deadline)
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)  # audio: [N]

    # ------------------------------------------------------------------ one response per request

    def _single(self, request: Any) -> Any:
        arrived = time.monotonic()  # its time in Triton's queue is not known here
        chunks, ticket, completed = None, TritonTicket(), False
        try:
            inputs, chunks = self.speech.start(_inputs(request))
            if inputs.stream:
                raise InputError(
                    "stream is true but this model is not decoupled; send stream false, or use the decoupled "
                    "model (`trt-cosy triton-repo` without --no-decoupled) with gRPC streaming."
                )
            timeout_s = self.work.timeout_for(_request_timeout_us(request))
            ticket = self.work.admit(chunks, False, timeout_s)
            ticket.start()
            response = self._response(self._run(chunks, ticket, arrived + timeout_s))
            completed = True
            return response
        except Exception as exc:  # noqa: BLE001
            return pb_utils.InferenceResponse(error=_error(exc))
        finally:
            if chunks is not None:
                chunks.close()
            ticket.close(completed)

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


def _request_timeout_us(request: Any) -> int | None:
    """The request's own Triton timeout (microseconds; 0 or None: none)."""
    timeout = getattr(request, "timeout", None)
    try:
        return int(timeout()) if timeout is not None else None
    except Exception:  # noqa: BLE001 - a stub without it
        return None


def _check_deadline(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise RequestTimedOut(
            "the request did not finish within its timeout (the work admission underestimated it); it was "
            "stopped. Retry it, send the text in parts, or raise the model's request_timeout_s "
            "(`trt-cosy triton-repo --timeout`)."
        )


def _cancelled(sender: Any) -> bool:
    is_cancelled = getattr(sender, "is_cancelled", None)
    return bool(is_cancelled()) if is_cancelled is not None else False


def _error(exc: Exception) -> Any:
    if isinstance(exc, TrtCosyError):
        # AdmissionRefused / RequestTimedOut carry their code (UNAVAILABLE: retry later); bad input INVALID_ARG.
        message, code = str(exc), getattr(exc, "code", "INVALID_ARG")
    else:
        _LOGGER.error("internal error", exc_info=exc)
        message, code = f"internal error ({type(exc).__name__}: {exc}); see the Triton server log.", "INTERNAL"
    try:
        return pb_utils.TritonError(message, getattr(pb_utils.TritonError, code))
    except (AttributeError, TypeError):  # a stub without error codes
        return pb_utils.TritonError(message)


class _TritonMetrics:
    """``triton_admission.WorkEvents`` as Triton custom metrics (on Triton's metrics endpoint, labelled
    with the model and instance)."""

    _REASONS = ("overloaded", "cannot_keep_up", "too_long")

    def __init__(self, model: str, instance: str):
        family = pb_utils.MetricFamily
        labels = {"model": model, "instance": instance}
        self._families: list[Any] = []  # a MetricFamily must outlive its metrics (Triton deletes it with the object)

        def metric(name: str, description: str, kind: Any) -> Any:
            self._families.append(family(name=name, description=description, kind=kind))
            return self._families[-1].Metric(labels=labels)

        refused = family(
            name="trt_cosy_admission_refused_total",
            description="Requests refused at once by admission by expected work, by reason "
            "(overloaded, cannot_keep_up: UNAVAILABLE; too_long: INVALID_ARG).",
            kind=family.COUNTER,
        )
        self._families.append(refused)
        self._refused = {reason: refused.Metric(labels={**labels, "reason": reason}) for reason in self._REASONS}
        self._queue = metric("trt_cosy_queue_seconds_total", "Seconds admitted requests waited for a worker.",
                             family.COUNTER)
        self._started = metric("trt_cosy_started_requests_total", "Admitted requests that got a worker.",
                               family.COUNTER)
        self._estimated = metric("trt_cosy_work_estimated_seconds_total",
                                 "Expected machine seconds of the completed requests, when admitted.", family.COUNTER)
        self._actual = metric("trt_cosy_work_actual_seconds_total",
                              "Machine seconds the completed requests took.", family.COUNTER)
        self._completed = metric("trt_cosy_completed_requests_total", "Requests completed with all their audio.",
                                 family.COUNTER)
        self._ahead = metric("trt_cosy_admitted_work_seconds",
                             "Expected machine seconds of the admitted work still to do.", family.GAUGE)

    @classmethod
    def create(cls, model: str, instance: str) -> _TritonMetrics | None:
        """The metrics, or None where this stub has no custom metrics (then only the log says why)."""
        if getattr(pb_utils, "MetricFamily", None) is None:
            return None
        try:
            return cls(model, instance)
        except Exception as exc:  # noqa: BLE001 - metrics disabled in this server
            _LOGGER.warning("no custom metrics for the work admission: %s", exc)
            return None

    def refused(self, reason: str) -> None:
        metric = self._refused.get(reason)
        if metric is not None:
            metric.increment(1)

    def queued(self, seconds: float) -> None:
        self._queue.increment(seconds)
        self._started.increment(1)

    def completed(self, estimated_s: float, actual_s: float) -> None:
        self._estimated.increment(estimated_s)
        self._actual.increment(actual_s)
        self._completed.increment(1)

    def admitted_work(self, seconds: float) -> None:
        self._ahead.set(seconds)
