"""The contract of ``llm_decode``: the batched LLM decode step in plain ONNX, for TensorRT engines of
the Qwen2 families (exported by ``builder.trt.llm_decode`` from ``builder.modules.llm_decode``, driven by
``runtime.backends.tensorrt.batch`` and ``stages.llm_batch``).

Per step, B rows (requests) each add one position. Inputs: ``inputs_embeds`` [B, 1, D];
``past_lengths`` [B] int32 (cached positions of each row: its new position's index);
``key_positions`` [P] int32 = 0 .. P-1, the cache window read (P >= max(past_lengths); its length is
the profile's "position bucket"); per layer i ``past_key_<i>`` / ``past_value_<i>`` [B, H, C, Dh], the
slot buffers of the B rows (C = slot capacity >= P; only positions < ``past_lengths[b]`` of row b
are read). Outputs: ``logits`` [B, 1, V] and ``new_kv`` [B, 2L, H, Dh] (the new position's keys of
layers 0..L-1, then its values), which the caller writes into each row's slot at
``past_lengths[b]``: TensorRT never copies the cache.

Not part of ``graphs.GRAPHS``: an engines directory without it decodes one request at a time.
"""

from __future__ import annotations

from typing import Final

from .graphs import GraphSpec, TensorSpec

__all__ = ["LLM_DECODE_NAME", "llm_decode_spec", "cache_input_names", "device_cache_inputs"]

LLM_DECODE_NAME: Final = "llm_decode"


def cache_input_names(layers: int) -> tuple[str, ...]:
    """``past_key_0, past_value_0, past_key_1, ...``: the graph's cache inputs in order."""
    return tuple(f"past_{kind}_{layer}" for layer in range(layers) for kind in ("key", "value"))


def llm_decode_spec(layers: int) -> GraphSpec:
    """The ``llm_decode`` contract of a Qwen2 LLM with ``layers`` layers."""
    cache = tuple(TensorSpec(name, "float32", ("B", "H", "C", "Dh")) for name in cache_input_names(layers))
    return GraphSpec(
        LLM_DECODE_NAME,
        inputs=(
            TensorSpec("inputs_embeds", "float32", ("B", 1, "D")),
            TensorSpec("past_lengths", "int32", ("B",)),
            TensorSpec("key_positions", "int32", ("P",)),
            *cache,
        ),
        outputs=(
            TensorSpec("logits", "float32", ("B", 1, "V")),
            TensorSpec("new_kv", "float32", ("B", "2L", "H", "Dh")),
        ),
    )


def device_cache_inputs(input_names: tuple[str, ...]) -> tuple[str, ...]:
    """The cache inputs among a plan's ``input_names`` (bound to the KV slots, never copied)."""
    return tuple(name for name in input_names if name.startswith(("past_key_", "past_value_")))
