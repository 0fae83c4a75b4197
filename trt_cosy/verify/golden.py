"""Golden reference files (``reference.npz`` made by the official code) and their tolerances."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np

from ..errors import InputError

__all__ = ["GoldenSet", "Comparison", "compare", "INJECTED_PATTERN", "default_tolerance"]

# Inputs and injected draws are fed, never compared (golden README §3, §7.6, §8.4: first rows).
# v1 records its fresh draws per call: the CFM start noise ``_flow_z`` and the SineGen ``rand_phase``.
INJECTED_PATTERN: Final = re.compile(
    r"^(in_|flow_rand_noise$|meta_json$)|_flow_tokens$|_flow_z$"
    r"|(rand_ini|rand_phase|sine_noise|source_noise|sine_waves)$"
)

# The golden README §3 table, used when a file's meta_json carries no tolerance groups.
_DEFAULT_GROUPS: Final = (
    (r"^llm_tf_lm_input$", 0.0),
    (r"^llm_(greedy|sampled)_tokens$", 0.0),
    (r"^llm_(tf_hidden|tf_logits|tf_cached_logp|tf_cached_hidden|greedy_logits)$", 1e-4),
    (r"_flow_(mu|h)$", 1e-4),
    (r"_(flow_mel|hift_mel)$", 2e-4),
    (r"_f0$", 1e-2),
    (r"(hift_source|hift_cache_source|hift_synth_source)$", 2e-3),
    (r"(_hift_wav|_out_speech|_wav)$", 1e-3),
)


def default_tolerance(key: str) -> float | None:
    for pattern, tolerance in _DEFAULT_GROUPS:
        if re.search(pattern, key):
            return tolerance
    return None


@dataclass(frozen=True)
class Comparison:
    """One row of the verify table."""

    key: str
    status: str  # "ok" | "FAIL" | "skipped"
    max_abs_err: float | None = None
    tolerance: float | None = None
    note: str = ""


# The flow/vocoder scenarios of the CosyVoice2 and 3 golden sets (golden README): whole utterance,
# streaming, and streaming with the prompt padding.
_FLOW_SCENARIOS: Final = ("nonstream", "stream", "streampad")


class GoldenSet:
    """The arrays and ``meta_json`` of one golden ``reference.npz``."""

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], source: Path):
        self.arrays = arrays
        self.meta = meta
        self.source = source

    @classmethod
    def load(cls, path: Path) -> GoldenSet:
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as data:
                arrays = {key: data[key] for key in data.files}
        except (OSError, ValueError) as exc:
            raise InputError(
                f"cannot read golden file {path} ({exc}); pass a reference.npz from the golden set."
            ) from exc
        meta = json.loads(str(arrays.pop("meta_json"))) if "meta_json" in arrays else {}
        return cls(arrays, meta, path)

    def __getitem__(self, key: str) -> np.ndarray:
        return self.arrays[key]

    def __contains__(self, key: str) -> bool:
        return key in self.arrays

    def flow_scenarios(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """(name, meta) of each flow/vocoder scenario this file has chunks for (CosyVoice2 and 3)."""
        for name in _FLOW_SCENARIOS:
            scenario = self.meta.get(name)
            if isinstance(scenario, dict) and scenario.get("chunks") and f"{name}_c0_flow_tokens" in self:
                yield name, scenario

    def ids(self, key: str) -> np.ndarray:
        """The token ids stored under ``key`` as a flat int64 array."""
        return self.arrays[key].reshape(-1).astype(np.int64)

    def compared_keys(self) -> list[str]:
        return sorted(key for key in self.arrays if not INJECTED_PATTERN.search(key))

    def tolerance(self, key: str) -> float | None:
        for group in self.meta.get("tolerances_recommended", {}).values():
            pattern = group.get("key_regex") if isinstance(group, dict) else None
            if pattern and re.search(pattern, key):
                return float(group["recommended_max_abs"])
        return default_tolerance(key)


def compare(key: str, ours: np.ndarray, golden: np.ndarray, tolerance: float) -> Comparison:
    ours = np.asarray(ours)
    golden = np.asarray(golden)
    if ours.shape != golden.shape:
        return Comparison(key, "FAIL", None, tolerance, f"shape {ours.shape} != golden {golden.shape}")
    if ours.size == 0:
        return Comparison(key, "ok", 0.0, tolerance, "empty")
    if not np.all(np.isfinite(ours)):
        return Comparison(key, "FAIL", float("nan"), tolerance, "non-finite values")
    err = float(np.max(np.abs(ours.astype(np.float64) - golden.astype(np.float64))))
    return Comparison(key, "ok" if err <= tolerance else "FAIL", err, tolerance)
