"""int8 convolutions in the flow estimator's middle blocks (U-Net estimators of CosyVoice 1 and 2).

The U-Net estimator (``ConditionalDecoder``) of int4/int8 ONNX Runtime engines already computes its
MatMuls in int8; its attention (57 % of a full-size call at 750 frames) runs at the CPU's fp32 peak,
and its 46 fp32 convolutions took 9 %. The two kernel-3 convolutions of each of its middle blocks'
ResNet block (``ESTIMATOR_CONV_PATTERN``: 24 at full size, most of the convolution arithmetic)
become static int8 (``int8_conv``): a full-size call 4-5 % faster, the mel SNR against fp32
engines 38.0 dB where the engines without it give 40.3 (docs/benchmarks.md, "The flow estimator's
middle-block convolutions in int8"). The rest stays fp32, by measurement (full size, mel SNR against
fp32 on the quality guard's seeded inputs): the middle blocks' 1x1 residual convolutions cost as much
SNR as the 24 (38.0 dB alone, 36.3 dB with them) for a seventh of their arithmetic; with the outer
blocks too the mel fell to 33 dB (their inputs concatenate differently scaled tensors: noise,
encoder output, speaker and prompt; the skip connections), for no further gain.

Calibration records the non-streaming estimator's feeds through the family's flow stage for
``CALIBRATION_UTTERANCES`` seeded utterances (every solver step), and adds as many feeds moved into
the range of a trained flow: a random-weight flow's trajectory ends near 0, a trained one's at log-mel
values (-11.5 to 2), and its prompt condition holds log-mels; static ranges clip what they never saw.
Only ``flow_estimator`` is rewritten: the streaming estimators keep fp32 convolutions (calibrating
them would need streaming feeds). CosyVoice3's DiT has no middle blocks (two small position
convolutions), so it has no such graph.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import numpy as np
import onnx

from ...family_lookup import FAMILIES, FamilyTable, family_named
from .int8_conv import CALIBRATION_UTTERANCES, Recorder, convolutions_where, log_mel_like, rewrite_calibrated

__all__ = [
    "ESTIMATOR_GRAPHS", "ESTIMATOR_CONV_PATTERN", "CALIBRATION_UTTERANCES", "estimator_convolutions",
    "estimator_calibration_feeds", "quantize_estimators"
]

# Per family (config.family): the estimator graphs whose middle-block convolutions become int8, each
# with the graph whose recorded feeds calibrate it (``Family.int8_estimator_graphs``).
ESTIMATOR_GRAPHS: Final = FamilyTable(lambda name: FAMILIES[name].int8_estimator_graphs)
# The weights of the middle blocks' ResNet block convolutions (block1, block2; not res_conv).
ESTIMATOR_CONV_PATTERN: Final = re.compile(r"estimator\.mid_blocks\.\d+\.0\.block[12]\.")

Progress = Callable[[str], None]
Feed = dict[str, np.ndarray]


def estimator_convolutions(model: onnx.ModelProto) -> list[str]:
    """Names of the ``Conv`` nodes of the middle blocks' ResNet blocks (``ESTIMATOR_CONV_PATTERN``)."""
    return convolutions_where(model, ESTIMATOR_CONV_PATTERN.match)


def _in_log_mel_range(feed: Feed, seed: int) -> Feed:
    """``feed`` moved toward a trained flow's inputs: the state ``x`` (``[B, 80, F]``) plus ``t`` times
    a log-mel-like target (the straight path from noise ends there), and the prompt frames of the
    condition (``cond``, non-zero where the prompt is) replaced by log-mel-like values."""
    moved = dict(feed)
    target = log_mel_like((1, *feed["x"].shape[1:]), seed)  # [1, 80, F]
    t = np.asarray(feed["t"], np.float32).reshape(-1, 1, 1)  # [B, 1, 1]
    moved["x"] = (feed["x"] + t * target).astype(np.float32)
    if "cond" in feed:
        moved["cond"] = np.where(feed["cond"] != 0, target, 0).astype(np.float32)
    return moved


def estimator_calibration_feeds(
    model: Any, graph: str, utterances: int = CALIBRATION_UTTERANCES
) -> list[Feed]:
    """The feeds the family's flow stage gives ``graph`` for ``utterances`` seeded utterances of
    ``model`` (a ``LoadedModel``; every solver step), then each of them in the log-mel range."""
    recorded = Recorder.utterances(
        model, graph, utterances, lambda feeds, inputs, seed: feeds.mel(model, inputs, seed)
    )
    return recorded + [_in_log_mel_range(feed, index) for index, feed in enumerate(recorded)]


def quantize_estimators(directory: Path, family: str, progress: Progress | None = None) -> dict[str, int]:
    """Replace each of ``family``'s ``int8_estimator_graphs`` in ``directory`` (loadable engines) by its
    int8-middle-block form, calibrated through the directory's own flow. Returns ``{graph: count}``."""
    return rewrite_calibrated(
        directory,
        family_named(family).int8_estimator_graphs,
        estimator_calibration_feeds,
        estimator_convolutions,
        "estimator",
        progress,
    )
