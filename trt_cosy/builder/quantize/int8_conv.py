"""Static int8 convolutions for ONNX Runtime engines, calibrated on feeds recorded through the engines.

ONNX Runtime runs a ``QuantizeLinear -> QLinearConv -> DequantizeLinear`` group on the CPU's integer
dot products at 600-860 GOP/s, against 160-180 GFLOP/s for an fp32 ``Conv`` on two Zen 4 cores (the
dynamic ``ConvInteger`` is 4x slower than fp32: docs/benchmarks.md). The int4/int8 engines use it
where measurement says the quality holds: HiFT's residual blocks (``vocoder_int8``) and the flow
estimator's middle blocks (``estimator_int8``).

Both steps work the same way, here: load the (staging) engines, record what the family's own stage
feeds the graph (``Recorder``), quantise the chosen convolutions of the graph statically (int8 weights
per output channel, uint8 activations per tensor, ``MinMax`` ranges on the recorded feeds), write the
new graph aside and move it in (a hard-linked graph of other engines is never written through), and
refresh the directory's manifest so it keeps loading.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

import numpy as np
import onnx

from ...errors import BuildError
from ..quiet_logs import quiet_logger

__all__ = [
    "CALIBRATION_TARGETS",
    "CALIBRATION_UTTERANCES",
    "LOG_MEL_FLOOR",
    "Recorder",
    "convolutions_where",
    "log_mel_like",
    "quantize_convolutions",
    "rewrite_calibrated",
]

_LOGGER = logging.getLogger(__name__)

LOG_MEL_FLOOR: Final = -11.5129  # log(1e-5): the feature extractor's clamp
CALIBRATION_UTTERANCES: Final = 3  # seeded utterances run through the family's stages per calibration
CALIBRATION_TARGETS: Final = 100  # speech tokens per calibration utterance (4 s of CosyVoice2 audio)

Feed = dict[str, np.ndarray]
Progress = Callable[[str], None]


class Recorder:
    """A runner stand-in that passes every call through and keeps a copy of its feeds."""

    def __init__(self, runner: Any):
        self._runner = runner
        self.feeds: list[Feed] = []

    def infer(self, feeds: Mapping[str, np.ndarray], *args: Any, **kwargs: Any) -> Any:
        self.feeds.append({name: np.array(value, copy=True) for name, value in feeds.items()})
        return self._runner.infer(feeds, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)

    @classmethod
    def recording(cls, model: Any, graph: str, run: Callable[[], None]) -> list[Feed]:
        """The feeds ``graph`` of ``model`` (a ``LoadedModel``) receives while ``run()`` runs; the
        runner is put back afterwards. Nothing recorded is a ``BuildError`` (a trt-cosy bug)."""
        recorder = cls(model.runners[graph])
        model.runners[graph] = recorder
        try:
            run()
        finally:
            model.runners[graph] = recorder._runner
        if not recorder.feeds:
            raise BuildError(
                f"the stage never ran the graph {graph!r}: nothing to calibrate (a trt-cosy bug)."
            )
        return recorder.feeds

    @classmethod
    def utterances(
        cls, model: Any, graph: str, utterances: int, utterance: Callable[[Any, Any, int], object]
    ) -> list[Feed]:
        """``recording`` while ``utterance(feeds, inputs, seed)`` runs for ``utterances`` seeded
        utterances: ``feeds`` the family's quality feeds, ``inputs`` random ``QualityInputs`` of
        ``CALIBRATION_TARGETS`` speech tokens."""
        from ...family_lookup import family_of
        from ...verify.quality import QualityInputs

        feeds = family_of(model.config).quality

        def run() -> None:
            for seed in range(utterances):
                inputs = QualityInputs.random(model, targets=CALIBRATION_TARGETS, seed=1000 + seed)
                utterance(feeds, inputs, seed)

        return cls.recording(model, graph, run)


def convolutions_where(model: onnx.ModelProto, chosen: Callable[[str], object]) -> list[str]:
    """Names of the ``Conv`` nodes with a constant weight whose name ``chosen`` accepts."""
    initializers = {init.name for init in model.graph.initializer}
    return [
        node.name
        for node in model.graph.node
        if node.op_type == "Conv" and node.input[1] in initializers and chosen(node.input[1])
    ]


def log_mel_like(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Seeded values spread like log-mel speech features (mean -6, std 2, floor log(1e-5) = -11.5, at
    most 2): a random-weight checkpoint's flow does not produce that range, a trained one does, and the
    calibrated ranges must hold for both."""
    rng = np.random.default_rng(2000 + seed)
    return np.clip(rng.normal(-6.0, 2.0, shape), LOG_MEL_FLOOR, 2.0).astype(np.float32)


def quantize_convolutions(source: Path, target: Path, feeds: Sequence[Feed], nodes: Sequence[str]) -> int:
    """Write ``target``: ``source`` with the ``Conv`` nodes ``nodes`` in QDQ form (uint8 activations per
    tensor, calibrated MinMax on ``feeds``; int8 weights per output channel). Returns ``len(nodes)``."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Feeds(CalibrationDataReader):
        def __init__(self) -> None:
            self._feeds: Iterator[Feed] = iter(feeds)

        def get_next(self) -> Feed | None:
            return next(self._feeds, None)

    if not nodes:
        raise BuildError(f"{Path(source).name}: no convolutions chosen to quantise (a trt-cosy bug).")
    with quiet_logger("root"):
        quantize_static(
            str(source),
            str(target),
            Feeds(),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["Conv"],
            nodes_to_quantize=list(nodes),
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
        )
    _LOGGER.info(
        "%s: %d convolutions -> int8 (QDQ), calibrated on %d calls", Path(source).name, len(nodes), len(feeds)
    )
    return len(nodes)


def rewrite_calibrated(
    directory: Path,
    calibrated_by: Mapping[str, str],
    record: Callable[[Any, str], list[Feed]],
    choose: Callable[[onnx.ModelProto], list[str]],
    what: str,
    progress: Progress | None = None,
) -> dict[str, int]:
    """Give each graph of ``calibrated_by`` (``{graph: the graph whose recorded feeds calibrate it}``)
    present in ``directory`` (loadable engines) its ``choose``-n convolutions in int8, calibrated on
    ``record(model, graph)``; refresh the manifest's file sizes. Returns ``{graph: convolutions}``.

    ``what`` names the calls in the progress line (``"vocoder"``, ``"estimator"``).
    """
    from ...runtime.engines import load_engines
    from ...runtime.manifest import MANIFEST_NAME, Manifest
    from ..derived import file_sizes

    directory = Path(directory)
    todo = {graph: by for graph, by in calibrated_by.items() if (directory / f"{graph}.onnx").is_file()}
    if not todo:
        return {}
    manifest = Manifest.read(directory)
    model = load_engines(directory, lazy_graphs=frozenset(manifest.graphs))  # loads what the stages use
    recorded = {by: record(model, by) for by in sorted(set(todo.values()))}
    del model
    counts = {}
    for graph, by in todo.items():
        path = directory / f"{graph}.onnx"
        staged = path.with_name(f".{graph}.int8conv.onnx")
        counts[graph] = quantize_convolutions(
            path, staged, recorded[by], choose(onnx.load(str(path), load_external_data=False))
        )
        path.with_name(path.name + ".data").unlink(missing_ok=True)
        staged.replace(path)
        message = (
            f"{graph}: {counts[graph]} convolutions -> int8 (calibrated on {len(recorded[by])} {what} calls)"
        )
        _LOGGER.info("%s", message)
        if progress is not None:
            progress(message)
    (directory / MANIFEST_NAME).unlink()  # written anew, never through a link
    dataclasses.replace(manifest, files=file_sizes(directory)).write(directory)
    return counts
