"""Streaming flow chunks that compute their new frames only (numpy; CosyVoice2 and 3, ONNX Runtime).

The official schedule reruns the flow over every token so far at each chunk. With chunk attention
the estimator is chunk-causal and the hops end on chunk boundaries, so the frames of earlier chunks
come out the same in every later call (fixed noise, same tokens). ``FlowCache`` keeps, per Euler
step, what the new frames need from them (each transformer block's normalised input, for keys and
values; each causal convolution's last two input frames) and their finished mel, and
``solve_euler_incremental`` runs the ``FLOW_ESTIMATOR_INCREMENTAL`` graph on the new frames only.
The encoder still reruns over every token (a few % of the flow's work).

CosyVoice3 (``graphs_v3.FLOW_ESTIMATOR_INCREMENTAL_V3``, the same I/O): per DiT block the modulated
attention input (keys are rotated at their absolute positions in the graph) and the last 30 input
frames of the two conv position embedding convolutions; ``cache_layout`` reads which from the
estimator configuration.

Memory: ``bytes_per_frame`` = steps · blocks · 2 (CFG rows) · width · 4 bytes, float32 (float16
moves the tiny golden model's mel by 3e-4, above the golden 2e-4): 1.09 MiB per mel frame (50 per
second, prompt included) at full size (10 steps, 56 blocks, width 256); 1.72 MiB for the full-size
CosyVoice3 DiT (22 blocks, width 1024), whose tails (2 · 1024 channels · 30 frames per step and row)
add 4.7 MiB per segment. Past ``limit_bytes`` (default ``DEFAULT_LIMIT_BYTES``: ~1190 frames, 24 s,
for CosyVoice3) the cache is dropped and the segment's later chunks recompute from the start, as
without it. The final full-attention call (official) never uses it.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Final

import numpy as np

from ..runtime.backends.base import Runner
from ..runtime.backends.tensorrt.device_blocks import DeviceBlocks
from ..runtime.incremental_profiles import DEFAULT_LIMIT_BYTES
from ..runtime.profiles import GraphProfiles

__all__ = [
    "DEFAULT_LIMIT_BYTES",
    "DEFAULT_VOICE_SLOTS",
    "FlowCache",
    "VoicePrefixes",
    "cache_layout",
    "cache_tail",
    "incremental_frame_limit",
    "solve_euler_incremental",
]

_LOGGER = logging.getLogger(__name__)

DEFAULT_VOICE_SLOTS: Final = (
    2  # voices whose prompt prefix ``VoicePrefixes`` keeps (~220 MiB each, 5 s prompt)
)


def cache_layout(config: Any) -> tuple[int, int, int]:
    """(transformer blocks L, width D, summed causal-convolution input channels C) of an estimator
    config (``EstimatorConfig``: the v2 U-Net; ``DiTConfig``: the v3 DiT)."""
    return config.cache_layout()


def cache_tail(config: Any) -> int:
    """Input frames each causal convolution needs from before a chunk: kernel - 1 (2; v3: 30)."""
    return config.cache_tail()


class FlowCache:
    """What one streaming segment's completed frames leave for its later chunks.

    Args:
        config: the estimator configuration (cache layout). steps: Euler steps (10).
        limit_bytes: the most this cache may hold; a chunk that would pass it drops the cache and the
            segment recomputes from then on.
        max_frames: the most frames (cached + new) a call may cover, where the graph's shapes are
            bounded (TensorRT profiles: ``FlowStage`` passes ``incremental_frame_limit``); past it the
            segment recomputes as past ``limit_bytes``. None: no bound.
    """

    def __init__(
        self,
        config: Any,
        steps: int,
        limit_bytes: int = DEFAULT_LIMIT_BYTES,
        max_frames: int | None = None,
    ):
        self.max_frames = max_frames
        self.blocks, self.width, self.channels = cache_layout(config)
        self.chunk = config.static_chunk_size
        self.steps = steps
        self.limit_bytes = limit_bytes
        self.frames = 0  # completed frames held (a multiple of the chunk while usable)
        self.disabled: str | None = None  # why this segment recomputes, once it does
        # Per step [frames, L, 2, D] float32: the frames loaded from a voice prefix (``load``; shared with
        # it, never written) and this cache's own frames after them (past = shared ++ own).
        self._shared: list[np.ndarray] = []
        self._blocks: list[np.ndarray] = []
        tail = cache_tail(config)
        self._tails = np.zeros((steps, 2, self.channels, tail), np.float32)  # [steps, 2, C, K-1]
        self._mel = np.zeros((1, 80, 0), np.float32)  # [1, 80, frames] finished mel
        # On TensorRT the blocks live on the device instead (``_device_velocity``): per step only the
        # new frames' inputs and outputs cross, never the cache (issue 29 item 1).
        self.device: DeviceBlocks | None = None

    @property
    def bytes_per_frame(self) -> int:
        return self.steps * self.blocks * 2 * self.width * 4

    @property
    def nbytes(self) -> int:
        """Bytes this cache refers to (its voice prefix's frames included, which it shares)."""
        blocks = sum(block.nbytes for block in self._shared) + sum(block.nbytes for block in self._blocks)
        if self.device is not None:
            blocks += self.device.nbytes
        return blocks + self._tails.nbytes + self._mel.nbytes

    def usable_for(self, frames: int) -> bool:
        """Whether a chunk-attention call over ``frames`` frames can extend this cache; drops the
        cache (and says why, once) when it would pass the limit."""
        if self.disabled is not None:
            return False
        if frames <= self.frames or self.frames % self.chunk:
            self.disable(
                f"a chunk of {frames} frames does not extend the {self.frames} cached ones on a chunk boundary"
            )
            return False
        if frames * self.bytes_per_frame > self.limit_bytes:
            self.disable(
                f"{frames} frames would need {frames * self.bytes_per_frame / 2**20:.0f} MiB, above the "
                f"{self.limit_bytes / 2**20:.0f} MiB limit"
            )
            return False
        if self.max_frames is not None and frames > self.max_frames:
            self.disable(
                f"{frames} frames are beyond the incremental graph's {self.max_frames}-frame profiles"
            )
            return False
        return True

    def disable(self, reason: str) -> None:
        self.disabled = reason
        self.release()
        _LOGGER.info(
            "incremental flow off for the rest of this segment (%s): chunks recompute from the start", reason
        )

    def release(self) -> None:
        self._shared = []
        self._blocks = []
        if self.device is not None:
            self.device.free()
            self.device = None
        self._mel = np.zeros((1, 80, 0), np.float32)
        self.frames = 0

    def past(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """``(past_blocks [P, L, 2, D], past_tails [2, C, K-1])`` of Euler step ``step``."""
        parts = [part[step] for part in (self._shared, self._blocks) if len(part) > step]
        if not parts:  # the segment's first chunk
            return np.zeros((0, self.blocks, 2, self.width), np.float32), self._tails[step]
        if len(parts) == 1:
            return parts[0], self._tails[step]
        # a transient copy for this call: the voice prefix is not copied into every request's cache
        return np.concatenate(parts, axis=0), self._tails[step]

    def extend(self, step: int, new_blocks: np.ndarray, new_tails: np.ndarray) -> None:
        """Append the new frames' block inputs of one step (``new_blocks`` [T, L, 2, D])."""
        if len(self._blocks) <= step:
            self._blocks.append(np.ascontiguousarray(new_blocks, np.float32))
        else:  # one step at a time: at most one step's cache is held twice while it grows
            self._blocks[step] = np.concatenate([self._blocks[step], new_blocks], axis=0)
        self._tails[step] = new_tails

    def load(self, prefix: FlowCache) -> None:
        """Start this (fresh) cache from ``prefix``'s frames (a voice's prompt chunks), shared with it."""
        self._shared = [prefix.past(step)[0] for step in range(min(self.steps, prefix.steps))]
        self._blocks = []
        if prefix.device is not None:  # a device prefix: this request extends its own copy of it
            from ..runtime.backends.tensorrt.cuda import Stream

            with Stream() as stream:
                self.device = prefix.device.clone(stream)
        self._tails = prefix._tails.copy()
        self._mel = prefix._mel
        self.frames = prefix.frames

    def finish(self, mel: np.ndarray) -> np.ndarray:
        """Record the new frames' mel [1, 80, T]; the whole mel [1, 80, P + T] so far."""
        self._mel = np.concatenate([self._mel, mel], axis=2)
        self.frames = self._mel.shape[2]
        return self._mel


class VoicePrefixes:
    """A bounded LRU of per-voice ``FlowCache`` prefixes: the completed chunks of a voice's prompt.

    The frames of a voice's prompt chunks whose encoder look-ahead stays inside the prompt depend on
    the voice alone (prompt tokens and mel, speaker embedding, fixed noise), so every streaming
    request with that voice starts from the same cache and its first chunk computes only the frames
    after them. Entries share their arrays with the requests that load them: a request's cache keeps
    its own frames apart and joins the two for each call (a transient copy of one Euler step), so the
    prefix is held once, not once per request. Memory: ``FlowCache.bytes_per_frame`` per prefix frame,
    e.g. 200 frames (a 5 s prompt) = 218 MiB at full size.

    Args:
        slots: voices kept (least recently used dropped first); 0 turns the prefixes off.
    """

    def __init__(self, slots: int = DEFAULT_VOICE_SLOTS):
        self.slots = slots
        self._entries: OrderedDict[str, FlowCache] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(*arrays: np.ndarray) -> str:
        digest = hashlib.sha1()
        for array in arrays:
            array = np.ascontiguousarray(array)
            digest.update(f"{array.dtype}{array.shape}".encode())
            digest.update(array.tobytes())
        return digest.hexdigest()

    def get(self, key: str) -> FlowCache | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: str, prefix: FlowCache) -> None:
        if self.slots <= 0:
            return
        with self._lock:
            self._entries[key] = prefix
            self._entries.move_to_end(key)
            while len(self._entries) > self.slots:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every voice (the next request of each computes its prefix again)."""
        with self._lock:
            self._entries.clear()

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(entry.nbytes for entry in self._entries.values())


def incremental_frame_limit(runner: Runner | None, chunk: int) -> int | None:
    """The most frames (cached + new) every call of ``runner`` may cover, from its TensorRT profiles
    (``runtime.incremental_profiles``): for each profile taking P = 0 and T = 1, the frames F
    with T = F - P and P (a multiple of ``chunk`` below F) both inside it; the best of them. None for a
    runner without profiles (ONNX Runtime: any shape)."""
    profiles = getattr(runner, "profiles", None)
    if not isinstance(profiles, GraphProfiles):
        return None
    best = 0
    for profile in profiles.profiles:
        (low_x, _, high_x), (low_p, _, high_p) = profile.shapes["x"], profile.shapes["past_blocks"]
        if low_x[2] <= 1 and low_p[0] == 0:
            best = max(best, min(high_x[2], high_p[0] // chunk * chunk + chunk))
    return best


def solve_euler_incremental(
    runner: Runner,
    cache: FlowCache,
    mu: np.ndarray,
    spks: np.ndarray,
    cond: np.ndarray,
    noise: np.ndarray,
    t_span: np.ndarray,
    cfg_rate: float,
) -> np.ndarray:
    """``stages.flow.solve_euler`` with chunk attention over frames ``[cache.frames, T)`` only.

    Args:
        mu, cond: [1, 80, T] (all frames; the cached ones are skipped). spks: [1, 80].
        noise: start point [1, 80, T]. t_span: the cosine grid [steps + 1].

    Returns:
        The mel [1, 80, T] (cached frames ++ new frames), float32; the cache then holds all T.
    """
    new = slice(cache.frames, mu.shape[2])
    if callable(getattr(runner, "enqueue", None)):  # TensorRT: the cache stays on the device
        velocity = _device_velocity(runner, cache, new.stop - new.start)
    else:
        velocity = _host_velocity(runner, cache)
    x = _euler_steps(velocity, noise[:, :, new], _guided_feed(mu, spks, cond, new), t_span, cfg_rate)
    return cache.finish(x)


VelocityOf = Callable[[int, dict[str, np.ndarray]], np.ndarray]


def _host_velocity(runner: Runner, cache: FlowCache) -> VelocityOf:
    """The estimator call of one Euler step with the block cache on the host (``FlowCache.past``/``extend``)."""

    def velocity(step: int, feed: dict[str, np.ndarray]) -> np.ndarray:
        feed["past_blocks"], feed["past_tails"] = cache.past(step)
        out = _infer(runner, feed)
        cache.extend(step, out["new_blocks"], out["new_tails"])
        return out["estimator_out"]  # [2, 80, n]

    return velocity


def _guided_feed(mu: np.ndarray, spks: np.ndarray, cond: np.ndarray, new: slice) -> dict[str, np.ndarray]:
    """The estimator's CFG batch over the new frames: row 0 conditioned, row 1 zeros (x and t per step)."""
    frames = new.stop - new.start
    feed: dict[str, np.ndarray] = {
        "x": np.zeros((2, mu.shape[1], frames), np.float32),  # [2, 80, n]
        "mu": np.zeros((2, mu.shape[1], frames), np.float32),
        "t": np.zeros((2,), np.float32),
        "spks": np.zeros((2, spks.shape[1]), np.float32),
        "cond": np.zeros((2, cond.shape[1], frames), np.float32),
    }
    feed["mu"][0] = mu[0, :, new]
    feed["spks"][0] = spks[0]
    feed["cond"][0] = cond[0, :, new]
    return feed


def _euler_steps(
    velocity_of: VelocityOf, noise: np.ndarray, feed: dict[str, np.ndarray], t_span: np.ndarray, cfg_rate: float
) -> np.ndarray:
    """The Euler loop of ``solve_euler`` in its float32 arithmetic, step for step, from ``noise`` [1, 80, n];
    ``velocity_of(step, feed)`` runs the estimator on ``feed`` (x and t set) for step 0, 1, ... and
    returns its CFG batch [2, 80, n]. Returns x [1, 80, n] float32."""
    x = np.array(noise, dtype=np.float32)  # [1, 80, n]
    guided, unguided = np.float32(1.0 + cfg_rate), np.float32(cfg_rate)
    steps = t_span.shape[0] - 1
    t = t_span[0]
    dt = t_span[1] - t_span[0]
    for step in range(1, steps + 1):
        feed["x"][:] = x[0]
        feed["t"][:] = t
        velocity = velocity_of(step - 1, feed)  # [2, 80, n]
        velocity = guided * velocity[0:1] - unguided * velocity[1:2]  # [1, 80, n]
        x = x + dt * velocity
        t = t + dt
        if step < steps:
            dt = t_span[step + 1] - t
    return x.astype(np.float32, copy=False)


def _infer(runner: Runner, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return runner.infer({name: feed[name] for name in runner.input_names})


def _device_velocity(runner: Any, cache: FlowCache, frames: int) -> VelocityOf:
    """The estimator call of one Euler step on a ``TrtRunner`` with the block cache in device memory.

    Per Euler step: ``past_blocks`` is bound to the step's ``DeviceBlocks`` store (no copy), the
    plan's ``new_blocks`` are appended to it device to device, and only x/mu/t/spks/cond of the new
    frames and the small ``past_tails`` go up, ``estimator_out`` and ``new_tails`` come down, with
    one synchronize; the Euler update stays on the host, in ``solve_euler``'s float32 arithmetic.
    """
    frame_bytes = cache.blocks * 2 * cache.width * 4  # [L, 2, D] float32 per frame
    if cache.device is None:
        cache.device = DeviceBlocks(cache.steps, frame_bytes)
        if cache.frames:  # blocks held on the host (a host prefix): uploaded once, then kept there
            _upload_host_blocks(runner, cache)
            cache._shared, cache._blocks = [], []
    store = cache.device

    def velocity(step: int, feed: dict[str, np.ndarray]) -> np.ndarray:
        feed["past_tails"] = cache._tails[step]
        held = store.frames[step]
        shapes = {name: value.shape for name, value in feed.items()}
        shapes["past_blocks"] = (held, cache.blocks, 2, cache.width)  # [P, L, 2, D]
        with runner.slot() as index:
            stream = runner.stream(index)
            store.reserve(step, held + frames, stream)  # before the launch: the buffer may move
            runner.set_shapes(shapes, slot=index)
            runner.copy_inputs(feed, slot=index, bound=("past_blocks",))
            runner.enqueue(slot=index, addresses={"past_blocks": store.ptr(step)})
            produced, shape, _ = runner.device_tensor("new_blocks", index)
            store.append(step, produced, int(shape[0]), stream)
            views = runner.copy_outputs(slot=index, names=("estimator_out", "new_tails"))
            stream.synchronize()
            cache._tails[step] = views["new_tails"]
            return np.array(views["estimator_out"], copy=True)  # [2, 80, n]

    return velocity


def _upload_host_blocks(runner: Any, cache: FlowCache) -> None:
    """Copy the blocks a cache holds on the host into its (new) device store, once."""
    from ..runtime.backends.tensorrt.cuda import DeviceBuffer, PinnedBuffer

    store = cache.device
    assert store is not None
    stream = runner.stream(0)
    for step in range(cache.steps):
        blocks = np.ascontiguousarray(cache.past(step)[0], np.float32)  # [P, L, 2, D]
        if not blocks.shape[0]:
            continue
        store.reserve(step, blocks.shape[0], stream)
        with PinnedBuffer(blocks.nbytes) as staged:
            staged.view(np.float32, blocks.shape)[...] = blocks
            with DeviceBuffer(blocks.nbytes) as landing:
                landing.copy_from_async(staged, blocks.nbytes, stream)
                store.append(step, landing.ptr, blocks.shape[0], stream)
                stream.synchronize()
