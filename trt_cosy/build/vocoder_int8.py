"""int8 convolutions in the HiFT vocoder of ONNX Runtime int4/int8 engines (static, calibrated).

HiFT's time is its convolutions (65 % of a call at full size, fp32 ``Conv`` at 160-180 GFLOP/s on
two Zen 4 cores). ONNX Runtime runs a ``QuantizeLinear -> QLinearConv -> DequantizeLinear`` group
with the CPU's integer dot products at 600-860 GOP/s (docs/benchmarks.md, "What is left for flow
≤ 5 s and HiFT ≤ 1.2 s"), so the reduced precisions quantise the convolutions that hold almost all
of HiFT's arithmetic: the generator's residual blocks and the source branch's residual blocks
(``INT8_CONV_PREFIXES``, matched on the weight names every family's export gives them).

What stays fp32, by measurement: the f0 predictor (an int8 f0 moves the NSF source's phase and the
waveform SNR falls from 37 to 24 dB), ``conv_pre``/``conv_post``, the source down-sampling, the
STFT basis, the Snake activations, the source and the iSTFT.

Calibration is static (one activation range per tensor, ``MinMax``) and runs the family's own flow
and vocoder stages on the engines' fp32 HiFT: ``calibration_feeds`` records the feeds the vocoder
stage gives the graph for ``CALIBRATION_UTTERANCES`` seeded utterances (random speech tokens through
the checkpoint's flow, so the mels are the checkpoint's own), and for as many inputs spread like log-mel
speech features: a random-weight flow's mels sit around 0 where a trained one's span -11.5 to 2, and
static ranges clip what they never saw (calibrated on a random flow's mels alone, the golden HiFT inputs
of v1/v3 fell to 9-17 dB). Weights are int8 per output channel (symmetric), activations uint8 per
tensor. The quality guard holds the waveform SNR against fp32 (docs/precision.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import numpy as np
import onnx

from ..errors import BuildError
from .quiet_logs import quiet_logger

__all__ = [
    "VOCODER_GRAPHS",
    "INT8_CONV_PREFIXES",
    "CALIBRATION_UTTERANCES",
    "int8_convolutions",
    "calibration_feeds",
    "quantize_vocoder_convolutions",
    "quantize_vocoders",
]

_LOGGER = logging.getLogger(__name__)

# Per family (config.family): the vocoder graphs whose convolutions the reduced precisions make int8,
# each with the graph whose recorded feeds calibrate it (v3's streaming HiFT takes the same inputs as
# its whole-utterance graph, which the quality path runs).
VOCODER_GRAPHS: Final = {
    "v1": {"v1_hift": "v1_hift"},
    "v2": {"hift": "hift"},
    "v3": {"hift": "hift", "hift_stream": "hift"},
}
# Weight-name prefixes of the convolutions made int8 (the generator's and the source branch's resblocks).
INT8_CONV_PREFIXES: Final = ("hift.resblocks.", "hift.source_resblocks.")
CALIBRATION_UTTERANCES: Final = 3
_CALIBRATION_TARGETS: Final = 100  # speech tokens per calibration utterance (4 s of CosyVoice2 audio)
_LOG_MEL_FLOOR: Final = -11.5129  # log(1e-5): the feature extractor's clamp

Progress = Callable[[str], None]


def int8_convolutions(model: onnx.ModelProto) -> list[str]:
    """Names of the ``Conv`` nodes whose constant weight is one of ``INT8_CONV_PREFIXES``."""
    initializers = {init.name for init in model.graph.initializer}
    return [
        node.name
        for node in model.graph.node
        if node.op_type == "Conv"
        and node.input[1] in initializers
        and node.input[1].startswith(INT8_CONV_PREFIXES)
    ]


def _log_mel_like(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Seeded values spread like log-mel speech features (mean -6, std 2, floor log(1e-5) = -11.5, at
    most 2): a random-weight checkpoint's flow does not produce that range, a trained one does, and the
    calibrated ranges must hold for both."""
    rng = np.random.default_rng(2000 + seed)
    return np.clip(rng.normal(-6.0, 2.0, shape), _LOG_MEL_FLOOR, 2.0).astype(np.float32)


class _Recorder:
    """A runner stand-in that passes every call through and keeps a copy of its feeds."""

    def __init__(self, runner: Any):
        self._runner = runner
        self.feeds: list[dict[str, np.ndarray]] = []

    def infer(self, feeds: dict[str, np.ndarray], *args: Any, **kwargs: Any) -> Any:
        self.feeds.append({name: np.array(value, copy=True) for name, value in feeds.items()})
        return self._runner.infer(feeds, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def calibration_feeds(
    model: Any, graph: str, utterances: int = CALIBRATION_UTTERANCES
) -> list[dict[str, np.ndarray]]:
    """The feeds the family's vocoder stage gives ``graph`` for ``utterances`` seeded utterances of
    ``model`` (a ``LoadedModel``): random speech tokens, the checkpoint's flow, its own vocoder draws."""
    from ..bench.quality import QualityInputs
    from ..models.registry import family_of

    feeds = family_of(model.config).quality
    recorder = _Recorder(model.runners[graph])
    runners = model.runners
    runners[graph] = recorder
    try:
        for seed in range(utterances):
            inputs = QualityInputs.random(model, targets=_CALIBRATION_TARGETS, seed=1000 + seed)
            mel = feeds.mel(model, inputs, seed)  # [1, 80, F]: the checkpoint's own flow
            feeds.wav(model, mel, feeds.vocoder_draws(model, mel.shape[2], seed))
            log_mel = _log_mel_like(mel.shape, seed)  # [1, 80, F]: the range of real speech features
            feeds.wav(model, log_mel, feeds.vocoder_draws(model, log_mel.shape[2], seed))
    finally:
        runners[graph] = recorder._runner
    if not recorder.feeds:
        raise BuildError(
            f"the vocoder stage never ran the graph {graph!r}: nothing to calibrate (a trt-cosy bug)."
        )
    return recorder.feeds


def quantize_vocoder_convolutions(source: Path, target: Path, feeds: list[dict[str, np.ndarray]]) -> int:
    """Write ``target``: ``source`` with its ``int8_convolutions`` in QDQ form (uint8 activations per
    tensor, calibrated MinMax on ``feeds``; int8 weights per output channel). Returns how many."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Feeds(CalibrationDataReader):
        def __init__(self) -> None:
            self._feeds: Iterator[dict[str, np.ndarray]] = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self._feeds, None)

    nodes = int8_convolutions(onnx.load(str(source), load_external_data=False))
    if not nodes:
        raise BuildError(f"{source.name} has no residual-block convolutions to quantise (a trt-cosy bug).")
    with quiet_logger("root"):
        quantize_static(
            str(source),
            str(target),
            Feeds(),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=["Conv"],
            nodes_to_quantize=nodes,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
        )
    _LOGGER.info(
        "%s: %d convolutions -> int8 (QDQ), calibrated on %d calls", source.name, len(nodes), len(feeds)
    )
    return len(nodes)


def quantize_vocoders(
    directory: Path, family: str, calibration_engines: Path, progress: Progress | None = None
) -> dict[str, int]:
    """Replace each of ``family``'s ``VOCODER_GRAPHS`` in ``directory`` by its int8-convolution form,
    calibrated through the engines in ``calibration_engines`` (a loadable directory whose vocoders are
    fp32; a build and ``derive_engines`` both pass ``directory`` itself, so both calibrate through the
    same int8 flow and write the same graph; only the graphs the flow and the vocoder use are loaded). New files are written aside and moved in, so a
    hard-linked fp32 graph is never written through. Returns ``{graph: convolutions quantised}``."""
    from ..runtime.engines import load_engines
    from ..runtime.manifest import Manifest

    directory = Path(directory)
    todo = {
        graph: by for graph, by in VOCODER_GRAPHS[family].items() if (directory / f"{graph}.onnx").is_file()
    }
    if not todo:
        return {}
    lazy = frozenset(Manifest.read(calibration_engines).graphs)  # loaded on first use: flow and vocoder only
    model = load_engines(calibration_engines, lazy_graphs=lazy)
    recorded = {by: calibration_feeds(model, by) for by in sorted(set(todo.values()))}
    del model
    counts = {}
    for graph, calibrated_by in todo.items():
        path = directory / f"{graph}.onnx"
        staged = path.with_name(f".{graph}.int8conv.onnx")
        counts[graph] = quantize_vocoder_convolutions(path, staged, recorded[calibrated_by])
        path.with_name(path.name + ".data").unlink(missing_ok=True)
        staged.replace(path)
        message = (
            f"{graph}: {counts[graph]} convolutions -> int8 (calibrated on {len(recorded[calibrated_by])} "
            "vocoder calls through the flow)"
        )
        _LOGGER.info("%s", message)
        if progress is not None:
            progress(message)
    return counts
