"""Without the ``openvino`` package: building or loading OpenVINO engines names the extra to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCK_OPENVINO = textwrap.dedent(
    """
    import sys
    class _NoOpenVINO:
        def find_spec(self, name, path=None, target=None):
            if name == "openvino" or name.startswith("openvino."):
                raise ImportError("openvino is blocked in this test")
            return None
    sys.meta_path.insert(0, _NoOpenVINO())
    """
)


def test_missing_openvino_names_the_extra() -> None:
    code = BLOCK_OPENVINO + textwrap.dedent(
        """
        from trt_cosy.errors import MissingDependencyError
        from trt_cosy.runtime.backends.openvino.runner import OvRunner, graph_precisions
        assert graph_precisions("bf16", ("llm", "hift")) == {"llm": "bf16", "hift": "fp32"}  # no openvino needed
        try:
            OvRunner.from_path("/nonexistent.xml", "llm")
        except MissingDependencyError as exc:
            assert "pip install 'trt-cosy[openvino]'" in str(exc), exc
            print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
