"""``LazyTrtRunner``: a TensorRT plan deserialised when first needed (issue 29 item 3).

Every deserialised plan holds its weights in device memory and every slot its I/O buffers and
activation memory, so plans that a model may never run wait: the plain estimator plans where the
step plans run the Euler loop on the device (``flow_step`` / ``flow_step_stream``), and the graphs
``runtime.engines.LAZY_GRAPHS`` defers on every backend (the streaming estimator, v3's streaming
vocoder). The plan's record is checked at load like any other (``load_plan_runners``); only the
deserialisation, the contexts and the buffers wait for the first use (``load()``, or any attribute
of the ``TrtRunner`` API). ``profiles``, ``name``, ``slots`` and ``external`` answer without loading.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, Final

from ...graphs import STEP_GRAPHS
from ...profiles import GraphProfiles
from ..base import LazyRunner
from .runner import TrtRunner, checked_plans

__all__ = ["LazyTrtRunner", "deferred_plans", "load_plans"]

PLAIN_ESTIMATORS: Final = frozenset(STEP_GRAPHS)  # flow_estimator, flow_estimator_stream


def deferred_plans(plans: Iterable[str], lazy_graphs: Collection[str]) -> frozenset[str]:
    """The plans to load lazily among ``plans``: ``lazy_graphs``, plus each plain estimator whose
    step plan is there (the device Euler loop replaces it; a plan kept for nothing costs its weights
    and its buffers on the device)."""
    names = set(plans)
    steps = {estimator for estimator, step in STEP_GRAPHS.items() if step.name in names}
    return frozenset(names & (set(lazy_graphs) | (steps & PLAIN_ESTIMATORS)))


def load_plans(
    engines_dir: Path, slots: int = 1, checkpoint: str | None = None, lazy: Collection[str] = ()
) -> dict[str, TrtRunner | LazyTrtRunner]:
    """``trt.load_plan_runners`` with the plans named in ``lazy`` deferred: every record is checked
    now (a stale or missing plan raises ``EngineMismatchError`` here), those plans are deserialised
    on first use."""
    runners: dict[str, TrtRunner | LazyTrtRunner] = {}
    for name, (path, graph, external) in checked_plans(engines_dir, slots, checkpoint).items():
        kind = LazyTrtRunner if name in lazy else TrtRunner.from_plan
        runners[name] = kind(path, name, graph, slots, external)
    return runners


class LazyTrtRunner(LazyRunner[TrtRunner]):
    """A ``TrtRunner`` created by ``TrtRunner.from_plan`` on first use (thread-safe, once)."""

    def __init__(
        self, path: Path, name: str, profiles: GraphProfiles, slots: int = 1, external: Collection[str] = ()
    ):
        super().__init__(name)
        self.profiles, self.external = profiles, frozenset(external)
        self._path, self._slot_count = Path(path), max(1, int(slots))

    def _create(self) -> TrtRunner:
        return TrtRunner.from_plan(self._path, self.name, self.profiles, self._slot_count, self.external)

    @property
    def slots(self) -> int:
        return self._slot_count

    def __getattr__(self, attribute: str) -> Any:  # the rest of the TrtRunner API, loading first
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        return getattr(self.load(), attribute)

    def free(self) -> None:
        """Release the plan's runner when it was created (nothing to do otherwise)."""
        if self.loaded:
            self.load().free()
