"""int8 convolutions in the HiFT vocoder of ONNX Runtime int4/int8 engines (static, calibrated).

HiFT's time is its convolutions (65 % of a call at full size), which ``QLinearConv`` runs 4-5x
faster than fp32 (``int8_conv``, docs/benchmarks.md), so the reduced precisions quantise the
convolutions that hold almost all of HiFT's arithmetic: the generator's residual blocks and the source branch's residual blocks
(``INT8_CONV_PREFIXES``, matched on the weight names every family's export gives them).

What stays fp32, by measurement: the f0 predictor (an int8 f0 moves the NSF source's phase and the
waveform SNR falls from 37 to 24 dB), ``conv_pre``/``conv_post``, the source down-sampling, the
STFT basis, the Snake activations, the source and the iSTFT.

Calibration (``int8_conv.rewrite_calibrated``) runs the family's own flow and vocoder stages on the
engines' fp32 HiFT: ``calibration_feeds`` records the feeds the vocoder
stage gives the graph for ``CALIBRATION_UTTERANCES`` seeded utterances (random speech tokens through
the checkpoint's flow, so the mels are the checkpoint's own), and for as many inputs spread like log-mel
speech features: a random-weight flow's mels sit around 0 where a trained one's span -11.5 to 2, and
static ranges clip what they never saw (calibrated on a random flow's mels alone, the golden HiFT inputs
of v1/v3 fell to 9-17 dB). The quality guard holds the waveform SNR against fp32 (docs/precision.md).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np
import onnx

from ...family_lookup import FAMILIES, FamilyTable, family_named
from .int8_conv import CALIBRATION_UTTERANCES, Recorder, convolutions_where, log_mel_like, rewrite_calibrated

__all__ = [
    "VOCODER_GRAPHS", "INT8_CONV_PREFIXES", "CALIBRATION_UTTERANCES", "int8_convolutions",
    "calibration_feeds", "quantize_vocoders"
]

# Per family (config.family): the vocoder graphs whose convolutions the reduced precisions make int8,
# each with the graph whose recorded feeds calibrate it (``Family.int8_vocoder_graphs``).
VOCODER_GRAPHS: Final = FamilyTable(lambda name: FAMILIES[name].int8_vocoder_graphs)
# Weight-name prefixes of the convolutions made int8 (the generator's and the source branch's resblocks).
INT8_CONV_PREFIXES: Final = ("hift.resblocks.", "hift.source_resblocks.")

Progress = Callable[[str], None]


def int8_convolutions(model: onnx.ModelProto) -> list[str]:
    """Names of the ``Conv`` nodes whose constant weight is one of ``INT8_CONV_PREFIXES``."""
    return convolutions_where(model, lambda weight: weight.startswith(INT8_CONV_PREFIXES))


def calibration_feeds(
    model: Any, graph: str, utterances: int = CALIBRATION_UTTERANCES
) -> list[dict[str, np.ndarray]]:
    """The feeds the family's vocoder stage gives ``graph`` for ``utterances`` seeded utterances of
    ``model`` (a ``LoadedModel``): random speech tokens, the checkpoint's flow, its own vocoder draws;
    after each, a log-mel-range input through the same stage."""

    def utterance(feeds: Any, inputs: Any, seed: int) -> None:
        mel = feeds.mel(model, inputs, seed)  # [1, 80, F]: the checkpoint's own flow
        feeds.wav(model, mel, feeds.vocoder_draws(model, mel.shape[2], seed))
        log_mel = log_mel_like(mel.shape, seed)  # [1, 80, F]: the range of real speech features
        feeds.wav(model, log_mel, feeds.vocoder_draws(model, log_mel.shape[2], seed))

    return Recorder.utterances(model, graph, utterances, utterance)


def quantize_vocoders(directory: Path, family: str, progress: Progress | None = None) -> dict[str, int]:
    """Replace each of ``family``'s ``int8_vocoder_graphs`` in ``directory`` (loadable engines whose
    vocoders are fp32) by its int8-convolution form, calibrated through the directory's own flow (a
    build and ``derive_engines`` both run it on their staging engines, so both write the same graph).
    Returns ``{graph: convolutions quantised}``."""
    return rewrite_calibrated(
        directory, family_named(family).int8_vocoder_graphs, calibration_feeds, int8_convolutions, "vocoder", progress
    )
