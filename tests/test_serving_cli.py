"""Option checks of `trt-cosy serve --ray` (no Ray needed: refused before anything starts)."""

from __future__ import annotations

from click.testing import CliRunner

from trt_cosy.cli import main


def test_ray_options_need_ray_and_one_scale(tmp_path):
    runner = CliRunner()
    engines = ["serve", "--engines", str(tmp_path)]
    cases = {
        ("--replicas", "2"): "go with --ray",
        ("--ray", "--replicas", "2", "--autoscale", "1:2"): "only one of --replicas, --autoscale",
        ("--ray", "--autoscale", "3:1"): "MIN <= MAX",
        ("--ray", "--autoscale", "two"): "use MIN:MAX",
        ("--ray", "--workers", "2"): "with --ray use --replicas",
    }
    for args, message in cases.items():
        result = runner.invoke(main, [*engines, *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_serve_deterministic_reaches_the_engine_config(tmp_path, monkeypatch):
    """`--deterministic` / `--no-deterministic` / neither -> EngineConfig.deterministic True / False / None
    (with one KV slot per --max-concurrent)."""
    from types import SimpleNamespace

    from trt_cosy.server import runner as server_runner
    from trt_cosy.tts import CosyVoice

    seen = []

    def fake_load(cls, path, backend="auto", config=None):
        seen.append(config)
        return SimpleNamespace(model_id="fake")

    monkeypatch.setattr(CosyVoice, "load", classmethod(fake_load))
    monkeypatch.setattr(server_runner, "run_server", lambda tts, settings: None)
    monkeypatch.setenv("TRT_COSY_CACHE", str(tmp_path / "cache"))
    cli = CliRunner()
    for flag, expected in (("--deterministic", True), ("--no-deterministic", False), (None, None)):
        args = ["serve", "--engines", str(tmp_path), "--max-concurrent", "3", *([flag] if flag else [])]
        result = cli.invoke(main, args)
        assert result.exit_code == 0, result.output
        assert seen[-1].deterministic is expected and seen[-1].llm_slots == 3



def test_ray_replicas_get_the_deterministic_flag_and_a_kv_slot_per_concurrent_request(tmp_path, monkeypatch):
    """`--ray --deterministic` reaches RayServeOptions, and each replica's EngineConfig (with one KV slot of
    the shared decode loop per --max-concurrent, as `trt-cosy serve`)."""
    import pytest

    for module in ("ray", "fastapi", "uvicorn", "python_multipart", "prometheus_client"):
        pytest.importorskip(module)
    from types import SimpleNamespace

    from trt_cosy.runtime.manifest import Manifest
    from trt_cosy.serving import ray_app
    from trt_cosy.tts import CosyVoice

    seen = []
    monkeypatch.setattr(ray_app, "run_ray_serve", lambda options, progress: seen.append(options))
    result = CliRunner().invoke(main, ["serve", "--engines", str(tmp_path), "--ray", "--deterministic",
                                       "--max-concurrent", "3"])
    assert result.exit_code == 0, result.output
    assert seen[-1].deterministic is True and seen[-1].max_concurrent == 3
    monkeypatch.setattr(Manifest, "read", classmethod(lambda cls, path: SimpleNamespace(backend="onnxruntime")))
    monkeypatch.setattr(ray_app, "_replica_id", lambda: "r0")
    configs = []
    monkeypatch.setattr(CosyVoice, "load", classmethod(
        lambda cls, path, backend="auto", config=None: configs.append(config) or SimpleNamespace(model_id="fake")))
    bound = ray_app.deployment_for(seen[-1])._bound_deployment  # what every replica is constructed with
    ray_app.TrtCosyReplica(*bound.init_args[:3], None, *bound.init_args[4:])  # None: no pinning in the test
    assert configs[-1].deterministic is True and configs[-1].llm_slots == 3
