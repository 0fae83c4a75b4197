"""The OpenVINO backend: build (IR from the plain exports), manifest rules, golden parity, precisions,
say, streaming, concurrency and the KV decoder (runtime/backends/openvino/runner.py, builder/openvino.py).

fp32 OpenVINO engines of the golden tiny checkpoints of all three families are built once per
module (one export each, ~1 min); the bf16/int8/int4 engines are derived from them
(``derive_openvino_engines``, what ``trt-cosy build --precision ...`` writes after its export).

Quality bounds (docs/precision.md, "OpenVINO"): on these golden inputs bf16 gives a flow mel SNR of
43 dB (v2) against fp32 OpenVINO; HiFT stays float32 (bf16 measured 15 dB), so its waveform must be
identical (SNR = inf). The tests hold mel SNR >= 35 dB and LLM KL <= 0.01 nats.
"""

from __future__ import annotations

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
from _support import BLOCK_TORCH, GOLDEN, family_release, tiny_release
from click.testing import CliRunner

ov = pytest.importorskip("openvino", reason="the OpenVINO backend needs `pip install 'trt-cosy[openvino]'`")

from trt_cosy import CosyVoice, EngineConfig, SynthesisConfig  # noqa: E402
from trt_cosy.builder.engines import build_engines  # noqa: E402
from trt_cosy.builder.openvino import (  # noqa: E402
    INT4_GROUP,
    compress_matmul_weights,
    derive_openvino_engines,
)
from trt_cosy.cli import main  # noqa: E402
from trt_cosy.errors import EngineMismatchError, InputError  # noqa: E402
from trt_cosy.runtime.backends.openvino.runner import (
    FP32_GRAPHS,
    OvKVDecoder,
    OvRunner,
    cpu_has_bf16,
    graph_precisions,
    pin_sinusoid_arguments,
)
from trt_cosy.runtime.engines import graph_specs, load_engines  # noqa: E402
from trt_cosy.runtime.manifest import Manifest  # noqa: E402
from trt_cosy.verify.golden import GoldenSet  # noqa: E402
from trt_cosy.verify.quality import QualityInputs, quality_guard  # noqa: E402

FAMILIES = ("v1", "v2", "v3")
V2_GOLDEN = Path(__file__).parent / "data" / "cosyvoice2-tiny"
GOLDEN_SETS = {**GOLDEN, "v2": V2_GOLDEN}
MEL_SNR_BOUND = 35.0  # dB, bf16 flow vs fp32 (measured 43 dB on v2)
KL_BOUND = 0.01  # nats, LLM next-token KL mean vs fp32
pytestmark = pytest.mark.slow


def _release(factory, family: str) -> Path:
    return tiny_release(factory, V2_GOLDEN) if family == "v2" else family_release(factory, family)


class _Built(dict):
    """family -> fp32 OpenVINO engines, each built on first use (one export per family)."""

    def __init__(self, factory: pytest.TempPathFactory):
        super().__init__()
        self._factory = factory
        self._root = factory.mktemp("ov-fp32")

    def __missing__(self, family: str) -> Path:
        release = _release(self._factory, family)
        self[family] = build_engines(release, self._root / family, backend="openvino", precision="fp32")
        return self[family]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory) -> _Built:
    return _Built(tmp_path_factory)


@pytest.fixture(scope="module")
def derived(fp32, tmp_path_factory):
    root = tmp_path_factory.mktemp("ov-derived")
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, precision: str) -> Path:
        if (family, precision) not in made:
            made[family, precision] = derive_openvino_engines(
                fp32[family], root / f"{family}-{precision}", precision
            )
        return made[family, precision]

    return get


def _inputs(family: str) -> QualityInputs:
    with np.load(GOLDEN_SETS[family] / "reference.npz") as data:
        return QualityInputs.from_golden({key: data[key] for key in data.files})


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_engines_pass_the_golden_set(fp32, tmp_path_factory, family):
    """`trt-cosy verify --backend openvino` on fp32 OpenVINO engines (every stage, all tolerances)."""
    result = CliRunner().invoke(
        main,
        [
            "verify",
            "--model-dir", str(_release(tmp_path_factory, family)),
            "--golden", str(GOLDEN_SETS[family] / "reference.npz"),
            "--backend", "openvino",
            "--engines", str(fp32[family]),
            "--threads", "1",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "0 failed" in result.output, result.output


@pytest.mark.parametrize("family", FAMILIES)
def test_engines_hold_ir_not_onnx_graphs(fp32, family):
    manifest = Manifest.read(fp32[family])
    assert (manifest.backend, manifest.precision) == ("openvino", "fp32")
    incremental = {INCREMENTAL} if family == "v2" else set()  # CosyVoice2's incremental streaming estimator
    assert set(manifest.graphs) == set(graph_specs(family)) | incremental
    for name, record in manifest.graphs.items():
        assert record.file == f"{name}.xml", record
        assert (fp32[family] / f"{name}.bin").is_file()
        assert not (fp32[family] / f"{name}.onnx").exists()  # replaced, never left beside the IR
        assert f"{name}.bin" in manifest.files


def test_foreign_backends_are_refused(fp32, tmp_path_factory):
    with pytest.raises(EngineMismatchError, match="built for backend 'openvino', not 'onnxruntime'"):
        load_engines(fp32["v2"], backend="onnxruntime")
    ort_engines = build_engines(
        tiny_release(tmp_path_factory, V2_GOLDEN), tmp_path_factory.getbasetemp() / "tiny-engines"
    )
    with pytest.raises(EngineMismatchError, match="built for backend 'onnxruntime', not 'openvino'"):
        load_engines(ort_engines, backend="openvino")


def test_a_stale_ir_file_is_refused(fp32, tmp_path):
    import shutil

    copy = tmp_path / "engines"
    shutil.copytree(fp32["v2"], copy)
    (copy / "flow_encoder.bin").write_bytes(b"\0" * 16)
    with pytest.raises(EngineMismatchError, match="flow_encoder.bin has 16 bytes"):
        load_engines(copy, backend="openvino")


def test_build_refuses_unknown_precisions(tmp_path_factory, tmp_path):
    with pytest.raises(InputError, match="precision 'fp16' is not available for the openvino backend"):
        build_engines(_release(tmp_path_factory, "v2"), tmp_path / "x", backend="openvino", precision="fp16")


def test_precision_plan():
    names = tuple(graph_specs("v2"))
    assert set(graph_precisions("fp32", names).values()) == {"fp32"}
    for precision in ("bf16", "int8", "int4"):
        plan = graph_precisions(precision, names)
        assert plan["hift"] == "fp32" and "hift" in FP32_GRAPHS  # measured: bf16 HiFT is 15 dB
        assert {plan[name] for name in names if name != "hift"} == {"bf16"}
    v3 = graph_precisions("int4", tuple(graph_specs("v3")))
    assert v3["hift"] == v3["hift_stream"] == "fp32" and v3["flow_estimator"] == "bf16"
    assert graph_precisions("bf16", tuple(graph_specs("v1")))["v1_hift"] == "fp32"
    with pytest.raises(EngineMismatchError, match="unknown"):
        graph_precisions("fp16", names)


def _quality_rows(reference_dir: Path, candidate_dir: Path, family: str) -> dict[str, float]:
    """The quality guard of ``candidate_dir`` against ``reference_dir`` (run in a child process)."""
    reference = load_engines(reference_dir, threads=1, backend="openvino")
    candidate = load_engines(candidate_dir, threads=1, backend="openvino")
    return {row.metric: float(row.value) for row in quality_guard(reference, candidate, _inputs(family))}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("precision", ("bf16", "int4"))
def test_reduced_precisions_pass_the_quality_guard(fp32, derived, family, precision):
    # Reduced-precision OpenVINO graphs compile in a child process: a native crash (OpenVINO's SIGFPE
    # on Intel AMX CPUs) fails this test with the signal and the suite goes on (tests/_isolated.py).
    rows = run_isolated(_quality_rows, fp32[family], derived(family, precision), family)
    report = ", ".join(f"{name} {value:.4g}" for name, value in rows.items())
    assert rows["llm_kl_mean"] <= KL_BOUND, report
    if cpu_has_bf16():
        assert rows["flow_mel_snr_db"] >= MEL_SNR_BOUND, report
    assert rows["hift_wav_snr_db"] == float("inf"), f"HiFT must stay float32: {report}"


def test_a_native_crash_at_compile_falls_back_at_build_and_is_a_clear_error_at_load(fp32, tmp_path, monkeypatch):
    """OpenVINO 2026.4 raises SIGFPE compiling the tiny CosyVoice2 LLM in bf16 on Intel AMX CPUs; a
    stand-in compile that does the same for graph 'llm' in bf16 (tests/_crashing_compile.py): the build
    records the fp32 fallback and finishes, engines from elsewhere give a clear error, nothing dies."""
    if not cpu_has_bf16():
        pytest.skip("this CPU has no bf16 kernels: every graph compiles in fp32, so there is no bf16 compile to crash")
    import trt_cosy.runtime.backends.openvino.runner as ov_runtime
    from trt_cosy.errors import BuildError, NativeCrashError
    from trt_cosy.runtime import native_guard

    monkeypatch.setattr(ov_runtime, "COMPILE_CHECK_TARGET", "_crashing_compile:compile_or_crash")
    monkeypatch.setenv("TRT_COSY_TEST_CRASH", "llm:bf16")
    monkeypatch.setenv("TRT_COSY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native_guard, "_checked", {})
    engines = derive_openvino_engines(fp32["v2"], tmp_path / "bf16", "bf16")
    manifest = Manifest.read(engines)
    llm = manifest.graphs["llm"]
    assert llm.compute == "fp32" and "SIGFPE" in llm.compute_reason and "bf16" in llm.compute_reason, llm
    assert manifest.compile_check["graphs"]["llm"] == "fp32"
    assert manifest.compile_check["graphs"]["flow_estimator"] == "bf16"
    assert manifest.graphs["flow_estimator"].compute is None  # no fallback where none was needed
    # The same machine trusts the build's record: no child process, the LLM compiles in fp32.
    real_child = native_guard.run_in_child
    monkeypatch.setattr(native_guard, "run_in_child", lambda *a, **k: pytest.fail("checked again"))
    model = load_engines(engines, threads=1, backend="openvino", lazy_graphs=())
    assert "float32" in model.runners["llm"].inference_precision
    assert "bfloat16" in model.runners["flow_estimator"].inference_precision
    # Engines built elsewhere (no record, no fallback): the load's check crashes in its child.
    raw = manifest.to_dict()
    del raw["compile_check"]
    for record in raw["graphs"].values():
        record.pop("compute", None), record.pop("compute_reason", None)
    Manifest.from_dict(raw).write(engines)
    monkeypatch.setattr(native_guard, "run_in_child", real_child)
    with pytest.raises(NativeCrashError) as caught:
        load_engines(engines, threads=1, backend="openvino", lazy_graphs=())
    for part in ("SIGFPE", "'llm'", "bf16", "OpenVINO 2026", "--precision fp32", "--backend onnxruntime"):
        assert part in str(caught.value), caught.value
    # A graph that crashes in fp32 too cannot be built on OpenVINO here: the build says what to use.
    monkeypatch.setenv("TRT_COSY_TEST_CRASH", "llm:bf16,llm:fp32")
    with pytest.raises(BuildError, match="--backend onnxruntime"):
        derive_openvino_engines(fp32["v2"], tmp_path / "bf16-again", "bf16")
    assert not (tmp_path / "bf16-again").exists()


def test_int4_engines_store_compressed_llm_weights(fp32, derived):
    engines = derived("v2", "int4")
    assert Manifest.read(engines).precision == "int4"
    assert (engines / "llm.bin").stat().st_size < 0.5 * (fp32["v2"] / "llm.bin").stat().st_size
    assert (engines / "flow_estimator.bin").stat().st_size == (
        fp32["v2"] / "flow_estimator.bin"
    ).stat().st_size
    model = ov.Core().read_model(str(engines / "llm.xml"))
    types = {
        str(op.get_output_element_type(0))
        for op in model.get_ordered_ops()
        if op.get_type_name() == "Constant"
    }
    assert any("i8" in name or "int8" in name for name in types), types


def test_compress_matmul_weights_bounds_the_error(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((2 * INT4_GROUP, 96)).astype(np.float32)  # [K, N], K splits into groups
    w2 = rng.standard_normal((96, 32)).astype(np.float32)  # the last MatMul: int8 even under int4
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("MatMul", ["h", "w2"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 2 * INT4_GROUP])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 32])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save(model, str(tmp_path / "g.onnx"))
    x = rng.standard_normal((4, 2 * INT4_GROUP)).astype(np.float32)
    reference = x @ w1 @ w2
    errors = {}
    for bits, bound in ((8, 0.02), (4, 0.2)):  # relative L2 error of random Gaussian weights
        converted = ov.convert_model(str(tmp_path / "g.onnx"))
        assert compress_matmul_weights(converted, bits) == 2
        kinds = sorted(
            str(op.get_output_element_type(0))
            for op in converted.get_ordered_ops()
            if op.get_type_name() == "Constant"
            and op.get_output_element_type(0).is_integral_number()
            and len(op.get_output_shape(0)) >= 2
        )
        assert len(kinds) == 2, kinds
        compiled = ov.Core().compile_model(converted, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        out = compiled(x)[0]
        errors[bits] = float(np.linalg.norm(out - reference) / np.linalg.norm(reference))
        assert 0 < errors[bits] < bound, errors
    assert errors[4] > errors[8]


def test_pinned_sinusoid_arguments_are_not_returned(fp32):
    path = fp32["v2"] / "flow_estimator.xml"
    model = ov.Core().read_model(str(path))
    assert pin_sinusoid_arguments(model) == 2  # the time embedding's sin and cos
    runner = OvRunner.from_path(path, "flow_estimator", threads=1, compute="bf16")
    assert runner.output_names == ("estimator_out",)
    assert runner.input_names == ("x", "mask", "mu", "t", "spks", "cond")


def test_kv_decoder_matches_feeding_the_cache_back(fp32):
    runner = OvRunner.from_path(fp32["v2"] / "llm.xml", "llm", threads=1)
    qwen = load_engines(fp32["v2"], threads=1, backend="openvino").config.llm.qwen
    shape = (qwen.num_layers, 1, qwen.num_kv_heads, 0, qwen.head_dim)
    rng = np.random.default_rng(0)
    steps = [rng.standard_normal((1, t, qwen.hidden_size)).astype(np.float32) for t in (5, 1, 1, 3, 1)]
    decoder = runner.kv_decoder(shape)
    assert isinstance(decoder, OvKVDecoder)
    keys, values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
    for inputs in steps:
        fed = runner.infer({"inputs_embeds": inputs, "past_keys": keys, "past_values": values})
        keys, values = fed["present_keys"], fed["present_values"]
        np.testing.assert_allclose(decoder.step(inputs), fed["logits"], rtol=1e-5, atol=1e-5)
    assert decoder.cached == sum(step.shape[1] for step in steps)


def test_say_auto_loads_openvino_engines(fp32, tmp_path):
    out = tmp_path / "ov.wav"
    ref = tmp_path / "ref.wav"
    soundfile.write(ref, 0.1 * np.sin(np.linspace(0, 600, 24000 * 2)).astype(np.float32), 24000)
    result = CliRunner().invoke(
        main,
        ["say", "Hello there.", "--engines", str(fp32["v2"]), "--ref", str(ref), "--ref-text", "a test",
         "-o", str(out), "--seed", "0", "--threads", "1"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    audio, rate = soundfile.read(out)
    assert rate == 24000 and audio.size > 0 and np.isfinite(audio).all()


def test_streaming_and_concurrent_requests_match_one_at_a_time(fp32, tmp_path):
    tts = CosyVoice.load(fp32["v2"], config=EngineConfig(threads=1, normalizer="none"))
    assert tts.model.backend == "openvino"
    ref = tmp_path / "ref.wav"
    soundfile.write(ref, 0.1 * np.sin(np.linspace(0, 900, 24000 * 2)).astype(np.float32), 24000)
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
    for one, many in zip(alone, together, strict=True):
        np.testing.assert_allclose(many, one, atol=1e-5)
    streamed = speak(texts[1], stream=True)
    assert streamed.size > 0 and np.isfinite(streamed).all()


# Incremental chunks, max |mel difference| per chunk: fp32 against the same engines' recomputed chunks
# (measured 3.0e-6), bf16 against the fp32 engines' (measured 0.042-0.052; bf16 recomputation 0.046-0.32).
@pytest.mark.parametrize("precision,tolerance", (("fp32", 5e-5), ("bf16", 0.1)))
def test_streaming_chunks_through_the_incremental_graph_match_recomputation(
    fp32, derived, precision, tolerance
):
    engines = fp32["v2"] if precision == "fp32" else derived("v2", precision)
    model = load_engines(engines, threads=1, backend="openvino")
    assert type(model.runners[INCREMENTAL]).__name__ == "LazyOvRunner"
    reference = load_engines(fp32["v2"], threads=1, backend="openvino")
    errors = chunk_errors(model, GoldenSet.load(V2_GOLDEN / "reference.npz"), "official", reference)
    assert len(errors) >= 4 and max(errors) <= tolerance, errors


def test_openvino_engines_load_without_torch(fp32):
    code = BLOCK_TORCH + textwrap.dedent(
        f"""
        from trt_cosy import CosyVoice, EngineConfig
        tts = CosyVoice.load({str(fp32["v2"])!r}, backend="openvino", config=EngineConfig(threads=1))
        assert tts.model.backend == "openvino"
        assert "torch" not in sys.modules
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
