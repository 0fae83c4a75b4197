"""`trt-cosy say`, `voices save` and `download`: options, bad input, the cache, and a torch-free run.

Fast tests drive the CLI with CliRunner and a CosyVoice injected in place of ``CosyVoice.load``
(the torch reference model of tests/test_tts.py; where audio is written, a stub renders it).
Slow tests run the real commands on ONNX Runtime engines in a subprocess with ``import torch`` blocked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import soundfile

# Shared fixtures and helpers of the API tests (tests/ is on sys.path under pytest's default import mode).
from _support import BLOCK_TORCH, REF_TEXT, reference_wavs, require_build_extra, tiny_engines, tiny_release
from _tts_support import make_torch_tts, stub_models
from click.testing import CliRunner

from trt_cosy import InputError, Voice
from trt_cosy.cli import main
from trt_cosy.download import engines_cache_dir
from trt_cosy.runtime import backend_choice
from trt_cosy.tts import CosyVoice


@pytest.fixture(scope="module")
def wavs(tmp_path_factory) -> dict[str, Path]:
    return reference_wavs(tmp_path_factory.mktemp("cli-wavs"))


@pytest.fixture(scope="module")
def torch_tts(tmp_path_factory, v2_tiny_dir) -> CosyVoice:
    return make_torch_tts(tiny_release(tmp_path_factory, v2_tiny_dir))


@pytest.fixture
def injected(torch_tts, monkeypatch) -> CosyVoice:
    """``CosyVoice.load`` returns the torch-reference CosyVoice; records the paths it was asked for."""
    torch_tts.loaded_from = []

    def fake_load(path, backend="auto", config=None):
        torch_tts.loaded_from.append(Path(path))
        return torch_tts

    monkeypatch.setattr(CosyVoice, "load", staticmethod(fake_load))
    return torch_tts


@pytest.fixture
def stub_render(injected, monkeypatch) -> CosyVoice:
    """Synthesis renders 0.1 s of a sine per chunk (the plumbing is under test, not the models)."""
    stub_models(monkeypatch, lambda call, plan: (0.1 * np.sin(np.arange(2400) / 10.0)).astype(np.float32))
    return injected


def _invoke(*args: str):
    return CliRunner().invoke(main, [str(arg) for arg in args])


def _save_voice(tts: CosyVoice, wav: Path, path: Path, model_id: str | None = None) -> Path:
    voice = tts.voice_from_wav(wav, REF_TEXT)
    if model_id is not None:
        fields = {key: getattr(voice, key) for key in voice.__dataclass_fields__}
        voice = Voice(**{**fields, "model_id": model_id})
    return voice.save(path)


# ----------------------------------------------------------------------------- options and bad input


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "pass --ref ref.wav"),
        (["--ref", "{ref}", "--voice", "{voice}"], "only one of --ref, --voice"),
        (["--voice", "{voice}", "--ref-text", "hi"], "--ref-text goes with --ref"),
        (["--ref", "{ref}", "--model-dir", "{dir}"], "only one of --engines, --model-dir"),
    ],
)
def test_say_usage_errors(injected, wavs, tmp_path, extra, message):
    voice = _save_voice(injected, wavs["ref"], tmp_path / "voice.npz")
    values = {"ref": wavs["ref"], "voice": voice, "dir": tmp_path}
    args = [item.format(**values) for item in extra]
    result = _invoke("say", "Hello.", "--engines", tmp_path, *args, "-o", tmp_path / "out.wav")
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert not (tmp_path / "out.wav").exists()


@pytest.mark.parametrize(
    ("text", "source", "message"),
    [
        ("", "ref", "text is empty"),
        (" \n ", "ref", "text is empty"),
        ("?!…", "ref", "only punctuation or symbols"),
        (" ".join(["word"] * 600), "ref", "fit in one segment"),
        ("Hello.", "short", "at least 1 s"),
        ("Hello.", "long", "at most 30 s"),
        ("Hello.", "silent", "is silent"),
        ("Hello.", "unreadable", "could not read"),
        ("Hello.", "not_a_voice", "is not a trt-cosy voice file"),
        ("Hello.", "missing_voice", "does not exist. Make one with `trt-cosy voices save`"),
        ("Hello.", "foreign_voice", "this voice was made for model v2-00000000deadbeef"),
    ],
)
def test_say_bad_input_gives_its_message_and_no_file(injected, wavs, tmp_path, text, source, message):
    if source in wavs or source == "ref":
        voice_args = ["--ref", wavs[source], "--ref-text", REF_TEXT]
    elif source == "not_a_voice":
        voice_args = ["--voice", wavs["ref"]]
    elif source == "missing_voice":
        voice_args = ["--voice", tmp_path / "nope.npz"]
    else:
        foreign = _save_voice(injected, wavs["ref"], tmp_path / "foreign.npz", model_id="v2-00000000deadbeef")
        voice_args = ["--voice", foreign]
    out = tmp_path / "out.wav"
    result = _invoke("say", text, "--engines", tmp_path, *voice_args, "-o", out)
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and message in result.output, result.output
    assert not out.exists()
    assert not [path for path in tmp_path.iterdir() if path.name.startswith(".out.wav")]


def test_say_on_missing_engines_says_to_build(wavs, tmp_path):
    out = tmp_path / "out.wav"
    result = _invoke("say", "Hello.", "--engines", tmp_path / "engines", "--ref", wavs["ref"], "-o", out)
    assert result.exit_code == 2, result.output
    assert "trt-cosy build" in result.output
    assert not out.exists()


# ----------------------------------------------------------------------------- cache, build, download


def test_say_model_dir_builds_engines_into_the_cache(stub_render, wavs, tmp_path, monkeypatch, v2_tiny_dir):
    import trt_cosy.builder.engines as build_module

    monkeypatch.setenv("TRT_COSY_CACHE", str(tmp_path / "cache"))
    release = tmp_path / "release"
    shutil.copytree(v2_tiny_dir, release)
    builds = []

    def fake_build(model_dir, out_dir, backend, precision, force=False, progress=None, backend_reason=None):
        builds.append((Path(model_dir), Path(out_dir), backend, precision))
        assert "no CUDA GPU with TensorRT here" in backend_reason
        progress("fake build step")
        return Path(out_dir)

    monkeypatch.setattr(build_module, "build_engines", fake_build)
    monkeypatch.setattr(backend_choice, "gpu_unavailable_reason", lambda: "no GPU (test)")
    out = tmp_path / "out.wav"
    result = _invoke(
        "say", "Hello there.", "--model-dir", release, "--ref", wavs["ref"], "-o", out, "--seed", 1
    )
    assert result.exit_code == 0, result.output
    expected_dir = engines_cache_dir(release)
    assert builds == [(release, expected_dir, "onnxruntime", "int4")]  # the CPU default (docs/precision.md)
    assert expected_dir.is_relative_to(tmp_path / "cache" / "engines")
    assert expected_dir.name == "onnxruntime-int4" and expected_dir.parent.name.startswith("release-")
    assert "fake build step" in result.output and stub_render.loaded_from == [expected_dir]
    assert "backend: onnxruntime int4 (no CUDA GPU with TensorRT here" in result.output
    audio, rate = soundfile.read(out, dtype="float32")
    assert rate == 24000 and audio.shape == (2400,)


@pytest.fixture
def hubs_answer(monkeypatch):
    """The download sources' hosts count as reachable (the hubs themselves are faked by each test)."""
    import trt_cosy.download as download_module

    monkeypatch.setattr(download_module, "_probe", lambda source: None)


def _fake_modelscope(monkeypatch, snapshot_download) -> None:
    """``import modelscope`` gives a module whose snapshot_download is the given function."""
    import types

    module = types.ModuleType("modelscope")
    module.snapshot_download = snapshot_download
    monkeypatch.setitem(sys.modules, "modelscope", module)


def _fake_hub(release: Path, calls: list):
    def snapshot_download(repo_id, local_dir, allow_patterns=None, **kwargs):
        calls.append((repo_id, tuple(allow_patterns or ())))
        shutil.copytree(release, local_dir, dirs_exist_ok=True)
        return local_dir

    return snapshot_download


def test_say_without_a_model_downloads_builds_and_speaks(
    stub_render, wavs, tmp_path, monkeypatch, tmp_path_factory, v2_tiny_dir, hubs_answer
):
    huggingface_hub = pytest.importorskip("huggingface_hub", reason="needs the [download] extra (huggingface_hub)")

    import trt_cosy.builder.engines as build_module

    monkeypatch.setenv("TRT_COSY_CACHE", str(tmp_path / "cache"))
    calls: list = []
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", _fake_hub(tiny_release(tmp_path_factory, v2_tiny_dir), calls)
    )
    monkeypatch.setattr(build_module, "build_engines", lambda model_dir, out_dir, **kwargs: Path(out_dir))
    out = tmp_path / "out.wav"
    result = _invoke("say", "Hello.", "--ref", wavs["ref"], "-o", out)
    assert result.exit_code == 0, result.output
    assert "CosyVoice2-0.5B" in result.output and out.is_file()
    assert [repo for repo, _ in calls] == ["FunAudioLLM/CosyVoice2-0.5B"]
    assert "llm.pt" in calls[0][1] and not any("safetensors" in pattern for pattern in calls[0][1])
    release = tmp_path / "cache" / "models" / "CosyVoice2-0.5B"
    assert stub_render.loaded_from == [engines_cache_dir(release)]
    # A second download finds the complete release and fetches nothing.
    result = _invoke("download")
    assert result.exit_code == 0, result.output
    assert str(release) in result.output and len(calls) == 1


def test_no_network_gives_a_clear_message_and_no_file(wavs, tmp_path, monkeypatch, hubs_answer):
    huggingface_hub = pytest.importorskip("huggingface_hub", reason="needs the [download] extra (huggingface_hub)")

    def offline(*args, **kwargs):
        raise ConnectionError("Network is unreachable")

    monkeypatch.setenv("TRT_COSY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    _fake_modelscope(monkeypatch, offline)
    result = _invoke("download", "--dir", tmp_path / "release")
    assert result.exit_code == 2, result.output
    assert "Network is unreachable" in result.output and "--model-dir" in result.output
    assert "could not reach huggingface (Network is unreachable); trying modelscope" in result.output
    assert "git lfs install && git clone https://huggingface.co/FunAudioLLM/CosyVoice2-0.5B" in result.output
    assert "trt-cosy make-test-model --out models/tiny" in result.output  # how to go on offline
    assert not (tmp_path / "release").exists()  # the folder it made is removed again
    out = tmp_path / "out.wav"
    result = _invoke("say", "Hello.", "--ref", wavs["ref"], "-o", out)
    assert result.exit_code == 2 and "--model-dir" in result.output, result.output
    assert not out.exists()
    assert not (tmp_path / "cache" / "models" / "CosyVoice2-0.5B").exists()


def test_download_options_are_checked(tmp_path, monkeypatch):
    result = _invoke("download", "CosyVoice9-1B", "--dir", tmp_path)
    assert result.exit_code == 2 and "unknown model 'CosyVoice9-1B'" in result.output, result.output
    monkeypatch.setitem(sys.modules, "modelscope", None)  # as if not installed
    result = _invoke("download", "--source", "modelscope", "--dir", tmp_path)
    assert result.exit_code == 2 and "pip install 'trt-cosy[download]'" in result.output, result.output


# ----------------------------------------------------------------------------- torch-free end to end


def test_new_commands_import_no_torch():
    code = BLOCK_TORCH + textwrap.dedent(
        """
        import trt_cosy.tts, trt_cosy.download
        from trt_cosy.cli import main
        for args in (["say", "--help"], ["voices", "save", "--help"], ["download", "--help"]):
            try:
                main(args)
            except SystemExit as exc:
                assert exc.code == 0, (args, exc.code)
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--ref-text" in result.stdout and "--source" in result.stdout


def _run_cli_without_torch(
    commands: list[list[str]], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    code = BLOCK_TORCH + textwrap.dedent(
        f"""
        from trt_cosy.cli import main
        for args in {commands!r}:
            try:
                main(args, standalone_mode=False)
            except SystemExit as exc:
                sys.exit(f"{{args[0]}} exited with {{exc.code}}")
        assert "torch" not in sys.modules, "torch was imported"
        print("all commands ok")
        """
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env={**os.environ, **env}
    )


@pytest.mark.slow
def test_say_voices_save_round_trip_without_torch(tmp_path_factory, v2_tiny_dir, wavs, tmp_path, monkeypatch):
    engines = tiny_engines(tmp_path_factory, v2_tiny_dir)
    release = tiny_release(tmp_path_factory, v2_tiny_dir)
    env = {"TRT_COSY_CACHE": str(tmp_path / "cache")}
    monkeypatch.setenv("TRT_COSY_CACHE", env["TRT_COSY_CACHE"])
    cached_dir = engines_cache_dir(release, "fp32")
    cached_dir.parent.mkdir(parents=True)
    cached_dir.symlink_to(engines, target_is_directory=True)  # current engines: `--model-dir` must not build
    ref, out = str(wavs["ref"]), tmp_path
    commands = [
        ["say", "Good morning.", "--engines", str(engines), "--ref", ref, "--ref-text", REF_TEXT,
         "-o", str(out / "ref.wav"), "--seed", "5", "--threads", "1"],
        ["voices", "save", "--ref", ref, "--ref-text", REF_TEXT, "--engines", str(engines),
         "-o", str(out / "voice.npz")],
        ["say", "Good morning.", "--engines", str(engines), "--voice", str(out / "voice.npz"),
         "-o", str(out / "voice.wav"), "--seed", "5"],
        ["say", "Good morning.", "--model-dir", str(release), "--precision", "fp32",
         "--voice", str(out / "voice.npz"), "-o", str(out / "cached.wav"), "--seed", "5"],
    ]  # fmt: skip
    result = _run_cli_without_torch(commands, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "all commands ok" in result.stdout
    first, rate = soundfile.read(out / "ref.wav", dtype="float32")
    assert rate == 24000 and first.shape[0] > 0 and first.shape[0] % (2 * 480) == 0, first.shape
    assert np.abs(first).max() > 1e-3
    for name in ("voice.wav", "cached.wav"):
        other, _ = soundfile.read(out / name, dtype="float32")
        np.testing.assert_array_equal(other, first, err_msg=name)
    assert Voice.load(out / "voice.npz").prompt_text == REF_TEXT


# ----------------------------------------------------------------------------- --stream and --play


def test_say_stream_writes_progressively_with_progress_and_plays(stub_render, wavs, tmp_path, monkeypatch):
    played = tmp_path / "played.raw"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    player = bin_dir / "aplay"
    player.write_text(f"#!/bin/sh\nexec {shutil.which('cat')} > {played}\n", encoding="utf-8")
    player.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    out = tmp_path / "out.wav"
    args = (
        "say",
        "Hello there.",
        "--engines",
        tmp_path,
        "--ref",
        wavs["ref"],
        "-o",
        out,
        "--stream",
        "--play",
    )
    result = _invoke(*args)
    assert result.exit_code == 0, result.output
    assert "segment 1/1, chunk 1: 0.10 s of audio so far (first audio" in result.output, result.output
    assert "RTF" in result.output
    audio, rate = soundfile.read(out, dtype="float32")
    assert rate == 24000 and audio.shape == (2400,)
    heard = np.frombuffer(played.read_bytes(), dtype="<f4")
    assert heard.shape == (2400,) and np.abs(heard - audio).max() <= 1 / 32768 + 1e-6
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bin", "out.wav", "played.raw"]


def test_say_play_without_a_player_still_writes_the_file(stub_render, wavs, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "out.wav"
    result = _invoke("say", "Hello.", "--engines", tmp_path, "--ref", wavs["ref"], "-o", out, "--play")
    assert result.exit_code == 0, result.output
    assert "no audio player found" in result.output and out.is_file()


def test_say_stream_error_mid_request_leaves_no_file(injected, wavs, tmp_path, monkeypatch):
    def render(call, plan):
        if call == 1:
            raise InputError("simulated failure in the second chunk")
        return np.zeros(960, np.float32)

    stub_models(monkeypatch, render)
    out = tmp_path / "out.wav"
    text = "This sentence is about the weather and the sea and the wind today. " * 6
    result = _invoke("say", text, "--engines", tmp_path, "--ref", wavs["ref"], "-o", out, "--stream")
    assert result.exit_code == 2 and "simulated failure" in result.output, result.output
    assert ", chunk 1: " in result.output
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- progress, messages, options


_LONG_TEXT = "This sentence is about the weather and the sea and the wind today. " * 6


def test_say_progress_names_segments_audio_and_rtf_and_quiet_silences_it(stub_render, wavs, tmp_path, monkeypatch):
    import trt_cosy.cli.say as say_module

    monkeypatch.setattr(say_module, "_PROGRESS_AFTER_S", 0.0)  # as if the synthesis were long
    out = tmp_path / "out.wav"
    result = _invoke("say", _LONG_TEXT, "--engines", tmp_path, "--ref", wavs["ref"], "-o", out)
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("segment ")]
    count = len(lines)
    assert count > 1 and lines[0].startswith(f"segment 1/{count}: 0.10 s of audio so far (elapsed ")
    assert lines[-1].startswith(f"segment {count}/{count}: {0.1 * count:.2f} s of audio so far")
    assert all("RTF" in line and "chunk" not in line for line in lines)  # no stream chunks without --stream
    result = _invoke("say", _LONG_TEXT, "--engines", tmp_path, "--ref", wavs["ref"], "-o", out, "--quiet")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"wrote {out}"


def test_say_short_synthesis_prints_no_progress(stub_render, wavs, tmp_path):
    out = tmp_path / "out.wav"
    result = _invoke("say", "Hello.", "--engines", tmp_path, "--ref", wavs["ref"], "-o", out)
    assert result.exit_code == 0 and result.output.strip() == f"wrote {out}", result.output


def test_say_heartbeat_while_a_segment_renders(injected, wavs, tmp_path, monkeypatch):
    import time

    import trt_cosy.cli.say as say_module

    def slow_render(call, plan):
        time.sleep(0.3)
        return np.zeros(960, np.float32)

    stub_models(monkeypatch, slow_render)
    monkeypatch.setattr(say_module, "_HEARTBEAT_S", 0.1)
    result = _invoke("say", "Hello there.", "--engines", tmp_path, "--ref", wavs["ref"], "-o", tmp_path / "o.wav")
    assert result.exit_code == 0, result.output
    assert "still synthesising (segment 1, 0.00 s of audio so far, elapsed" in result.output


def test_say_speaker_on_a_model_without_presets_answers_in_cli_terms(injected, tmp_path):
    result = _invoke("say", "Hello.", "--engines", tmp_path, "--speaker", "中文女", "-o", tmp_path / "o.wav")
    assert result.exit_code == 2, result.output
    assert "this model has no preset speakers" in result.output and "use --ref" in result.output
    assert "trt_cosy.Voice" not in result.output


def test_say_unknown_speaker_lists_the_valid_names(injected, tmp_path, monkeypatch):
    embedding = np.zeros(192, np.float32)
    monkeypatch.setattr(injected, "speaker_embeddings", {"中文女": embedding, "英文男": embedding})
    result = _invoke("say", "Hello.", "--engines", tmp_path, "--speaker", "nobody", "-o", tmp_path / "o.wav")
    assert result.exit_code == 2, result.output
    assert "unknown speaker 'nobody'; this model has: 中文女, 英文男" in result.output


def test_voice_option_on_a_pickle_never_suggests_allow_pickle(injected, tmp_path):
    pickled = tmp_path / "evil.npz"
    np.savez(pickled, header=np.array([{"format": "trt-cosy-voice"}], dtype=object))
    result = _invoke("say", "Hello.", "--engines", tmp_path, "--voice", pickled, "-o", tmp_path / "o.wav")
    assert result.exit_code == 2, result.output
    assert "is not a trt-cosy voice file" in result.output and "pickled Python objects" in result.output
    assert "allow_pickle" not in result.output


def test_voice_and_cosyvoice_repr_are_one_short_line(injected, wavs):
    voice = injected.voice_from_wav(wavs["ref"], REF_TEXT)
    text = repr(voice)
    assert text.startswith("Voice(zero-shot, prompt_text=") and "prompt tokens" in text
    assert "\n" not in text and len(text) < 250 and "array" not in text
    text = repr(injected)
    assert text.startswith("CosyVoice(model_id='v2-") and "sample_rate=24000" in text and len(text) < 200


def test_verbose_after_the_subcommand(injected, tmp_path):
    import logging

    root = logging.getLogger()
    level = root.level
    try:
        root.setLevel(logging.WARNING)
        result = _invoke("voices", "list", "--engines", tmp_path, "-vv")
        assert result.exit_code == 0, result.output
        assert root.level == logging.DEBUG
    finally:
        root.setLevel(level)
    result = _invoke("say", "--help")
    assert "--verbose" in result.output


def test_bench_and_serve_take_model_dir(tmp_path, monkeypatch, v2_tiny_dir):
    require_build_extra()  # engines missing from the cache are built (faked here), which needs the extra
    import trt_cosy.bench.speed as benchmark_module
    import trt_cosy.builder.engines as build_module

    monkeypatch.setenv("TRT_COSY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build_module, "build_engines", lambda model_dir, out_dir, **kwargs: Path(out_dir))
    measured = []
    monkeypatch.setattr(benchmark_module, "run_bench", lambda path, options, progress: measured.append(path) or {})
    monkeypatch.setattr(benchmark_module, "format_bench", lambda report: "report")
    result = _invoke("bench", "--model-dir", v2_tiny_dir)
    assert result.exit_code == 0, result.output
    assert measured == [engines_cache_dir(v2_tiny_dir)]
    result = _invoke("bench")
    assert result.exit_code == 2 and "pass --engines ENGINES" in result.output, result.output
    result = _invoke("serve", "--help")
    assert "--model-dir" in result.output


def test_make_test_model_on_a_full_folder_refuses_before_importing_torch(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "keep.txt").write_text("mine", encoding="utf-8")
    code = BLOCK_TORCH + textwrap.dedent(
        f"""
        from trt_cosy.cli import main
        main(["make-test-model", "--out", {str(tmp_path / "model")!r}])
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "exists and is not empty" in result.stderr and "--overwrite" in result.stderr
    assert (tmp_path / "model" / "keep.txt").read_text(encoding="utf-8") == "mine"


# ----------------------------------------------------------------------------- download: sources and probes


def test_download_falls_back_to_the_other_source_when_the_first_is_unreachable(
    tmp_path, monkeypatch, tmp_path_factory, v2_tiny_dir
):
    import trt_cosy.download as download_module

    def probe(source):
        if source == "huggingface":
            raise download_module._Unreachable("cannot reach huggingface.co:443: Name or service not known")

    monkeypatch.setattr(download_module, "_probe", probe)
    calls: list = []
    _fake_modelscope(monkeypatch, _fake_hub(tiny_release(tmp_path_factory, v2_tiny_dir), calls))
    result = _invoke("download", "--dir", tmp_path / "release")
    assert result.exit_code == 0, result.output
    assert "could not reach huggingface (cannot reach huggingface.co:443" in result.output
    assert "trying modelscope" in result.output
    assert [repo for repo, _ in calls] == ["iic/CosyVoice2-0.5B"]
    assert (tmp_path / "release" / "llm.pt").is_file()


def test_download_other_errors_do_not_fall_back_and_a_repo_id_has_one_source(tmp_path, monkeypatch, hubs_answer):
    huggingface_hub = pytest.importorskip("huggingface_hub", reason="needs the [download] extra (huggingface_hub)")

    tried = []

    def not_found(repo_id, **kwargs):
        tried.append(repo_id)
        raise ValueError(f"Repository Not Found for url: https://huggingface.co/api/models/{repo_id}")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", not_found)
    _fake_modelscope(monkeypatch, lambda *args, **kwargs: tried.append("modelscope"))
    result = _invoke("download", "--dir", tmp_path / "a")
    assert result.exit_code == 2 and "Repository Not Found" in result.output, result.output
    result = _invoke("download", "someone/CosyVoice2-copy", "--dir", tmp_path / "b")
    assert result.exit_code == 2 and "trying" not in result.output, result.output
    assert tried == ["FunAudioLLM/CosyVoice2-0.5B", "someone/CosyVoice2-copy"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_unreachable_host_fails_fast_and_proxies_skip_the_probe(monkeypatch):
    import socket
    import time

    import trt_cosy.download as download_module

    for name in download_module._PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as closed:  # a loopback port that nobody listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("MODELSCOPE_DOMAIN", f"127.0.0.1:{port}")
    started = time.monotonic()
    with pytest.raises(download_module._Unreachable, match=f"cannot reach 127.0.0.1:{port}"):
        download_module._probe("modelscope")
    assert time.monotonic() - started < 5
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    download_module._probe("modelscope")  # behind a proxy only the hub client knows the way
