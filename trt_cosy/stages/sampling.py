"""Speech-token samplers for the LLM loop (numpy only).

A sampler is any callable ``sampler(logp, decoded) -> int`` where ``logp`` is a float32 vector
of log-probabilities over the speech vocabulary (masked entries are ``-inf``) and ``decoded`` the
tokens yielded so far in this request. Samplers never modify ``logp``.

``RASSampler`` is the official repetition-aware sampling (VALL-E 2 RAS, spec §3.4); its
randomness comes only from the ``numpy.random.Generator`` it is given, so a seed reproduces a
run (the official torch ``multinomial`` draws cannot be reproduced bit for bit). A Generator is
not thread-safe: build one sampler per request. ``greedy_sample`` is the argmax rule.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..config import LLMConfig

__all__ = ["Sampler", "RASSampler", "greedy_sample", "nucleus_sample", "log_softmax", "softmax"]

_LOGGER = logging.getLogger(__name__)


class Sampler(Protocol):
    def __call__(self, logp: np.ndarray, decoded: Sequence[int]) -> int: ...


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Float32 log-softmax over the last axis."""
    x = np.asarray(logits, dtype=np.float32)
    shifted = x - x.max(axis=-1, keepdims=True)  # shifted: [..., V]
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def softmax(logp: np.ndarray) -> np.ndarray:
    """Float32 softmax over the last axis (``-inf`` entries get probability 0)."""
    x = np.asarray(logp, dtype=np.float32)
    weights = np.exp(x - x.max(axis=-1, keepdims=True))  # weights: [..., V]
    return weights / weights.sum(axis=-1, keepdims=True)


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """Index drawn with probability proportional to ``weights`` (non-negative, positive sum)."""
    cdf = np.cumsum(weights, dtype=np.float64)  # cdf: [N]
    index = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    if index >= len(weights) or weights[index] <= 0:  # u * total rounded up to the end
        index = int(np.flatnonzero(weights > 0)[-1])
    return index


def nucleus_sample(probs: np.ndarray, top_p: float, top_k: int, rng: np.random.Generator) -> int:
    """Official ``nucleus_sampling``: top-p with the crossing token included, capped at top_k.

    Walking the probabilities in stable descending order, a token is kept while the mass kept
    *before* it is < ``top_p`` and fewer than ``top_k`` are kept; the kept (unnormalised)
    probabilities are then sampled.
    """
    order = np.argsort(-probs, kind="stable")[:top_k]  # order: [<=K]
    kept = probs[order].astype(np.float32)  # kept: [<=K]
    # Exclusive running sum in float32, as the official loop accumulates a float32 tensor.
    mass_before = np.concatenate([[0.0], np.cumsum(kept, dtype=np.float32)[:-1]]).astype(np.float32)
    count = max(1, int(np.count_nonzero(mass_before < np.float32(top_p))))
    return int(order[_draw(kept[:count], rng)])


@dataclass
class RASSampler:
    """Repetition-aware sampling: nucleus draw, re-drawn from the full distribution (without
    that candidate) when it occurs ``>= win_size * tau_r`` times in the last ``win_size`` tokens.
    """

    rng: np.random.Generator
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    @classmethod
    def from_config(cls, config: LLMConfig, rng: np.random.Generator) -> RASSampler:
        return cls(
            rng=rng, top_p=config.top_p, top_k=config.top_k, win_size=config.win_size, tau_r=config.tau_r
        )

    def __call__(self, logp: np.ndarray, decoded: Sequence[int]) -> int:
        candidate = nucleus_sample(softmax(logp), self.top_p, self.top_k, self.rng)
        recent = np.asarray(
            decoded[len(decoded) - self.win_size :] if self.win_size > 0 else [], dtype=np.int64
        )
        repeats = int(np.count_nonzero(recent == candidate))
        if self.win_size > 0 and repeats >= self.win_size * self.tau_r:
            masked = np.array(logp, dtype=np.float32)  # a copy: the caller's logp stays intact
            masked[candidate] = -np.inf
            if not np.isfinite(masked).any():  # nothing else is possible: keep the candidate
                return candidate
            candidate = _draw(softmax(masked), self.rng)
        return candidate


def greedy_sample(logp: np.ndarray, decoded: Sequence[int]) -> int:
    """Argmax over the whole vocabulary (first index on ties); ``decoded`` is unused."""
    del decoded
    return int(np.argmax(logp))
