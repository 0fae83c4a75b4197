"""Graph contracts of the CosyVoice3 family, where they differ from CosyVoice2 (``graphs``).

Unchanged and reused as is: ``graphs.LLM`` (only the vocabulary V = 6761 differs) and the two
estimator contracts (``FLOW_ESTIMATOR`` / ``FLOW_ESTIMATOR_STREAM``; the DiT keeps the official
estimator I/O). Graph names stay the CosyVoice2 names where the role is the same, so code that
looks runners up by name (``FlowStage``, verify) works for both families.

* ``FLOW_ENCODER_V3``: v3 has no attention before the estimator, so there is no ``streaming`` input.
* ``HIFT_V3`` / ``HIFT_V3_STREAM``: the causal vocoder has no source cache; its NSF noise is the
  fixed ``sine_waves`` buffer prefix (uniform [0, 1) values); the streaming graph (``finalize=False``)
  treats its last 3 mel frames as f0 look-ahead and the 4 before them as ``conv_pre`` look-ahead,
  so its outputs are shorter than its input: f0 F-3 frames, wav 480·(F-8) samples.
* ``FLOW_ESTIMATOR_INCREMENTAL_V3`` (optional, ONNX Runtime engines): the DiT over new streaming
  frames only, ``graphs.FLOW_ESTIMATOR_INCREMENTAL``'s I/O with 30-frame convolution tails (the
  causal conv position embedding's ``kernel - 1``; ``models.v3.export.dit_incremental``).
"""

from __future__ import annotations

from typing import Final

from ...runtime.graphs import (
    FLOW_ENCODER,
    FLOW_ESTIMATOR,
    FLOW_ESTIMATOR_STREAM,
    LLM,
    GraphSpec,
    TensorSpec,
    hift_outputs,
    incremental_estimator_spec,
)

__all__ = [
    "FLOW_ENCODER_V3",
    "FLOW_ESTIMATOR_INCREMENTAL_V3",
    "HIFT_V3",
    "HIFT_V3_STREAM",
    "GRAPHS_V3",
    "HIFT_STREAM_MIN_FRAMES",
]

# Token embedding + PreLookaheadLayer + repeat ×2 (mu) and the speaker affine layer: the CosyVoice2
# ``FLOW_ENCODER`` contract without its ``streaming`` input (no chunk masks to choose).
FLOW_ENCODER_V3: Final = GraphSpec(
    "flow_encoder",
    inputs=tuple(spec for spec in FLOW_ENCODER.inputs if spec.name != "streaming"),
    outputs=FLOW_ENCODER.outputs,
)

# One chunk-attention Euler step on the T new frames; P completed frames (a multiple of 50) as
# per-block modulated attention inputs (L = depth, D = dim) and the conv position embedding's tails.
FLOW_ESTIMATOR_INCREMENTAL_V3: Final = incremental_estimator_spec("2D", 30)

_HIFT_INPUTS: Final = (
    TensorSpec("mel", "float32", (1, 80, "F")),
    TensorSpec("sine_noise", "float32", (1, "480F", 9)),  # prefix of the fixed uniform sine_waves buffer
)

# finalize=True: the whole mel is vocoded (right look-ahead padded with zeros).
HIFT_V3: Final = GraphSpec(
    "hift",
    inputs=_HIFT_INPUTS,
    outputs=hift_outputs("480F", "480F", "F"),
)

# finalize=False: the last frames are look-ahead only; needs F >= 9.
HIFT_V3_STREAM: Final = GraphSpec(
    "hift_stream",
    inputs=_HIFT_INPUTS,
    outputs=hift_outputs("480(F-8)", "480(F-3)", "F-3"),
)
HIFT_STREAM_MIN_FRAMES: Final = 9  # 3 f0 look-ahead + 4 conv_pre look-ahead + 1 dropped + 1 emitted

GRAPHS_V3: Final = {
    g.name: g for g in (LLM, FLOW_ENCODER_V3, FLOW_ESTIMATOR, FLOW_ESTIMATOR_STREAM, HIFT_V3, HIFT_V3_STREAM)
}
