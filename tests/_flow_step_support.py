"""A numpy estimator for the host loop (and tests/test_euler_loop.py's fake engine), its inputs and the host
Euler solve (test_flow_step, test_euler_loop)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from trt_cosy.runtime.graphs import FLOW_ESTIMATOR
from trt_cosy.stages.flow import solve_euler

CFG_RATE = 0.7
MELS = 80


def _velocity(x, mask, mu, t, spks, cond) -> np.ndarray:
    """A t-, mask- and row-dependent velocity [2, 80, F] (float32 throughout)."""
    inner = np.float32(0.5) * x + mu - cond + spks[:, :, None]  # [2, 80, F]
    return (np.tanh(inner) * mask + t[:, None, None]).astype(np.float32)


class _NumpyEstimator:
    """A Runner with the estimator contract; records every feed."""

    name = "numpy_estimator"
    input_names = FLOW_ESTIMATOR.input_names
    output_names = FLOW_ESTIMATOR.output_names

    def __init__(self, velocity=_velocity):
        self.velocity, self.feeds = velocity, []

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.feeds.append({k: np.array(v, copy=True) for k, v in feed.items()})
        return {"estimator_out": self.velocity(*(feed[n] for n in self.input_names))}


def _inputs(frames: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((1, 1, frames), np.float32)  # [1, 1, F]
    mask[..., frames - frames // 4 :] = 0.0
    return {
        "noise": rng.standard_normal((1, MELS, frames), dtype=np.float32),  # [1, 80, F]
        "mu": rng.standard_normal((1, MELS, frames), dtype=np.float32),  # [1, 80, F]
        "mask": mask,
        "spks": rng.standard_normal((1, MELS), dtype=np.float32),  # [1, 80]
        "cond": rng.standard_normal((1, MELS, frames), dtype=np.float32),  # [1, 80, F]
    }


def _host_solve(estimator, inputs: Mapping[str, np.ndarray], steps: int) -> np.ndarray:
    i = inputs
    return solve_euler(estimator, i["mu"], i["mask"], i["spks"], i["cond"], i["noise"], steps, CFG_RATE)


def _scaled_error(got: np.ndarray, expected: np.ndarray) -> float:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    return float(np.abs(got.astype(np.float64) - expected).max()) / max(1.0, float(np.abs(expected).max()))
