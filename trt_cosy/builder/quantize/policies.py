"""Which nodes of each family's graphs stay fp32 in the fp16 pass (``builder.quantize.precision``): plain data.

A ``PrecisionPolicy`` names fp32 islands by ONNX op type, by torch module class (every node the
module or its sub-modules made), by a class's *own* nodes (the elementwise code of its ``forward``,
not its sub-modules: the DiT's residual stream), and by module path. ``BuildFamily.precision_policy(graph)``
picks the policy of one graph; graph names repeat across families (``llm``, ``hift``) with other
classes inside, so each family's build side holds its table (``BuildFamily.precision_policies``,
built from the pieces here; CosyVoice2's is ``GRAPH_POLICIES``).

Why these islands:

* norms, softmax, reductions, exp/log/pow, sin/cos, cumulative sums: fp16 overflows or rounds the
  answer away (op types, every graph).
* the LLM's ``llm_decoder`` scope: the logits the sampler reads (v1 ``TransformerLM``, v2, v3).
* HiFT's f0 predictor, NSF source and (i)STFT: the phase is a running sum over samples, an f0 error
  of 0.1 Hz moves it by radians within a second (every family's vocoder).
* CosyVoice3's DiT: the residual stream and its AdaLN modulation (``DiTBlock``/``DiT`` own nodes).
  fp16 TensorRT engines of the official DiT give NaN audio (FunAudioLLM/CosyVoice issues 1930, 1822,
  1699; fixed there by fp32 LayerNorm or AutoCast); keeping the stream in fp32 leaves only the
  matrix products in fp16.
* ``PrecisionPolicy.data_max``: any node whose fp32 output exceeds it on the calibration feeds
  (``precision.range_islands``) stays fp32, so a released checkpoint's large activations never
  reach fp16's 65504 (the v1 flow's fp16 NaN mel, FunAudioLLM/CosyVoice issue 1113).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "FP32_OP_TYPES",
    "DATA_MAX",
    "PrecisionPolicy",
    "NORMS",
    "STFT",
    "LOGITS",
    "GRAPH_POLICIES",
]

FP32_OP_TYPES: Final = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "GroupNormalization",
        "InstanceNormalization",
        "ReduceMean",
        "ReduceSum",
        "ReduceSumSquare",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceProd",
        "Exp",
        "Log",
        "Pow",
        "Sin",
        "Cos",
        "CumSum",
        "Range",
        "DFT",
        "STFT",
    }
)
# An eighth of fp16's 65504: calibration feeds are short and random, real inputs may reach further.
DATA_MAX: Final = 8192.0


@dataclass(frozen=True)
class PrecisionPolicy:
    """Which nodes stay fp32 (see the module docstring and ``builder.quantize.precision``)."""

    op_types: frozenset[str] = FP32_OP_TYPES
    modules: frozenset[str] = frozenset()
    """torch class names (last dotted part) whose every node stays fp32."""
    own_nodes: frozenset[str] = frozenset()
    """torch class names whose own nodes (made in their ``forward``, not in a sub-module) stay fp32."""
    scopes: tuple[str, ...] = ()
    """module paths (e.g. ``"llm_decoder"``) whose nodes, and their sub-modules' nodes, stay fp32."""
    fp16_io: frozenset[str] = frozenset()
    """graph inputs/outputs switched to float16 (none by default: I/O stays float32)."""
    data_max: float | None = None
    """with calibration feeds: nodes whose fp32 outputs exceed this magnitude stay fp32."""


NORMS: Final = frozenset({"RMSNorm", "LayerNorm"})
STFT: Final = frozenset({"ConvSTFT", "ConvISTFT"})
LOGITS: Final = ("llm_decoder",)  # the LLM's logits scope

GRAPH_POLICIES: Final = {
    "llm": PrecisionPolicy(modules=NORMS | {"RotaryEmbedding"}, scopes=LOGITS),
    "llm_decode": PrecisionPolicy(modules=NORMS, scopes=LOGITS),  # its rotary angles: Sin/Cos islands
    "flow_encoder": PrecisionPolicy(modules=NORMS),
    "flow_estimator": PrecisionPolicy(modules=NORMS),
    "flow_estimator_stream": PrecisionPolicy(modules=NORMS),
    "flow_estimator_incremental": PrecisionPolicy(modules=NORMS),  # the estimator's weights and islands
    "hift": PrecisionPolicy(modules=NORMS | STFT | {"F0Predictor", "SourceModule"}),
}
"""CosyVoice2 (``graphs.GRAPHS``)."""
