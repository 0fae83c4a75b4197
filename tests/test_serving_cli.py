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
    (with one KV slot per --max-concurrent); refused with --ray (its replicas load the default)."""
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
    result = cli.invoke(main, ["serve", "--engines", str(tmp_path), "--ray", "--deterministic"])
    assert result.exit_code == 2 and "not passed to Ray replicas" in result.output, result.output
