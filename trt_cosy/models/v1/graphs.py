"""The CosyVoice 1 graph contracts (same conventions as ``trt_cosy.runtime.graphs``).

Where a v1 stage has exactly the v2 interface the v2 spec is reused under its v2 name:

* ``LLM`` (the transformer LM with its relative-position KV cache; V = 4097, D = llm width,
  H = attention heads, Dh = head dim; keys/values cached separately, not the official key‖value),
* ``FLOW_ESTIMATOR`` (the non-causal ``ConditionalDecoder``; v1 has no streaming estimator).

New graphs: the text encoder (+ speaker projection), the flow encoder with the length regulator,
and HiFT with the ``SineGen`` phases as an input. All randomness is an input or lives on the host
(the v1 CFM start noise is fresh per call and is drawn by ``trt_cosy.models.v1.stages``).
"""

from __future__ import annotations

from typing import Final

from ...runtime.graphs import FLOW_ESTIMATOR, LLM, GraphSpec, TensorSpec, hift_outputs

__all__ = ["V1_TEXT_ENCODER", "V1_LLM", "V1_FLOW_ENCODER", "V1_FLOW_ESTIMATOR", "V1_HIFT", "V1_GRAPHS"]

# text_embedding rows (host lookup of prompt_text ++ text) -> causal Conformer text encoder ->
# text_encoder_affine_layer; plus spk_embed_affine_layer(L2-normalise(embedding)). The host drops
# the ``spk`` row when the mode has no LLM speaker embedding (instruct).
V1_TEXT_ENCODER: Final = GraphSpec(
    "v1_text_encoder",
    inputs=(
        TensorSpec("text_embeds", "float32", (1, "N", "E")),
        TensorSpec("embedding", "float32", (1, 192)),
    ),
    outputs=(
        TensorSpec("text_enc", "float32", (1, "N", "D")),
        TensorSpec("spk", "float32", (1, "D")),
    ),
)

V1_LLM: Final = LLM

# input_embedding(prompt ++ tokens) -> full-attention Conformer -> encoder_proj (``h``) ->
# InterpolateRegulator: ``mu_in[f] = (1 - weight1[f]) · h[index0[f]] + weight1[f] · h[index1[f]]``
# (the host computes the official piecewise linear interpolation indices, prompt / head / mid /
# tail, see ``trt_cosy.models.v1.stages.regulator_indices``) -> conv stack -> ``mu``; plus the speaker
# projection ``spks``.
V1_FLOW_ENCODER: Final = GraphSpec(
    "v1_flow_encoder",
    inputs=(
        TensorSpec("tokens", "int64", (1, "N")),
        TensorSpec("embedding", "float32", (1, 192)),
        TensorSpec("index0", "int64", ("F",)),
        TensorSpec("index1", "int64", ("F",)),
        TensorSpec("weight1", "float32", ("F",)),
    ),
    outputs=(
        TensorSpec("h", "float32", (1, "N", 80)),
        TensorSpec("mu", "float32", (1, 80, "F")),
        TensorSpec("spks", "float32", (1, 80)),
    ),
)

V1_FLOW_ESTIMATOR: Final = FLOW_ESTIMATOR

# HiFT at 22.05 kHz (256 samples per frame) with the v1 ``SineGen``: ``rand_phase`` is the
# uniform [0, 1) draw per harmonic (the fundamental's entry is ignored), ``sine_noise`` the
# standard-normal additive noise, ``cache_source`` (S <= 256F) overwrites the source start.
V1_HIFT: Final = GraphSpec(
    "v1_hift",
    inputs=(
        TensorSpec("mel", "float32", (1, 80, "F")),
        TensorSpec("sine_noise", "float32", (1, "256F", 9)),
        TensorSpec("rand_phase", "float32", (1, 9)),
        TensorSpec("cache_source", "float32", (1, 1, "S")),
    ),
    outputs=hift_outputs("256F", "256F", "F"),
)

V1_GRAPHS: Final = {g.name: g for g in (V1_TEXT_ENCODER, V1_LLM, V1_FLOW_ENCODER, V1_FLOW_ESTIMATOR, V1_HIFT)}
