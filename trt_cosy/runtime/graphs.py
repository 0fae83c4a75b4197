"""The graph contracts: what each exported stage takes and returns, by name.

Shared by the torch reference modules (``trt_cosy.builder.modules``), the ONNX export, the
runtime runners and the TensorRT profiles. Shapes use B (batch), T (new positions), P (cached
positions), N (tokens), F (mel frames), S (samples), L (layers), H (KV heads), Dh (head dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "TensorSpec",
    "GraphSpec",
    "GRAPHS",
    "hift_outputs",
    "LLM",
    "LLM_BATCH",
    "FLOW_ENCODER",
    "FLOW_ESTIMATOR",
    "FLOW_ESTIMATOR_STREAM",
    "FLOW_ESTIMATOR_INCREMENTAL",
    "HIFT",
    "FLOW_STEP",
    "FLOW_STEP_STREAM",
    "FLOW_STEP_INCREMENTAL",
    "STEP_GRAPHS",
    "step_spec",
    "incremental_estimator_spec",
]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # numpy dtype name
    shape: tuple[str | int, ...]  # symbolic dims are strings


@dataclass(frozen=True)
class GraphSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.outputs)


# Qwen2 backbone + speech head. Embedding lookups happen on the host (tables stored as .npy),
# so the 151936-row text table never enters the graph and the text LM head is never computed.
# Positions of the new inputs are P .. P+T-1 (P = cached length); attention is causal.
LLM: Final = GraphSpec(
    "llm",
    inputs=(
        TensorSpec("inputs_embeds", "float32", (1, "T", "D")),
        TensorSpec("past_keys", "float32", ("L", 1, "H", "P", "Dh")),
        TensorSpec("past_values", "float32", ("L", 1, "H", "P", "Dh")),
    ),
    outputs=(
        TensorSpec("logits", "float32", (1, "T", "V")),  # raw llm_decoder output, V = 6564
        TensorSpec("hidden", "float32", (1, "T", "D")),  # final-RMSNorm hidden states
        TensorSpec("present_keys", "float32", ("L", 1, "H", "P+T", "Dh")),
        TensorSpec("present_values", "float32", ("L", 1, "H", "P+T", "Dh")),
    ),
)

# The batched decode form of ``LLM`` (ONNX Runtime engines of the Qwen2 families; written by
# ``builder.onnx.llm_batch``, driven by ``stages.llm_batch``). Per layer i: ``past_key_<i>`` and
# ``past_value_<i>`` [B, H, P, Dh] in, ``present_key_<i>`` / ``present_value_<i>`` [B, H, P, Dh]
# out, bound to the same buffers (written in place). Row b attends to its first
# ``seqlens_k[b] + 1`` positions; its T new inputs take positions ``seqlens_k[b] + 1 - T`` on.
# ``total_sequence_length`` = max(seqlens_k) + 1. Not part of ``GRAPHS``: engines without it
# decode one request at a time.
LLM_BATCH: Final = GraphSpec(
    "llm_batch",
    inputs=(
        TensorSpec("inputs_embeds", "float32", ("B", "T", "D")),
        TensorSpec("seqlens_k", "int32", ("B",)),
        TensorSpec("total_sequence_length", "int32", ()),
    ),
    outputs=(TensorSpec("logits", "float32", ("B", "T", "V")),),
)

# Token embedding + UpsampleConformerEncoder + encoder_proj + speaker affine.
# ``tokens`` = prompt tokens ++ new tokens (without the look-ahead context). ``context`` holds
# the 3 look-ahead tokens; ``context_valid`` = 1 uses them, 0 pads with zeros (finalize).
# ``streaming`` = 1 uses the official chunk masks (25 tokens / 50 frames), 0 full attention.
FLOW_ENCODER: Final = GraphSpec(
    "flow_encoder",
    inputs=(
        TensorSpec("tokens", "int64", (1, "N")),
        TensorSpec("context", "int64", (1, 3)),
        TensorSpec("context_valid", "float32", (1,)),
        TensorSpec("streaming", "float32", (1,)),
        TensorSpec("embedding", "float32", (1, 192)),
    ),
    outputs=(
        TensorSpec("mu", "float32", (1, 80, "2N")),
        TensorSpec("spks", "float32", (1, 80)),
    ),
)

_ESTIMATOR_INPUTS: Final = (
    TensorSpec("x", "float32", (2, 80, "F")),
    TensorSpec("mask", "float32", (2, 1, "F")),
    TensorSpec("mu", "float32", (2, 80, "F")),
    TensorSpec("t", "float32", (2,)),
    TensorSpec("spks", "float32", (2, 80)),
    TensorSpec("cond", "float32", (2, 80, "F")),
)
_ESTIMATOR_OUTPUTS: Final = (TensorSpec("estimator_out", "float32", (2, 80, "F")),)

# The official estimator I/O (batch 2 = the CFG pair). Full attention.
FLOW_ESTIMATOR: Final = GraphSpec("flow_estimator", _ESTIMATOR_INPUTS, _ESTIMATOR_OUTPUTS)
# Same weights, 50-frame chunk attention mask (streaming chunks that are not final).
FLOW_ESTIMATOR_STREAM: Final = GraphSpec("flow_estimator_stream", _ESTIMATOR_INPUTS, _ESTIMATOR_OUTPUTS)


# One chunk-attention Euler step on the T new frames of a streaming chunk (CosyVoice2; written by
# ``builder.flow_incremental``, driven by ``stages.flow_incremental``). ``past_blocks``: per completed
# frame (P, a multiple of the 50-frame chunk), per transformer block (L), per CFG row, the block's
# normalised input (D wide); ``past_tails``: the last 2 input frames of every causal convolution
# (C channels in all; zeros when P = 0). The mask is all ones (no input). Not part of ``GRAPHS``:
# engines without it recompute every chunk from the start.
def incremental_estimator_spec(channels: str | int, tail: int) -> GraphSpec:
    """The incremental estimator's contract with ``channels`` summed causal-convolution input channels
    and ``tail`` frames kept of each (CosyVoice2's U-Net: C, 2; CosyVoice3's DiT: 2D, 30)."""
    return GraphSpec(
        "flow_estimator_incremental",
        inputs=(
            TensorSpec("x", "float32", (2, 80, "T")),
            TensorSpec("mu", "float32", (2, 80, "T")),
            TensorSpec("t", "float32", (2,)),
            TensorSpec("spks", "float32", (2, 80)),
            TensorSpec("cond", "float32", (2, 80, "T")),
            TensorSpec("past_blocks", "float32", ("P", "L", 2, "D")),
            TensorSpec("past_tails", "float32", (2, channels, tail)),
        ),
        outputs=(
            TensorSpec("estimator_out", "float32", (2, 80, "T")),
            TensorSpec("new_blocks", "float32", ("T", "L", 2, "D")),
            TensorSpec("new_tails", "float32", (2, channels, tail)),
        ),
    )


FLOW_ESTIMATOR_INCREMENTAL: Final = incremental_estimator_spec("C", 2)



def hift_outputs(wav: str, source: str, f0: str) -> tuple[TensorSpec, ...]:
    """The outputs of every family's HiFT graph: the waveform [1, wav], its NSF source [1, 1, source]
    and the f0 [1, f0] (lengths as dim expressions of the mel frames F)."""
    return (
        TensorSpec("wav", "float32", (1, wav)),
        TensorSpec("source", "float32", (1, 1, source)),
        TensorSpec("f0", "float32", (1, f0)),
    )


# HiFT: f0 predictor, NSF source (noise injected), decoder, iSTFT. ``cache_source`` (length
# S <= 480F, may be 0) overwrites the start of the generated source (streaming continuity).
HIFT: Final = GraphSpec(
    "hift",
    inputs=(
        TensorSpec("mel", "float32", (1, 80, "F")),
        TensorSpec("sine_noise", "float32", (1, "480F", 9)),
        TensorSpec("cache_source", "float32", (1, 1, "S")),
    ),
    outputs=hift_outputs("480F", "480F", "F"),
)

GRAPHS: Final = {g.name: g for g in (LLM, FLOW_ENCODER, FLOW_ESTIMATOR, FLOW_ESTIMATOR_STREAM, HIFT)}

# The estimator wrapped into one guided Euler step (``builder.flow_step``), for TensorRT's device
# Euler loops (``backends.tensorrt.euler``, ``backends.tensorrt.euler_incremental``).


def step_spec(estimator: GraphSpec, name: str) -> GraphSpec:
    """The contract of one guided Euler step around ``estimator``: x at batch 1, t [1] and dt [1]
    after it, the other inputs as they are; x_next [1, 80, frames] out, then the estimator's other
    outputs (the incremental estimator's ``new_blocks`` / ``new_tails``)."""
    inputs: list[TensorSpec] = []
    for spec in estimator.inputs:
        if spec.name == "x":
            inputs.append(TensorSpec("x", "float32", (1, *spec.shape[1:])))
        elif spec.name == "t":
            inputs += [TensorSpec("t", "float32", (1,)), TensorSpec("dt", "float32", (1,))]
        else:
            inputs.append(spec)
    velocity, *passed = estimator.outputs
    x_next = TensorSpec("x_next", "float32", (1, *velocity.shape[1:]))
    return GraphSpec(name, tuple(inputs), (x_next, *passed))


# One guided Euler step around the estimator (full attention / 50-frame chunk attention): x [1, 80, F],
# mask, mu, t [1], dt [1], spks, cond -> x_next [1, 80, F].
FLOW_STEP: Final = step_spec(FLOW_ESTIMATOR, "flow_step")
FLOW_STEP_STREAM: Final = step_spec(FLOW_ESTIMATOR_STREAM, "flow_step_stream")
# One guided Euler step of a streaming chunk over its new frames only (CosyVoice2 TensorRT engines):
# x [1, 80, T], mu, t [1], dt [1], spks, cond, past_blocks, past_tails -> x_next, new_blocks, new_tails.
FLOW_STEP_INCREMENTAL: Final = step_spec(FLOW_ESTIMATOR_INCREMENTAL, "flow_step_incremental")
STEP_GRAPHS: Final = {
    FLOW_ESTIMATOR.name: FLOW_STEP,
    FLOW_ESTIMATOR_STREAM.name: FLOW_STEP_STREAM,
    FLOW_ESTIMATOR_INCREMENTAL.name: FLOW_STEP_INCREMENTAL,
}
"""Estimator graph name -> the step graph wrapped around it."""
