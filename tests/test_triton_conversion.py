"""Voice conversion through the Triton model: the optional ``source_audio`` + ``source_sample_rate``
inputs (instead of ``text``) convert the source into the voice (a stored one, or ``reference_audio``:
the official VC prompt). Checked without a server (the model's request logic, ``TritonSpeech``) and
on a real ``tritonserver`` over gRPC streaming (tests/triton_support.py; skipped with the reason
where it is missing). Results must equal ``CosyVoice.convert`` in this process bit for bit.
"""

from __future__ import annotations

import queue
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile
from _convert_support import load_family
from _support import tiny_engines

from trt_cosy import SynthesisConfig
from trt_cosy.errors import InputError
from trt_cosy.serving.triton_repo import TritonRepoOptions, write_triton_repo
from trt_cosy.serving.triton_speech import TritonSpeech, parse_inputs

pytest.importorskip("torch", reason="needs the [build] extra (torch) to build the tiny engines")

AUDIO = Path(__file__).parent / "data" / "features" / "audio"


@pytest.fixture(scope="module")
def tts(tmp_path_factory):
    return load_family(tmp_path_factory, "v2")


def _audio(name: str) -> tuple[np.ndarray, np.ndarray]:
    samples, rate = soundfile.read(AUDIO / name, dtype="float32")
    return samples, np.array([rate], np.int32)


def test_parse_inputs_takes_source_audio_instead_of_text():
    source, rate = _audio("en_16k_mono.wav")
    voice = np.array([b"alice"], dtype=object)
    parsed = parse_inputs({"source_audio": source, "source_sample_rate": rate, "voice": voice})
    assert parsed.text == "" and parsed.source_sample_rate == 16000
    assert parsed.source_audio.size == source.size
    text = np.array([b"Hi."], dtype=object)
    cases = {
        "not both": {"text": text, "source_audio": source, "source_sample_rate": rate, "voice": voice},
        "needs 'source_sample_rate'": {"source_audio": source, "voice": voice},
        "goes with 'source_audio'": {"text": text, "source_sample_rate": rate, "voice": voice},
        "no transcript": {
            "source_audio": source,
            "source_sample_rate": rate,
            "reference_audio": source,
            "reference_sample_rate": rate,
            "reference_text": text,
        },
        "source_audio contains no samples": {
            "source_audio": np.zeros(0, np.float32),
            "source_sample_rate": rate,
            "voice": voice,
        },
        "input 'text' is missing": {"voice": voice},
    }
    for expected, inputs in cases.items():
        with pytest.raises(InputError, match=expected):
            parse_inputs(inputs)


def test_the_model_converts_with_a_reference_as_convert_does(tts):
    source, rate = _audio("en_44k1_stereo.wav")  # [N, 2]: Triton gets the mono mix the client sends
    mono = source.mean(axis=1).astype(np.float32)
    reference, reference_rate = _audio("zh_16k_mono.wav")
    inputs = {"source_audio": mono, "source_sample_rate": rate, "reference_audio": reference,
              "reference_sample_rate": reference_rate, "seed": np.array([4]), "stream": np.array([True])}
    _, chunks = TritonSpeech(tts, None).chunks(inputs)
    ours = list(chunks)
    target = tts.vc_voice_from_wav(AUDIO / "zh_16k_mono.wav")
    config = SynthesisConfig(stream=True)
    expected = [c.samples for c in tts.convert((mono, int(rate[0])), target, 4, config)]
    assert len(ours) == len(expected) == 3
    assert all(np.array_equal(a, b) for a, b in zip(ours, expected, strict=False))
    silent = dict(inputs, source_audio=np.zeros(32000, np.float32), source_sample_rate=np.array([16000]))
    with pytest.raises(InputError, match="silent"):
        TritonSpeech(tts, None).chunks(silent)


@pytest.mark.slow
def test_tritonserver_streams_a_conversion_into_a_stored_voice(tts, tmp_path_factory, v2_tiny_dir, request):
    pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc]: the [triton] extra")
    import tritonclient.grpc as grpc
    from triton_support import TritonServer, stub_numpy_dir

    engines = tiny_engines(tmp_path_factory, v2_tiny_dir)
    work = tmp_path_factory.mktemp("triton-vc")
    voices = work / "voices"
    voices.mkdir()
    target = tts.vc_voice_from_wav(AUDIO / "zh_16k_mono.wav")
    target.save(voices / "alice.npz")
    numpy_dir = stub_numpy_dir(request.config, tmp_path_factory)
    python_path = (str(numpy_dir),) if numpy_dir else ()
    options = TritonRepoOptions(voices_dir=voices, threads=1, python_path=python_path)
    write_triton_repo(engines, work / "repo", options)
    package_root = str(Path(__file__).resolve().parent.parent)
    site = [path for path in sys.path if path.endswith("site-packages")]
    server = TritonServer(work / "repo", work, [package_root, *site]).start()
    try:
        source, rate = _audio("en_16k_mono.wav")
        arrays = {
            "source_audio": source,
            "source_sample_rate": rate,
            "voice": np.array([b"alice"], dtype=object),
            "seed": np.array([9], np.int64),
            "stream": np.array([True]),
        }
        inputs = []
        for name, array in arrays.items():
            dtype = {np.dtype(object): "BYTES", np.dtype(bool): "BOOL", np.dtype(np.int64): "INT64",
                     np.dtype(np.float32): "FP32", np.dtype(np.int32): "INT32"}[array.dtype]
            tensor = grpc.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        results: queue.Queue = queue.Queue()
        client = grpc.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        chunks = []
        try:
            client.async_stream_infer("trt_cosy", inputs, enable_empty_final_response=True)
            while True:
                result, error = results.get(timeout=120)
                assert error is None, error
                audio = result.as_numpy("audio")
                if audio is not None:
                    chunks.append(audio)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    break
        finally:
            client.stop_stream()
            client.close()
    finally:
        server.stop()
    config = SynthesisConfig(stream=True)
    expected = [c.samples for c in tts.convert(AUDIO / "en_16k_mono.wav", target, 9, config)]
    assert len(chunks) == len(expected)
    assert np.array_equal(np.concatenate(chunks), np.concatenate(expected))
