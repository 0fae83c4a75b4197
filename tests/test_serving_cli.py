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
