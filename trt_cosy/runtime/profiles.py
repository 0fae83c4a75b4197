"""TensorRT optimization profiles as plain data, shared by the plan builder and the runtime.

A ``ShapeProfile`` maps every input of one graph to its (min, opt, max) shape. A graph has a few
profiles ("buckets"), e.g. short streaming chunks with a small ``opt`` and whole utterances with
a long one, instead of a single 1..3000 range: TensorRT tunes its kernels for ``opt``. The builder
turns them into TensorRT objects late (``ShapeProfile.to_trt``); the runtime uses the same data to
pick a profile (``select_profile``), to size its device buffers (``GraphProfiles.max_shapes``) and
to refuse inputs beyond the largest profile with an ``InputError`` before they reach TensorRT.

Nothing here imports tensorrt: ``to_trt`` only calls methods of the builder it is given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..config import ModelConfig
from ..errors import EngineMismatchError, InputError
from .graphs import GRAPHS, GraphSpec

__all__ = [
    "PROFILES_NAME",
    "Shape",
    "ShapeProfile",
    "GraphProfiles",
    "ProfileLimits",
    "default_profiles",
    "select_profile",
    "profiles_to_dict",
    "profiles_from_dict",
    "write_profiles",
    "read_profiles",
]

PROFILES_NAME: Final = "profiles.json"

Shape = tuple[int, ...]


@dataclass(frozen=True)
class ShapeProfile:
    """One optimization profile: input name -> (min, opt, max) shape, all of the same rank."""

    name: str
    shapes: dict[str, tuple[Shape, Shape, Shape]]

    def __post_init__(self) -> None:
        for key, (low, opt, high) in self.shapes.items():
            if not len(low) == len(opt) == len(high):
                raise ValueError(f"profile '{self.name}' input '{key}': min/opt/max ranks differ")
            if any(not 0 <= a <= b <= c for a, b, c in zip(low, opt, high, strict=True)):
                raise ValueError(
                    f"profile '{self.name}' input '{key}': need 0 <= min <= opt <= max, got "
                    f"{low} / {opt} / {high}"
                )

    def misfit(self, shapes: Mapping[str, Sequence[int]]) -> str | None:
        """Why ``shapes`` (input name -> shape) is outside this profile, or None when it fits."""
        for key, (low, _, high) in self.shapes.items():
            if key not in shapes:
                return f"input '{key}' is missing"
            shape = tuple(int(d) for d in shapes[key])
            if len(shape) != len(low):
                return f"input '{key}' has rank {len(shape)}, the profile has rank {len(low)}"
            if any(not a <= d <= c for a, d, c in zip(low, shape, high, strict=True)):
                return f"input '{key}' has shape {shape}; profile '{self.name}' allows {low} .. {high}"
        return None

    def fits(self, shapes: Mapping[str, Sequence[int]]) -> bool:
        return self.misfit(shapes) is None

    def to_trt(self, builder: Any) -> Any:
        """A TensorRT ``IOptimizationProfile`` made by ``builder`` (tensorrt is not imported here)."""
        profile = builder.create_optimization_profile()
        for key, (low, opt, high) in self.shapes.items():
            profile.set_shape(key, low, opt, high)
        return profile

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "shapes": {k: [list(s) for s in v] for k, v in self.shapes.items()}}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ShapeProfile:
        shapes = {str(k): tuple(tuple(int(d) for d in s) for s in v) for k, v in raw["shapes"].items()}
        return cls(name=str(raw["name"]), shapes=shapes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class GraphProfiles:
    """The profiles of one graph, in the order they are added to the TensorRT builder config."""

    graph: str
    profiles: tuple[ShapeProfile, ...]

    def __post_init__(self) -> None:
        if not self.profiles:
            raise ValueError(f"graph '{self.graph}' needs at least one profile")
        names = {tuple(sorted(p.shapes)) for p in self.profiles}
        if len(names) != 1:
            raise ValueError(f"graph '{self.graph}': every profile must name the same inputs")

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(self.profiles[0].shapes)

    def select(self, shapes: Mapping[str, Sequence[int]]) -> int:
        """Index of the first profile that fits ``shapes``; ``InputError`` when none does."""
        for index, profile in enumerate(self.profiles):
            if profile.fits(shapes):
                return index
        largest = self.profiles[int(max(range(len(self.profiles)), key=self._volume))]
        reason = largest.misfit(shapes)
        raise InputError(
            f"graph '{self.graph}': {reason}, beyond the largest TensorRT profile. Synthesize shorter text per "
            "call (split it), use a shorter prompt, or rebuild the engines with larger ProfileLimits."
        )

    def max_shapes(self) -> dict[str, Shape]:
        """Per input, the elementwise maximum over every profile's max (what buffers are sized for)."""
        result: dict[str, Shape] = {}
        for profile in self.profiles:
            for key, (_, _, high) in profile.shapes.items():
                old = result.get(key, high)
                result[key] = tuple(max(a, b) for a, b in zip(old, high, strict=True))
        return result

    def check_spec(self, spec: GraphSpec) -> None:
        """Raise ``ValueError`` unless the profiles name exactly ``spec``'s inputs with its ranks and static dims."""
        if set(self.input_names) != set(spec.input_names):
            raise ValueError(
                f"profiles of '{self.graph}' name {sorted(self.input_names)}, the contract "
                f"'{spec.name}' has inputs {sorted(spec.input_names)}"
            )
        for tensor in spec.inputs:
            for profile in self.profiles:
                for shape in profile.shapes[tensor.name]:
                    static = [(d, s) for d, s in zip(tensor.shape, shape, strict=False) if isinstance(d, int)]
                    if len(shape) != len(tensor.shape) or any(d != s for d, s in static):
                        raise ValueError(
                            f"profile '{profile.name}' of '{self.graph}' gives '{tensor.name}' "
                            f"shape {shape}; the contract says {tensor.shape}"
                        )

    def _volume(self, index: int) -> int:
        total = 0
        for _, _, high in self.profiles[index].shapes.values():
            volume = 1
            for dim in high:
                volume *= dim
            total += volume
        return total

    def to_dict(self) -> dict[str, Any]:
        return {"graph": self.graph, "profiles": [p.to_dict() for p in self.profiles]}

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> GraphProfiles:
        return cls(
            graph=str(raw["graph"]), profiles=tuple(ShapeProfile.from_dict(p) for p in raw["profiles"])
        )


def select_profile(graph: GraphProfiles, shapes: Mapping[str, Sequence[int]]) -> int:
    """Index of the first profile of ``graph`` that fits ``shapes``; ``InputError`` beyond the largest."""
    return graph.select(shapes)


@dataclass(frozen=True)
class ProfileLimits:
    """The lengths the default profiles cover. Longer inputs are refused at run time (split the text)."""

    max_prefill: int = 1024
    """LLM prefill positions: sos + text + task + prompt speech tokens."""
    prefill_opt: int = 256
    max_context: int = 4096
    """LLM cached positions P (prompt + generated tokens) the decode profiles accept."""
    decode_buckets: tuple[int, ...] = (512, 2048)
    """Upper P of each decode bucket below ``max_context`` (one profile per bucket, plus one to max)."""
    max_decode_step: int = 8
    """New positions T a decode call may carry (1 for plain decoding)."""
    stream_tokens: int = 500
    """Flow tokens (prompt + chunks so far) of the short bucket; its opt is a quarter of it."""
    max_tokens: int = 1500
    """Flow tokens of the long bucket (2 mel frames each: 3000 frames = 60 s, the official maximum)."""
    stream_frames: int = 512
    """HiFT mel frames of the streaming bucket (a chunk of 50 new frames plus 8 cached)."""
    hift_cache_frames: int = 8
    """Mel frames the streaming vocoder carries over (its cached source is this many hops long)."""


def _range(low: int, opt: int, high: int) -> tuple[int, int, int]:
    return low, min(max(opt, low), high), high


def _llm_profiles(config: ModelConfig, limits: ProfileLimits) -> GraphProfiles:
    qwen = config.llm.qwen
    hidden, layers, heads, head_dim = qwen.hidden_size, qwen.num_layers, qwen.num_kv_heads, qwen.head_dim

    def profile(name: str, new: tuple[int, int, int], past: tuple[int, int, int]) -> ShapeProfile:
        embeds = tuple((1, t, hidden) for t in new)  # [1, T, D]
        cache = tuple((layers, 1, heads, p, head_dim) for p in past)  # [L, 1, H, P, Dh]
        return ShapeProfile(name, {"inputs_embeds": embeds, "past_keys": cache, "past_values": cache})  # type: ignore[dict-item]

    profiles = [profile("prefill", _range(1, limits.prefill_opt, limits.max_prefill), (0, 0, 0))]
    step = (1, 1, limits.max_decode_step)
    # Buckets all start at P = 1: select() takes the first that fits, so a short cache gets the kernels
    # tuned for the small opt, and a larger bucket still accepts it.
    for high in (*[b for b in limits.decode_buckets if b < limits.max_context], limits.max_context):
        profiles.append(profile(f"decode_{high}", step, _range(1, high // 2, high)))
    return GraphProfiles("llm", tuple(profiles))


def _flow_encoder_profiles(config: ModelConfig, limits: ProfileLimits) -> GraphProfiles:
    lookahead, speaker = config.flow.encoder.pre_lookahead_len, config.flow.spk_embed_dim

    def profile(name: str, tokens: tuple[int, int, int]) -> ShapeProfile:
        fixed = ((1, lookahead),) * 3
        shapes = {
            "tokens": tuple((1, n) for n in tokens),  # [1, N]
            "context": fixed,
            "context_valid": ((1,),) * 3,
            "streaming": ((1,),) * 3,
            "embedding": ((1, speaker),) * 3,
        }
        return ShapeProfile(name, shapes)  # type: ignore[arg-type]

    short = _range(1, limits.stream_tokens // 4, limits.stream_tokens)
    long = _range(1, limits.max_tokens // 2, limits.max_tokens)
    return GraphProfiles("flow_encoder", (profile("stream", short), profile("long", long)))


def _estimator_profiles(name: str, config: ModelConfig, limits: ProfileLimits) -> GraphProfiles:
    mels, ratio = config.flow.output_size, config.flow.token_mel_ratio

    def profile(label: str, frames: tuple[int, int, int]) -> ShapeProfile:
        wide = tuple((2, mels, f) for f in frames)  # [2, 80, F]: the CFG pair
        shapes = {
            "x": wide,
            "mask": tuple((2, 1, f) for f in frames),  # [2, 1, F]
            "mu": wide,
            "t": ((2,),) * 3,
            "spks": ((2, mels),) * 3,
            "cond": wide,
        }
        return ShapeProfile(label, shapes)  # type: ignore[arg-type]

    short = _range(1, ratio * limits.stream_tokens // 4, ratio * limits.stream_tokens)
    long = _range(1, ratio * limits.max_tokens // 2, ratio * limits.max_tokens)
    return GraphProfiles(name, (profile("stream", short), profile("long", long)))


def _hift_profiles(config: ModelConfig, limits: ProfileLimits) -> GraphProfiles:
    hop, harmonics, mels = (
        config.hift.samples_per_frame,
        config.hift.nb_harmonics + 1,
        config.hift.in_channels,
    )
    cached = hop * limits.hift_cache_frames

    def profile(label: str, frames: tuple[int, int, int], source: tuple[int, int, int]) -> ShapeProfile:
        shapes = {
            "mel": tuple((1, mels, f) for f in frames),  # [1, 80, F]
            "sine_noise": tuple((1, hop * f, harmonics) for f in frames),  # [1, 480F, 9]
            "cache_source": tuple((1, 1, s) for s in source),  # [1, 1, S]
        }
        return ShapeProfile(label, shapes)  # type: ignore[arg-type]

    chunk = config.chunk_size * config.token_mel_ratio + limits.hift_cache_frames  # 50 new + 8 cached
    stream = profile("stream", _range(1, chunk, limits.stream_frames), (0, cached, cached))
    long_frames = config.token_mel_ratio * limits.max_tokens
    long = profile("long", _range(1, long_frames // 2, long_frames), (0, 0, cached))
    return GraphProfiles("hift", (stream, long))


def default_profiles(config: ModelConfig, limits: ProfileLimits | None = None) -> dict[str, GraphProfiles]:
    """The profiles of every graph of ``graphs.GRAPHS`` for a model of ``config``."""
    limits = limits or ProfileLimits()
    result = {
        "llm": _llm_profiles(config, limits),
        "flow_encoder": _flow_encoder_profiles(config, limits),
        "flow_estimator": _estimator_profiles("flow_estimator", config, limits),
        "flow_estimator_stream": _estimator_profiles("flow_estimator_stream", config, limits),
        "hift": _hift_profiles(config, limits),
    }
    for name, profiles in result.items():
        profiles.check_spec(GRAPHS[name])
    return result


def profiles_to_dict(profiles: Mapping[str, GraphProfiles]) -> dict[str, Any]:
    return {name: graph.to_dict() for name, graph in profiles.items()}


def profiles_from_dict(raw: Mapping[str, Any]) -> dict[str, GraphProfiles]:
    return {str(name): GraphProfiles.from_dict(graph) for name, graph in raw.items()}


def write_profiles(profiles: Mapping[str, GraphProfiles], path: Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(profiles_to_dict(profiles), indent=1) + "\n", encoding="utf-8")
    return path


def read_profiles(path: Path) -> dict[str, GraphProfiles]:
    """Read a ``profiles.json``; missing or malformed raises ``EngineMismatchError``."""
    path = Path(path)
    try:
        return profiles_from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineMismatchError(
            f"{path} is missing or malformed ({exc!r}). Rebuild the engines: run `trt-cosy build --backend "
            f"tensorrt --model-dir DIR --out {path.parent}`."
        ) from exc
