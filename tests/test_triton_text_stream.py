"""Text-in streaming on Triton: ``trt-cosy triton-repo --text-streaming`` served by a real ``tritonserver``
(see test_triton.py for the server), driven with ``tritonclient``'s gRPC stream. The text comes in several
requests of one sequence (Triton's sequence batcher: correlation id, START, END); the START request's
responses carry the audio, which begins before the last piece is sent and equals the Python API's for
the same pieces and seed bit for bit; the other requests get empty final responses; a piece for a
sequence that never started gets an error (Triton's own) and the rest goes on."""

from __future__ import annotations

import queue
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from _support import REF_TEXT, reference_wavs, tiny_engines

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig
from trt_cosy.serving.triton_repo import TritonRepoOptions, model_config, write_triton_repo

MODEL = "trt_cosy_text"
PIECES = [
    "Hello there, my friend, ",
    "this text comes to the server ",
    "in several requests of ",
    "one sequence, a few words ",
    "at a time, as a chat model ",
    "writes it.",
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory, v2_tiny_dir) -> Path:
    return tiny_engines(tmp_path_factory, v2_tiny_dir)


@pytest.fixture(scope="module")
def tts(engines) -> CosyVoice:
    return CosyVoice.load(engines, config=EngineConfig(threads=1))


def test_the_repository_declares_a_sequence_batcher(engines, tmp_path):
    options = TritonRepoOptions(model_name=MODEL, text_streaming=True, sequence_idle_s=12)
    config = model_config(engines, "KIND_CPU", options)
    assert "sequence_batching {" in config and "max_sequence_idle_microseconds: 12000000" in config
    for control in ("CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_CORRID"):
        assert control in config
    assert "dynamic_batching" not in config and "decoupled: true" in config
    assert 'key: "text_streaming" value: { string_value: "true" }' in config
    with pytest.raises(Exception, match="needs a decoupled model"):
        TritonRepoOptions(text_streaming=True, decoupled=False)


@pytest.fixture(scope="module")
def triton(engines, tts, tmp_path_factory, request):
    pytest.importorskip(
        "tritonclient.grpc", reason="tritonclient[grpc] is needed (pip install 'trt-cosy[triton]')"
    )
    from triton_support import TritonServer, stub_numpy_dir

    work = tmp_path_factory.mktemp("triton-text")
    voices = work / "voices"
    voices.mkdir()
    tts.voice_from_wav(reference_wavs(work)["ref"], REF_TEXT).save(voices / "alice.npz")
    numpy_dir = stub_numpy_dir(request.config, tmp_path_factory)
    python_path = (str(numpy_dir),) if numpy_dir else ()
    options = TritonRepoOptions(
        model_name=MODEL, voices_dir=voices, threads=1, python_path=python_path, text_streaming=True
    )
    write_triton_repo(engines, work / "repo", options)
    package_root = str(Path(__file__).resolve().parent.parent)  # this checkout's trt_cosy first
    site = [path for path in sys.path if path.endswith("site-packages")]
    server = TritonServer(work / "repo", work, [package_root, *site]).start()
    yield server, voices
    server.stop()


def _inputs(**arrays):
    import tritonclient.grpc as grpc

    inputs = []
    for name, array in arrays.items():
        dtype = {np.dtype(object): "BYTES", np.dtype(np.int64): "INT64"}[array.dtype]
        tensor = grpc.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _text(piece: str) -> np.ndarray:
    return np.array([piece.encode()], dtype=object)


@pytest.mark.slow
def test_text_in_several_requests_of_one_sequence(triton, tts):
    import tritonclient.grpc as grpc

    server, voices = triton
    responses: queue.Queue = queue.Queue()
    first_audio = threading.Event()

    def on_response(result, error):
        if result is not None and result.as_numpy("audio") is not None:
            first_audio.set()
        responses.put((result, error))

    client = grpc.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=on_response)
    held = []
    try:
        start = _inputs(text=_text(PIECES[0]), voice=_text("alice"), seed=np.array([7], np.int64))
        client.async_stream_infer(
            MODEL,
            start,
            request_id="0",
            sequence_id=42,
            sequence_start=True,
            enable_empty_final_response=True,
        )
        for index, piece in enumerate(PIECES[1:], start=1):
            last = index == len(PIECES) - 1
            if last:  # the last piece waits for audio (60 s at most): no race with the machine's load
                held.append(first_audio.wait(60))
            client.async_stream_infer(
                MODEL,
                _inputs(text=_text(piece)),
                request_id=str(index),
                sequence_id=42,
                sequence_end=last,
                enable_empty_final_response=True,
            )
        # A piece for a sequence that never started: an error for that request only.
        client.async_stream_infer(
            MODEL,
            _inputs(text=_text("lost")),
            request_id="stray",
            sequence_id=99,
            enable_empty_final_response=True,
        )
        audio, finals, errors = [], set(), {}
        while len(finals) + len(errors) < len(PIECES) + 1:
            result, error = responses.get(timeout=180)
            if error is not None:
                errors[len(errors)] = error.message() if hasattr(error, "message") else str(error)
                continue
            response = result.get_response()
            if response.id == "0" and result.as_numpy("audio") is not None:
                assert result.as_numpy("sample_rate").tolist() == [24000]
                audio.append(result.as_numpy("audio"))
            if response.parameters["triton_final_response"].bool_param:
                finals.add(response.id)
    finally:
        client.stop_stream()
        client.close()
    assert held == [True]  # the audio began before the last piece was sent
    assert finals == {str(i) for i in range(len(PIECES))}, (finals, errors)
    # (Triton's sequence batcher answers it before the model sees it)
    assert len(errors) == 1 and "must specify the START flag" in next(iter(errors.values())), errors
    from trt_cosy.frontend.voice import Voice

    alice = Voice.load(voices / "alice.npz")
    expected = [c.samples for c in tts.synthesize(iter(PIECES), alice, 7, SynthesisConfig(stream=True))]
    assert len(audio) == len(expected) > 1
    assert np.array_equal(np.concatenate(audio), np.concatenate(expected))  # bit for bit
