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
from typing import Any, Final, Protocol

from ..config import HiFTConfig, ModelConfig
from ..errors import EngineMismatchError, InputError
from .graphs import FLOW_STEP, STEP_GRAPHS, GraphSpec

__all__ = [
    "PROFILES_NAME",
    "Shape",
    "ShapeProfile",
    "GraphProfiles",
    "ProfileLimits",
    "step_profiles",
    "llm_decode_profiles",
    "trt_graph_specs",
    "default_profiles",
    "range_of",
    "llm_profiles",
    "qwen_dims",
    "flow_encoder_profiles",
    "estimator_profiles",
    "middle_frames",
    "token_frames",
    "hift_profiles",
    "select_profile",
    "profiles_to_dict",
    "profiles_from_dict",
    "write_profiles",
    "read_profiles",
]

PROFILES_NAME: Final = "profiles.json"

Shape = tuple[int, ...]


class FamilyGraphs(Protocol):
    """What this module needs of a model family (``models.family.Family``; the caller hands it in, so
    the runtime imports no family)."""

    name: str
    graphs: Mapping[str, GraphSpec]
    trt_step_graphs: bool

    def trt_profiles(self, config: Any, limits: ProfileLimits) -> list[GraphProfiles]:
        """The profiles of the family's exported graphs (the step graphs' are derived here)."""
        ...


def trt_graph_specs(family: FamilyGraphs) -> dict[str, GraphSpec]:
    """Every graph a TensorRT engines directory of ``family`` holds: the exported set
    (``Family.graphs``) plus, where the family's flow runs ``stages.flow.FlowStage``
    (``Family.trt_step_graphs``: CosyVoice2/3), the flow step graphs derived from the estimators."""
    specs = dict(family.graphs)
    if family.trt_step_graphs:
        specs.update({step.name: step for estimator, step in STEP_GRAPHS.items() if estimator in specs})
    return specs


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

    def empty_opt(self) -> list[str]:
        """Inputs whose opt shape has a zero dimension: TensorRT tunes its tactics at opt, so an empty
        opt tunes for no work at all (issue 29 item 7); the builder refuses such a profile."""
        return [name for name, (_, opt, _) in self.shapes.items() if 0 in opt]

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
    max_batch: int = 8
    """Rows of a batched decode step (``llm_decode``: requests decoded together, at most)."""
    stream_tokens: int = 500
    """Flow tokens (prompt + chunks so far) of the short bucket; its opt is a quarter of it."""
    max_tokens: int = 1500
    """Flow tokens of the long bucket (2 mel frames each: 3000 frames = 60 s, the official maximum)."""
    stream_mid_tokens: int = 1000
    """Flow tokens of the streaming estimator's middle bucket (``stream_mid``, between ``stream_tokens``
    and ``max_tokens``; opt a quarter of the way up): a segment past the short bucket (about 10 s of speech
    after a prompt) keeps kernels tuned near its length instead of at the long bucket's opt. Not above
    ``stream_tokens``: no middle bucket."""
    stream_frames: int = 512
    """HiFT mel frames of the streaming bucket (a chunk of 50 new frames plus 8 cached)."""
    hift_cache_frames: int = 8
    """Mel frames the streaming vocoder carries over (its cached source is this many hops long)."""
    flow_cache_bytes: int | None = None
    """The streaming segment's ``FlowCache`` limit the incremental estimator's profiles cover (None:
    ``stages.flow_incremental.DEFAULT_LIMIT_BYTES``); its frames, capped at ``max_tokens``' frames,
    bound the new and cached frames (``runtime.incremental_profiles``)."""


def range_of(low: int, opt: int, high: int) -> tuple[int, int, int]:
    return low, min(max(opt, low), high), high


def llm_profiles(dims: tuple[int, int, int, int], limits: ProfileLimits) -> GraphProfiles:
    """dims: (hidden D, layers L, cached heads H, head dim Dh) of the ``LLM`` contract."""
    hidden, layers, heads, head_dim = dims

    def profile(name: str, new: tuple[int, int, int], past: tuple[int, int, int]) -> ShapeProfile:
        embeds = tuple((1, t, hidden) for t in new)  # [1, T, D]
        cache = tuple((layers, 1, heads, p, head_dim) for p in past)  # [L, 1, H, P, Dh]
        return ShapeProfile(name, {"inputs_embeds": embeds, "past_keys": cache, "past_values": cache})  # type: ignore[dict-item]

    # Prefill runs at P = 0, but TensorRT tunes its tactics at opt, which must not be empty (issue 29
    # item 7): opt and max P = 1, which the graph accepts (one past position); the runtime feeds P = 0.
    profiles = [profile("prefill", range_of(1, limits.prefill_opt, limits.max_prefill), (0, 1, 1))]
    step = (1, 1, limits.max_decode_step)
    # Buckets all start at P = 1: select() takes the first that fits, so a short cache gets the kernels
    # tuned for the small opt, and a larger bucket still accepts it.
    for high in (*[b for b in limits.decode_buckets if b < limits.max_context], limits.max_context):
        profiles.append(profile(f"decode_{high}", step, range_of(1, high // 2, high)))
    return GraphProfiles("llm", tuple(profiles))


def llm_decode_profiles(config: ModelConfig, limits: ProfileLimits | None = None) -> GraphProfiles:
    """``llm_decode`` (``runtime.llm_decode``): the batch B 1/opt/``max_batch`` is data in every
    profile; one profile per position bucket (the window P = ``key_positions``' length, as the
    ``llm`` decode buckets); the slot capacity C is 1..``max_context`` (the runtime binds its own)."""
    from .llm_decode import LLM_DECODE_NAME, cache_input_names, llm_decode_spec

    limits = limits or ProfileLimits()
    hidden, layers, heads, head_dim = qwen_dims(config)
    rows = range_of(1, max(1, limits.max_batch // 2), limits.max_batch)
    profiles = []
    for high in (*[b for b in limits.decode_buckets if b < limits.max_context], limits.max_context):
        window = range_of(1, high // 2, high)
        capacity = range_of(1, limits.max_context, limits.max_context)
        cache = tuple((b, heads, c, head_dim) for b, c in zip(rows, capacity, strict=True))  # [B, H, C, Dh]
        shapes = {
            "inputs_embeds": tuple((b, 1, hidden) for b in rows),  # [B, 1, D]
            "past_lengths": tuple((b,) for b in rows),  # [B]
            "key_positions": tuple((p,) for p in window),  # [P]
        }
        shapes.update(dict.fromkeys(cache_input_names(layers), cache))
        profiles.append(ShapeProfile(f"decode_{high}", shapes))  # type: ignore[arg-type]
    result = GraphProfiles(LLM_DECODE_NAME, tuple(profiles))
    result.check_spec(llm_decode_spec(layers))
    return result


def qwen_dims(config: ModelConfig) -> tuple[int, int, int, int]:
    qwen = config.llm.qwen
    return qwen.hidden_size, qwen.num_layers, qwen.num_kv_heads, qwen.head_dim


def flow_encoder_profiles(config: ModelConfig, limits: ProfileLimits, streaming: bool) -> GraphProfiles:
    """v2 (with the ``streaming`` flag input) and v3 (without) token-rate flow encoders."""
    lookahead, speaker = config.flow.encoder.pre_lookahead_len, config.flow.spk_embed_dim

    def profile(name: str, tokens: tuple[int, int, int]) -> ShapeProfile:
        shapes = {
            "tokens": tuple((1, n) for n in tokens),  # [1, N]
            "context": ((1, lookahead),) * 3,
            "context_valid": ((1,),) * 3,
            **({"streaming": ((1,),) * 3} if streaming else {}),
            "embedding": ((1, speaker),) * 3,
        }
        return ShapeProfile(name, shapes)  # type: ignore[arg-type]

    short = range_of(1, limits.stream_tokens // 4, limits.stream_tokens)
    long = range_of(1, limits.max_tokens // 2, limits.max_tokens)
    return GraphProfiles("flow_encoder", (profile("stream", short), profile("long", long)))


def estimator_profiles(
    name: str,
    mels: int,
    short: tuple[int, int, int],
    long: tuple[int, int, int],
    middle: tuple[int, int, int] | None = None,
) -> GraphProfiles:
    """The CFM estimator contract (U-Net or DiT) over mel frame ranges ``short``, ``middle`` (when
    given: the streaming estimator) and ``long``; ``select`` takes the first that fits."""

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

    buckets = [("stream", short), *([("stream_mid", middle)] if middle else []), ("long", long)]
    return GraphProfiles(name, tuple(profile(label, frames) for label, frames in buckets))


def middle_frames(config: ModelConfig, limits: ProfileLimits) -> tuple[int, int, int] | None:
    """The streaming estimator's middle bucket (issue 29 item 5): frames up to ``stream_mid_tokens``'
    (capped at the long bucket's), opt a quarter of the way from the short bucket's end to that: a
    growing streaming segment passes its low end first (the long bucket's opt is at half its max)."""
    ratio = config.token_mel_ratio
    top = ratio * min(limits.stream_mid_tokens, limits.max_tokens)
    low = ratio * limits.stream_tokens
    if top <= low:
        return None
    return range_of(1, (3 * low + top) // 4, top)


def token_frames(config: ModelConfig, limits: ProfileLimits) -> tuple[tuple[int, int, int], ...]:
    """v2/v3 mel frame ranges (short, long): ``token_mel_ratio`` frames per token."""
    ratio = config.token_mel_ratio
    short = range_of(1, ratio * limits.stream_tokens // 4, ratio * limits.stream_tokens)
    return short, range_of(1, ratio * limits.max_tokens // 2, ratio * limits.max_tokens)


def hift_profiles(
    name: str,
    config: HiFTConfig,
    frames: tuple[tuple[int, int, int], tuple[int, int, int]],
    cache: tuple[tuple[int, int, int], tuple[int, int, int]] | None,
    rand_phase: bool = False,
) -> GraphProfiles:
    """HiFT over mel frame ranges (stream, long); ``cache``: the ``cache_source`` sample ranges (v1/v2)."""
    hop, harmonics, mels = config.samples_per_frame, config.nb_harmonics + 1, config.in_channels

    def profile(label: str, index: int) -> ShapeProfile:
        shapes = {
            "mel": tuple((1, mels, f) for f in frames[index]),  # [1, 80, F]
            "sine_noise": tuple((1, hop * f, harmonics) for f in frames[index]),  # [1, hop·F, 9]
        }
        if rand_phase:
            shapes["rand_phase"] = ((1, harmonics),) * 3  # [1, 9]
        if cache is not None:
            shapes["cache_source"] = tuple((1, 1, s) for s in cache[index])  # [1, 1, S]
        return ShapeProfile(label, shapes)  # type: ignore[arg-type]

    return GraphProfiles(name, (profile("stream", 0), profile("long", 1)))


def default_profiles(
    config: Any, family: FamilyGraphs, limits: ProfileLimits | None = None
) -> dict[str, GraphProfiles]:
    """The profiles of every TensorRT graph of ``config``'s family (``family``; ``trt_graph_specs``: the
    exported set plus the flow step graphs), each checked against its contract."""
    limits = limits or ProfileLimits()
    result = {graph.graph: graph for graph in family.trt_profiles(config, limits)}
    specs = trt_graph_specs(family)
    for estimator, step in STEP_GRAPHS.items():
        if step.name in specs:
            result[step.name] = step_profiles(result[estimator], step.name)
    if set(result) != set(specs):
        raise ValueError(f"{config.family} profiles name {sorted(result)}, its graphs are {sorted(specs)}")
    for name, profiles in result.items():
        profiles.check_spec(specs[name])
    return result


def step_profiles(estimator: GraphProfiles, name: str) -> GraphProfiles:
    """The step graph ``name``'s profiles from the estimator's: same F ranges, x at batch 1, t and dt [1]."""
    profiles = []
    for profile in estimator.profiles:
        shapes = dict(profile.shapes)
        shapes["x"] = tuple((1, *shape[1:]) for shape in profile.shapes["x"])  # [1, 80, F]
        shapes["t"] = shapes["dt"] = ((1,),) * 3
        profiles.append(ShapeProfile(profile.name, {n: shapes[n] for n in FLOW_STEP.input_names}))
    return GraphProfiles(name, tuple(profiles))


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
