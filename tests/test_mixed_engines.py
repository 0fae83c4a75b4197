"""Mixed engines (builder/mixed.py): the LLM on ONNX Runtime, the flow graphs and HiFT on OpenVINO, the
backend of each graph recorded in the manifest; manifest rules, golden parity, quality, say,
streaming and concurrency.

Engines of the golden tiny CosyVoice2 checkpoint are built once per module: ``mixed`` fp32 (for the
golden set: every graph float32) and ``mixed`` int4 (the CPU default where it wins: int4 LLM on ONNX
Runtime, bf16 flow with float16-stored weights and fp32 HiFT on OpenVINO). Quality bounds as for the
OpenVINO engines (docs/precision.md): flow mel SNR >= 35 dB against fp32 ONNX Runtime engines (43-47 dB
measured), LLM KL <= 0.01 nats.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile
from _incremental_support import INCREMENTAL, chunk_errors
from _isolated import run_isolated
from _support import BLOCK_TORCH, tiny_release
from click.testing import CliRunner

ov = pytest.importorskip("openvino", reason="mixed engines need `pip install 'trt-cosy[openvino]'`")

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig  # noqa: E402
from trt_cosy.builder.derived import link_or_copy  # noqa: E402
from trt_cosy.builder.engines import build_engines  # noqa: E402
from trt_cosy.builder.flow_incremental import add_incremental_estimator  # noqa: E402
from trt_cosy.cli import main  # noqa: E402
from trt_cosy.errors import EngineMismatchError, InputError  # noqa: E402
from trt_cosy.runtime.backends.onnxruntime.runner import LazyOrtRunner, OrtRunner  # noqa: E402
from trt_cosy.runtime.backends.openvino.runner import LazyOvRunner, OvRunner, cpu_has_bf16  # noqa: E402
from trt_cosy.runtime.engines import graph_specs, load_engines  # noqa: E402
from trt_cosy.runtime.manifest import Manifest  # noqa: E402
from trt_cosy.verify.golden import GoldenSet  # noqa: E402
from trt_cosy.verify.quality import QualityInputs, quality_guard  # noqa: E402

V2_GOLDEN = Path(__file__).parent / "data" / "cosyvoice2-tiny"
MEL_SNR_BOUND = 35.0  # dB, bf16 flow vs fp32 (measured 46.6 dB on these inputs)
KL_BOUND = 0.01  # nats, LLM next-token KL mean vs fp32
ORT_GRAPHS = {"llm", "llm_batch"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return tiny_release(tmp_path_factory, V2_GOLDEN)


@pytest.fixture(scope="module")
def built(release, tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    made: dict[tuple[str, str], Path] = {}

    def get(backend: str, precision: str) -> Path:
        if (backend, precision) not in made:
            made[backend, precision] = build_engines(
                release, root / f"{backend}-{precision}", backend=backend, precision=precision
            )
        return made[backend, precision]

    return get


@pytest.mark.parametrize("precision", ("fp32", "int4"))
def test_manifest_records_the_backend_of_each_graph(built, precision):
    engines = built("mixed", precision)
    manifest = Manifest.read(engines)
    assert (manifest.backend, manifest.precision) == ("mixed", precision)
    assert set(manifest.graphs) == set(graph_specs("v2")) | {"llm_batch", INCREMENTAL}
    for name, record in manifest.graphs.items():
        if name in ORT_GRAPHS:
            assert (record.backend, record.file) == ("onnxruntime", f"{name}.onnx"), record
        else:
            assert (record.backend, record.file) == ("openvino", f"{name}.xml"), record
            assert not (engines / f"{name}.onnx").exists()
    # bf16-computing graphs store float16 weights (about half the float32 file); HiFT stays float32
    fp32_sizes = Manifest.read(built("mixed", "fp32")).files
    ratio = {
        name: manifest.files[f"{name}.bin"] / fp32_sizes[f"{name}.bin"]
        for name in ("flow_estimator", INCREMENTAL, "hift")
    }
    if precision == "int4":
        assert ratio["flow_estimator"] < 0.6 and ratio[INCREMENTAL] < 0.6 and ratio["hift"] == 1.0, ratio
        assert manifest.files["llm.onnx"] < 0.5 * fp32_sizes["llm.onnx"]  # MatMulNBits weights
        assert manifest.nbits_blocks == {"llm": 128, "llm_batch": 128}  # the ONNX Runtime graphs only
    else:
        assert ratio == {"flow_estimator": 1.0, INCREMENTAL: 1.0, "hift": 1.0}
        assert manifest.nbits_blocks is None


def test_single_backend_manifests_have_no_graph_backends(built, release, tmp_path):
    raw = Manifest.read(built("mixed", "int4")).to_dict()
    assert {graph["backend"] for graph in raw["graphs"].values()} == {"onnxruntime", "openvino"}
    plain = Manifest.read(built("onnxruntime", "fp32"))
    assert all("backend" not in graph for graph in plain.to_dict()["graphs"].values())
    assert all(plain.graph_backend(name) == "onnxruntime" for name in plain.graphs)


def test_each_graph_loads_on_its_backend(built):
    model = load_engines(built("mixed", "int4"), threads=1, backend="auto")
    assert model.backend == "mixed"
    kinds = {name: type(runner) for name, runner in model.runners.items()}
    assert kinds["llm"] is LazyOrtRunner and kinds["llm_batch"] is LazyOrtRunner  # one of them is used
    assert kinds["flow_estimator"] is OvRunner and kinds["hift"] is OvRunner
    assert kinds["flow_estimator_stream"] is LazyOvRunner and kinds[INCREMENTAL] is LazyOvRunner
    eager = load_engines(built("mixed", "int4"), threads=1, backend="mixed", lazy_graphs=())
    assert (
        type(eager.runners["llm"]) is OrtRunner and type(eager.runners["flow_estimator_stream"]) is OvRunner
    )
    if cpu_has_bf16():
        assert "bfloat16" in eager.runners["flow_estimator"].inference_precision
        assert "bfloat16" in eager.runners[INCREMENTAL].inference_precision
    assert "float32" in eager.runners["hift"].inference_precision


def test_foreign_and_stale_engines_are_refused(built, tmp_path):
    mixed = built("mixed", "int4")
    with pytest.raises(EngineMismatchError, match="built for backend 'mixed', not 'onnxruntime'"):
        load_engines(mixed, backend="onnxruntime")
    with pytest.raises(EngineMismatchError, match="built for backend 'mixed', not 'openvino'"):
        load_engines(mixed, backend="openvino")
    with pytest.raises(EngineMismatchError, match="built for backend 'onnxruntime', not 'mixed'"):
        load_engines(built("onnxruntime", "fp32"), backend="mixed")
    copy = tmp_path / "engines"
    shutil.copytree(mixed, copy)
    (copy / "flow_estimator.bin").write_bytes(b"\0" * 16)
    with pytest.raises(EngineMismatchError, match="flow_estimator.bin has 16 bytes"):
        load_engines(copy, backend="mixed")


def test_fp32_mixed_engines_pass_the_golden_set(built, release):
    """`trt-cosy verify --backend mixed` (every stage, all tolerances)."""
    result = CliRunner().invoke(
        main,
        ["verify", "--model-dir", str(release), "--golden", str(V2_GOLDEN / "reference.npz"),
         "--backend", "mixed", "--engines", str(built("mixed", "fp32")), "--threads", "1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "0 failed" in result.output, result.output


def _quality_rows(reference_dir, candidate_dir) -> dict[str, float]:
    """The quality guard of ``candidate_dir`` against ``reference_dir`` (run in a child process)."""
    with np.load(V2_GOLDEN / "reference.npz") as data:
        inputs = QualityInputs.from_golden({key: data[key] for key in data.files})
    reference = load_engines(reference_dir, threads=1, backend="auto")
    candidate = load_engines(candidate_dir, threads=1, backend="auto")
    return {row.metric: float(row.value) for row in quality_guard(reference, candidate, inputs)}


def test_int4_mixed_engines_pass_the_quality_guard(built):
    # bf16 OpenVINO graphs compile in a child process: a native crash fails this test alone (tests/_isolated.py)
    rows = run_isolated(_quality_rows, built("onnxruntime", "fp32"), built("mixed", "int4"))
    assert rows["llm_kl_mean"] <= KL_BOUND, rows
    assert rows["flow_mel_snr_db"] >= MEL_SNR_BOUND, rows
    assert rows["hift_wav_snr_db"] >= 60.0, rows  # fp32 on OpenVINO against fp32 on ONNX Runtime


def test_say_and_streaming_and_concurrency(built, tmp_path):
    engines = built("mixed", "int4")
    ref = tmp_path / "ref.wav"
    soundfile.write(ref, 0.1 * np.sin(np.linspace(0, 900, 24000 * 2)).astype(np.float32), 24000)
    out = tmp_path / "mixed.wav"
    result = CliRunner().invoke(
        main,
        ["say", "Hello there.", "--engines", str(engines), "--ref", str(ref), "--ref-text", "a test",
         "-o", str(out), "--seed", "0", "--threads", "1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    audio, rate = soundfile.read(out)
    assert rate == 24000 and audio.size > 0 and np.isfinite(audio).all()

    tts = CosyVoice.load(engines, config=EngineConfig(threads=1, normalizer="none"))
    assert tts.model.backend == "mixed"
    voice = tts.voice_from_wav(ref, "a test")
    texts = ("Hello there.", "A second sentence, somewhat longer.", "Third.")

    def speak(text: str, stream: bool = False) -> np.ndarray:
        chunks = tts.synthesize(text, voice, seed=1, config=SynthesisConfig(stream=stream))
        return np.concatenate([chunk.samples for chunk in chunks])

    alone = [speak(text) for text in texts]
    together: list[np.ndarray | None] = [None] * len(texts)

    def run(index: int) -> None:
        together[index] = speak(texts[index])

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(texts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for one, many in zip(alone, together, strict=True):  # the batched LLM decodes the same tokens
        np.testing.assert_allclose(many, one, atol=1e-4)
    streamed = speak(texts[1], stream=True)
    assert streamed.size > 0 and np.isfinite(streamed).all()


def test_mixed_engines_load_without_torch(built):
    code = BLOCK_TORCH + textwrap.dedent(
        f"""
        from trt_cosy import CosyVoice, EngineConfig
        tts = CosyVoice.load({str(built("mixed", "int4"))!r}, config=EngineConfig(threads=1))
        assert tts.model.backend == "mixed"
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_a_second_load_takes_the_compiled_graphs_from_the_cache(built, tmp_path, monkeypatch):
    monkeypatch.setenv("TRT_COSY_CACHE", str(tmp_path / "cache"))
    engines = built("mixed", "int4")
    first = load_engines(engines, threads=1, backend="mixed")
    assert not first.runners["flow_estimator"].compiled.get_property("LOADED_FROM_CACHE")
    assert any((tmp_path / "cache" / "openvino").iterdir())
    second = load_engines(engines, threads=1, backend="mixed")
    assert second.runners["flow_estimator"].compiled.get_property("LOADED_FROM_CACHE")
    feed = {
        name: np.full([dim or 4 for dim in shape], 0.5, dtype)
        for name, (shape, dtype) in first.runners["hift"].input_specs().items()
    }
    np.testing.assert_array_equal(
        first.runners["hift"].infer(feed)["wav"], second.runners["hift"].infer(feed)["wav"]
    )


# ----------------------------------------------------------------------------- the incremental estimator

# Streaming chunks through the incremental graph, max |mel difference| per chunk (natural-log mel):
# fp32 engines against their own recomputed chunks (chunk attention over every frame), the same float32
# maths in another order (measured 3.0e-6; ONNX Runtime 2.7e-6); the bf16 flow of int4 engines against
# the fp32 engines' recomputed chunks (measured 0.062-0.067 per chunk, where bf16 recomputation gives
# 0.064-0.32: its error grows with the frames of a call, an incremental call holds the new ones only).
INCREMENTAL_MEL_TOLERANCE = {"fp32": 5e-5, "int4": 0.1}


@pytest.mark.parametrize("precision", ("fp32", "int4"))
@pytest.mark.parametrize("schedule", ("official", "fast"))
def test_streaming_chunks_through_the_incremental_graph_match_recomputation(built, precision, schedule):
    model = load_engines(built("mixed", precision), threads=1, backend="auto")
    reference = load_engines(built("mixed", "fp32"), threads=1, backend="auto")
    errors = chunk_errors(model, GoldenSet.load(V2_GOLDEN / "reference.npz"), schedule, reference)
    assert len(errors) >= 4  # three chunks or more, then the final call
    assert max(errors) <= INCREMENTAL_MEL_TOLERANCE[precision], errors


def test_verify_stream_rows_pass_through_the_incremental_graph(built):
    """The stream/streampad rows of `trt-cosy verify` on fp32 mixed engines, their chunks computed by
    the OpenVINO incremental estimator (one cache per scenario, as a request)."""
    from _streaming_support import CountingRunner

    from trt_cosy.verify import run_verify

    model = load_engines(built("mixed", "fp32"), threads=1, backend="auto")
    counter = CountingRunner(model.runners[INCREMENTAL])
    model = dataclasses.replace(model, runners={**model.runners, INCREMENTAL: counter})
    rows = [row for row in run_verify(model, GoldenSet.load(V2_GOLDEN / "reference.npz"))]
    stream = [row for row in rows if row.key.startswith(("stream_", "streampad_"))]
    assert len(stream) >= 30 and counter.calls > 0
    failed = [f"{row.key} {row.max_abs_err}" for row in stream if row.status not in ("ok", "skipped")]
    assert not failed, failed


def _without_incremental(source: Path, copy: Path) -> Manifest:
    """``source`` copied to ``copy`` by hard links, less the incremental graph (as engines built before
    it); returns the source's manifest."""
    shutil.copytree(source, copy, copy_function=link_or_copy)
    manifest = Manifest.read(source)
    record = manifest.graphs[INCREMENTAL]
    weights = {record.file, f"{INCREMENTAL}.bin"}
    for name in weights:
        (copy / name).unlink(missing_ok=True)
    graphs_ = {name: graph for name, graph in manifest.graphs.items() if name != INCREMENTAL}
    files = {name: size for name, size in manifest.files.items() if name not in weights}
    (copy / "manifest.json").unlink()  # a hard link to the source's
    dataclasses.replace(manifest, graphs=graphs_, files=files).write(copy)
    return manifest


@pytest.mark.parametrize("backend,precision", (("mixed", "int4"), ("onnxruntime", "fp32")))
def test_add_incremental_estimator_upgrades_engines_built_without_it(
    built, release, tmp_path, backend, precision
):
    source = built(backend, precision)
    original = (source / "manifest.json").read_bytes()
    built_manifest = _without_incremental(source, tmp_path / "engines")
    engines = tmp_path / "engines"
    assert INCREMENTAL not in load_engines(engines, threads=1, backend="auto").runners
    path = add_incremental_estimator(engines, release)
    manifest = Manifest.read(engines)
    manifest.check(engines, release, backend=backend, precision=precision)
    added, want = manifest.graphs[INCREMENTAL], built_manifest.graphs[INCREMENTAL]
    assert dataclasses.replace(added, max_errors={}) == dataclasses.replace(want, max_errors={})
    assert path == engines / want.file
    weights = f"{INCREMENTAL}.bin" if backend == "mixed" else want.file  # fp16 IR weights, int4 or fp32 ONNX
    assert manifest.files[weights] == built_manifest.files[weights]
    assert (source / "manifest.json").read_bytes() == original  # nothing written through a hard link
    assert not [item.name for item in engines.iterdir() if item.name.startswith(".")]  # no scratch left
    model = load_engines(engines, threads=1, backend="auto")
    assert isinstance(model.runners[INCREMENTAL], LazyOvRunner if backend == "mixed" else LazyOrtRunner)


def test_add_incremental_estimator_refuses_other_engines(built, release, tmp_path):
    engines = tmp_path / "engines"
    _without_incremental(built("mixed", "int4"), engines)
    manifest = Manifest.read(engines)
    (engines / "manifest.json").unlink()
    dataclasses.replace(manifest, backend="tensorrt").write(engines)
    with pytest.raises(InputError, match="tensorrt engines"):
        add_incremental_estimator(engines, release)


def test_engines_tuned_per_stage_mix_backends_and_pass_the_golden_set(built, release, tmp_path_factory, tmp_path):
    """A tuned build's folder (builder.tuned_engines) with the LLM and HiFT from ONNX Runtime engines and the
    flow from OpenVINO ones, fp32 everywhere: each graph runs on its own backend and every stage passes."""
    from _support import tiny_engines

    from trt_cosy.builder.tuned_engines import compose_tuned_engines
    from trt_cosy.runtime.native_guard import machine
    from trt_cosy.runtime.tuning_record import StageTuning, TuningRecord

    ort_fp32 = tiny_engines(tmp_path_factory, V2_GOLDEN)  # the session's ONNX Runtime fp32 build
    chosen = {"llm": ("onnxruntime", "fp32"), "flow": ("mixed", "fp32"), "hift": ("onnxruntime", "fp32")}
    stages = {stage: StageTuning(stage, *key, "chosen by the test") for stage, key in chosen.items()}
    here = machine()
    out = tmp_path / "tuned"
    out.mkdir()
    compose_tuned_engines(
        TuningRecord(here.cpu, here.flags, here.key, 1, 1.0, 0.0, stages),
        {("onnxruntime", "fp32"): ort_fp32, ("mixed", "fp32"): built("mixed", "fp32")},
        out,
    )
    manifest = Manifest.read(out)
    assert manifest.backend == "mixed" and manifest.tuning.stages["flow"].label == "mixed/fp32"
    model = load_engines(out, threads=1, backend="auto")
    kinds = {name: type(runner).__name__ for name, runner in model.runners.items()}
    assert {kinds["llm"], kinds["hift"]} <= {"OrtRunner", "LazyOrtRunner"}, kinds
    assert {kinds["flow_encoder"], kinds["flow_estimator"]} <= {"OvRunner", "LazyOvRunner"}, kinds
    result = CliRunner().invoke(
        main,
        ["verify", "--model-dir", str(release), "--golden", str(V2_GOLDEN / "reference.npz"),
         "--backend", "mixed", "--engines", str(out), "--threads", "1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "0 failed" in result.output, result.output
