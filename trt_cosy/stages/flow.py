"""Flow stage (numpy only): speech tokens -> mel through the encoder graph and the CFM estimator.

Reproduces ``CausalMaskedDiffWithXvec.inference`` + ``CausalConditionalCFM`` of the official
CosyVoice2 code (docs/cosyvoice-spec §4.1, §4.3): the encoder graph gives ``mu`` and ``spks``; the
host runs the cosine-scheduled Euler solver with classifier-free guidance as a batch of 2,
starting from the fixed noise prefix. The stage holds no per-request state, so one stage serves
concurrent requests: every call recomputes from the start (the official streaming does the same),
unless the caller passes its segment's ``FlowCache`` (``new_cache``; engines with the incremental
graph): then a chunk-attention call computes only the frames after the cached ones, with the same
result (``stages.flow_incremental``). The only state the stage keeps is the bounded per-voice LRU
of prompt prefixes (``VoicePrefixes``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..config import FlowConfig
from ..errors import InputError
from ..runtime.backends.base import Runner
from ..runtime.backends.tensorrt.euler import DeviceEulerLoop, guidance_feed, step_schedule
from ..runtime.graphs import FLOW_STEP, FLOW_STEP_STREAM
from .flow_incremental import (
    DEFAULT_LIMIT_BYTES,
    DEFAULT_VOICE_SLOTS,
    FlowCache,
    VoicePrefixes,
    incremental_frame_limit,
    solve_euler_incremental,
)

__all__ = ["FlowOutput", "FlowStage", "cosine_t_span", "solve_euler", "device_euler_loops"]

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlowOutput:
    """One ``token2mel`` result."""

    mel: np.ndarray
    """Generated mel [1, 80, T - prompt frames], float32 (natural-log mel)."""
    mu: np.ndarray
    """Encoder output ``encoder_proj(h)`` [1, 80, T], prompt frames included."""


def _torch_linspace01(steps: int) -> np.ndarray:
    """``torch.linspace(0, 1, steps)`` in float32, with torch's two-sided CPU formula."""
    step = np.float32(1.0) / np.float32(steps - 1)
    index = np.arange(steps)
    halfway = steps // 2
    front = step * index.astype(np.float32)  # [steps]
    back = np.float32(1.0) - step * (steps - 1 - index).astype(np.float32)  # [steps]
    return np.where(index < halfway, front, back).astype(np.float32)


def cosine_t_span(n_steps: int) -> np.ndarray:
    """``1 - cos(linspace(0, 1, n+1) · π/2)`` in float32: the official cosine time grid [n+1]."""
    t = _torch_linspace01(n_steps + 1)  # [n+1]
    angle = t * np.float32(0.5) * np.float32(np.pi)  # [n+1], float32 products as in torch
    # cos in float64 then rounded: matches torch's float32 cos where numpy's float32 cos is 1 ulp off.
    return np.float32(1.0) - np.cos(angle.astype(np.float64)).astype(np.float32)


def solve_euler(
    estimator: Runner,
    mu: np.ndarray,
    mask: np.ndarray,
    spks: np.ndarray,
    cond: np.ndarray,
    noise: np.ndarray,
    n_steps: int,
    cfg_rate: float,
) -> np.ndarray:
    """Fixed-step Euler ODE solve with classifier-free guidance, as ``ConditionalCFM.solve_euler``.

    Args:
        estimator: runner with the estimator contract (x, mask, mu, t, spks, cond -> estimator_out).
        mu: encoder output [1, 80, T]. mask: [1, 1, T]. spks: [1, 80]. cond: [1, 80, T].
        noise: start point [1, 80, T]. n_steps: Euler steps. cfg_rate: guidance rate (0.7).

    Returns:
        The mel [1, 80, T] (float32).
    """
    t_span = cosine_t_span(n_steps)  # [n+1]
    frames = mu.shape[2]
    x = np.asarray(noise, dtype=np.float32)  # x: [1, 80, T]
    # Row 0 is conditional, row 1 unconditional (zeros for mu, spks and cond).
    feed = {
        "x": np.zeros((2, mu.shape[1], frames), np.float32),
        "mask": np.repeat(np.asarray(mask, np.float32), 2, axis=0),  # [2, 1, T]
        "mu": np.zeros((2, mu.shape[1], frames), np.float32),
        "t": np.zeros((2,), np.float32),
        "spks": np.zeros((2, spks.shape[1]), np.float32),
        "cond": np.zeros((2, cond.shape[1], frames), np.float32),
    }
    feed["mu"][0] = mu[0]
    feed["spks"][0] = spks[0]
    feed["cond"][0] = cond[0]
    guided, unguided = np.float32(1.0 + cfg_rate), np.float32(cfg_rate)
    # t accumulates in float32 like the official loop, so it tracks t_span only up to rounding.
    t = t_span[0]
    dt = t_span[1] - t_span[0]
    for step in range(1, n_steps + 1):
        feed["x"][:] = x[0]
        feed["t"][:] = t
        velocity = _infer(estimator, feed)["estimator_out"]  # [2, 80, T]
        velocity = guided * velocity[0:1] - unguided * velocity[1:2]  # [1, 80, T]
        x = x + dt * velocity  # [1, 80, T]
        t = t + dt
        if step < n_steps:
            dt = t_span[step + 1] - t
    return x.astype(np.float32, copy=False)


def device_euler_loops(runners: Mapping[str, Runner], config: FlowConfig) -> dict[bool, DeviceEulerLoop]:
    """``{streaming: DeviceEulerLoop}`` for the step graphs among ``runners`` (TensorRT plans of
    ``flow_step`` / ``flow_step_stream``); empty when there are none (ONNX Runtime, torch)."""
    names = {False: FLOW_STEP.name, True: FLOW_STEP_STREAM.name}
    if not any(name in runners for name in names.values()):
        return {}
    schedule = step_schedule(cosine_t_span(config.cfm.n_timesteps))  # [n, 2] (t, dt)
    return {
        streaming: DeviceEulerLoop(runners[name], schedule)
        for streaming, name in names.items()
        if name in runners
    }


def _infer(runner: Runner, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return runner.infer({name: feed[name] for name in runner.input_names})


class FlowStage:
    """``token2mel`` over an encoder runner and the two estimator runners (full / chunked).

    Args:
        encoder_runner: ``FLOW_ENCODER`` contract.
        estimator_runner: ``FLOW_ESTIMATOR`` contract (full attention).
        estimator_stream_runner: ``FLOW_ESTIMATOR_STREAM`` contract (chunk attention).
        noise: the fixed start noise [1, 80, F] (the official prefix of ``randn(1, 80, 15000)``).
        config: the flow configuration of the release.
        step_loops: optional ``{streaming: DeviceEulerLoop}`` (``device_euler_loops``): the whole
            Euler solve chained on the GPU through the step graphs, instead of ``solve_euler``'s
            host loop; the guidance rate and step count are baked into the step graphs and schedule.
        incremental_runner: optional ``FLOW_ESTIMATOR_INCREMENTAL`` contract: streaming chunks given
            a ``FlowCache`` (``new_cache``) compute their new frames only (``stages.flow_incremental``).
        cache_limit_bytes: the most one segment's ``FlowCache`` holds before it recomputes.
        voice_slots: voices whose prompt prefix (``VoicePrefixes``) is kept for the first chunks of
            later requests; 0: every first chunk computes the prompt frames again.
    """

    def __init__(
        self,
        encoder_runner: Runner,
        estimator_runner: Runner,
        estimator_stream_runner: Runner,
        noise: np.ndarray,
        config: FlowConfig,
        step_loops: Mapping[bool, DeviceEulerLoop] | None = None,
        incremental_runner: Runner | None = None,
        cache_limit_bytes: int = DEFAULT_LIMIT_BYTES,
        voice_slots: int = DEFAULT_VOICE_SLOTS,
    ):
        self.voice_prefixes = VoicePrefixes(voice_slots)
        self.step_loops = dict(step_loops or {})
        self.incremental_runner = incremental_runner
        self.cache_limit_bytes = cache_limit_bytes
        # TensorRT plans: the segment's cache stops where the plan's profiles end (recomputation after)
        self.cache_max_frames = incremental_frame_limit(
            incremental_runner, config.estimator.static_chunk_size
        )
        self.encoder_runner = encoder_runner
        self.estimator_runner = estimator_runner
        self.estimator_stream_runner = estimator_stream_runner
        self.noise = noise
        self.config = config

    def new_cache(self) -> FlowCache | None:
        """A ``FlowCache`` for one streaming segment, or None without the incremental graph (the
        chunks then recompute from the start, as the official code does)."""
        if self.incremental_runner is None:
            return None
        return self._flow_cache()

    def _flow_cache(self) -> FlowCache:
        cfm = self.config.cfm
        return FlowCache(
            self.config.estimator, cfm.n_timesteps, self.cache_limit_bytes, self.cache_max_frames
        )

    def prepare_voice(self, prompt_tokens: np.ndarray, prompt_feat: np.ndarray, embedding: np.ndarray) -> bool:
        """Compute a voice's prompt prefix now (``VoicePrefixes``), so that its first streaming request
        starts from it instead of computing it; True when the voice has one (kept or made here).

        Takes the arrays as a request passes them (``pipeline.render_chunk``): tokens [1, P],
        ``prompt_feat`` [1, 2P, 80], ``embedding`` [1, 192]. Nothing to do without the incremental graph.
        """
        if self.incremental_runner is None:
            return False
        tokens = np.asarray(prompt_tokens).astype(np.int64)
        return self._voice_prefix(tokens, np.asarray(prompt_feat, np.float32), embedding) is not None

    def _load_prefix(
        self, cache: FlowCache, prompt_tokens: np.ndarray, prompt_feat: np.ndarray, embedding: np.ndarray
    ) -> None:
        """Start a fresh segment cache from its voice's prompt prefix (computed on first use)."""
        prefix = self._voice_prefix(prompt_tokens, prompt_feat, embedding)
        if prefix is not None:
            cache.load(prefix)

    def _voice_prefix(
        self, prompt_tokens: np.ndarray, prompt_feat: np.ndarray, embedding: np.ndarray
    ) -> FlowCache | None:
        """The voice's prompt prefix: kept, else computed and kept; None when the prompt has none.

        The prefix is the prompt's completed chunks whose encoder look-ahead stays in the prompt: their
        frames come out the same in every streaming call with this voice.
        """
        lookahead = self.config.encoder.pre_lookahead_len
        chunk_tokens = self.config.estimator.static_chunk_size // self.config.token_mel_ratio
        chunks = (prompt_tokens.shape[1] - lookahead) // chunk_tokens
        if chunks <= 0 or self.voice_prefixes.slots <= 0:
            return None
        key = VoicePrefixes.key(prompt_tokens, prompt_feat, embedding)
        prefix = self.voice_prefixes.get(key)
        if prefix is None:
            prefix = self._compute_prefix(prompt_tokens, prompt_feat, embedding, chunks * chunk_tokens + lookahead)
            if prefix is None:
                return None
            self.voice_prefixes.put(key, prefix)
            _LOGGER.debug(
                "flow: voice prefix of %d frames computed (%.0f MiB)", prefix.frames, prefix.nbytes / 2**20
            )
        return prefix

    def _compute_prefix(
        self, prompt_tokens: np.ndarray, prompt_feat: np.ndarray, embedding: np.ndarray, count: int
    ) -> FlowCache | None:
        """The prefix over the first ``count`` prompt tokens (look-ahead included), or None when it
        would not fit a cache."""
        tokens = prompt_tokens[:, :count]  # [1, n + L]
        mu, spks = self._encode(tokens, embedding, streaming=True, finalize=False)  # mu: [1, 80, 2n]
        frames = mu.shape[2]
        prefix = self._flow_cache()
        if not prefix.usable_for(frames):
            return None
        cond = np.zeros_like(mu)  # [1, 80, 2n]
        cond[0] = prompt_feat[0, :frames].T
        cfm = self.config.cfm
        solve_euler_incremental(
            self.incremental_runner,
            prefix,
            mu,
            spks,
            cond,
            self.noise[:, :, :frames],
            cosine_t_span(cfm.n_timesteps),
            cfm.inference_cfg_rate,
        )
        return prefix

    def _check(self, all_tokens: np.ndarray, prompt_feat: np.ndarray, finalize: bool) -> None:
        lookahead = self.config.encoder.pre_lookahead_len
        vocab = self.config.vocab_size
        if all_tokens.size and int(all_tokens.max()) >= vocab:
            raise InputError(
                f"speech token {int(all_tokens.max())} is outside the flow vocabulary (0..{vocab - 1}); "
                "drop the LLM's stop tokens before the flow."
            )
        usable = all_tokens.shape[1] - (0 if finalize else lookahead)
        if usable < 1:
            raise InputError(
                f"{all_tokens.shape[1]} tokens are too few: a non-final chunk needs more than the "
                f"{lookahead} look-ahead tokens. Pass more tokens or finalize=True."
            )
        frames = usable * self.config.token_mel_ratio
        if frames > self.noise.shape[2]:
            raise InputError(
                f"{frames} mel frames exceed the {self.noise.shape[2]}-frame CFM noise "
                f"({self.noise.shape[2] / 50:.0f} s at 50 frames/s); synthesise shorter text per call."
            )
        if (
            prompt_feat.ndim != 3
            or prompt_feat.shape[2] != self.config.output_size
            or prompt_feat.shape[1] > frames
        ):
            raise InputError(
                f"prompt_feat must be [1, frames <= {frames}, {self.config.output_size}], got "
                f"{tuple(prompt_feat.shape)}; pass the prompt mel as [B, T, 80] (2 frames per prompt token)."
            )

    def _encode(
        self, all_tokens: np.ndarray, embedding: np.ndarray, streaming: bool, finalize: bool
    ) -> tuple[np.ndarray, np.ndarray]:
        lookahead = self.config.encoder.pre_lookahead_len
        if finalize:
            main, context = all_tokens, np.zeros((1, lookahead), np.int64)
        else:
            main, context = all_tokens[:, :-lookahead], all_tokens[:, -lookahead:]
        feed = {
            "tokens": np.ascontiguousarray(main),  # [1, N]
            "context": np.ascontiguousarray(context),  # [1, L]
            "context_valid": np.array([0.0 if finalize else 1.0], np.float32),
            "streaming": np.array([1.0 if streaming else 0.0], np.float32),
            "embedding": np.asarray(embedding, np.float32),  # [1, 192]
        }
        out = _infer(self.encoder_runner, feed)
        return out["mu"], out["spks"]  # [1, 80, T], [1, 80]

    def token2mel(
        self,
        tokens: np.ndarray,
        prompt_tokens: np.ndarray,
        prompt_feat: np.ndarray,
        embedding: np.ndarray,
        streaming: bool,
        finalize: bool,
        cache: FlowCache | None = None,
    ) -> FlowOutput:
        """Run the flow on ``prompt_tokens ++ tokens`` (official ``flow.inference``, batch 1).

        Args:
            tokens: new speech tokens [1, n]; without ``finalize`` the last 3 are look-ahead only.
            prompt_tokens: prompt speech tokens [1, P] (may be empty).
            prompt_feat: prompt mel [1, 2P, 80] (frontend layout).
            embedding: speaker embedding [1, 192].
            streaming: chunk attention (25 tokens / 50 frames) instead of full attention.
            finalize: the last chunk: no look-ahead tokens are held back.
            cache: the segment's ``FlowCache`` (``new_cache``): a streaming call computes only the
                frames after the cached ones (same result); the cache is released after ``finalize``.

        Returns:
            ``FlowOutput(mel [1, 80, T - 2P], mu [1, 80, T])``.
        """
        all_tokens = np.concatenate([prompt_tokens, tokens], axis=1).astype(np.int64)  # [1, P+n]
        prompt_feat = np.asarray(prompt_feat, np.float32)
        self._check(all_tokens, prompt_feat, finalize)
        mu, spks = self._encode(all_tokens, embedding, streaming, finalize)  # mu: [1, 80, T]
        frames = mu.shape[2]
        prompt_frames = prompt_feat.shape[1]
        cond = np.zeros_like(mu)  # [1, 80, T]
        cond[0, :, :prompt_frames] = prompt_feat[0].T
        mask = np.ones((1, 1, frames), np.float32)  # [1, 1, T]
        noise = self.noise[:, :, :frames]  # [1, 80, T]
        loop = self.step_loops.get(streaming)
        cfm = self.config.cfm
        incremental = cache is not None and streaming and self.incremental_runner is not None
        if incremental and cache.frames == 0 and cache.disabled is None:
            self._load_prefix(cache, prompt_tokens.astype(np.int64), prompt_feat, embedding)
        if incremental and cache.usable_for(frames):
            mel = solve_euler_incremental(
                self.incremental_runner,
                cache,
                mu,
                spks,
                cond,
                noise,
                cosine_t_span(cfm.n_timesteps),
                cfm.inference_cfg_rate,
            )  # [1, 80, T]
        elif loop is not None:  # TensorRT: all steps queued on the device, one synchronize
            mel = loop.run(guidance_feed(noise, mu, mask, spks, cond))  # [1, 80, T]
        else:
            estimator = self.estimator_stream_runner if streaming else self.estimator_runner
            mel = solve_euler(
                estimator, mu, mask, spks, cond, noise, cfm.n_timesteps, cfm.inference_cfg_rate
            )  # [1, 80, T]
        _LOGGER.debug(
            "flow: %d tokens -> %d frames (streaming=%s, finalize=%s, cached=%s)",
            all_tokens.shape[1],
            frames,
            streaming,
            finalize,
            "-" if cache is None else cache.frames,
        )
        if cache is not None and finalize:
            cache.release()
        return FlowOutput(mel=mel[:, :, prompt_frames:], mu=mu)
