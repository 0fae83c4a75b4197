"""A Runner over a torch module whose forward follows a graph contract (the reference backend)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from ..runtime.graphs import GraphSpec

__all__ = ["TorchRunner"]


class TorchRunner:
    """Calls ``module(*inputs in contract order)`` and names the outputs by the contract.

    Outputs are fresh numpy arrays owned by the caller.
    """

    def __init__(self, spec: GraphSpec, module: nn.Module):
        self.name = spec.name
        self.spec = spec
        self.module = module.eval()

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.spec.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.spec.output_names

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [torch.from_numpy(np.ascontiguousarray(feed[name])) for name in self.input_names]
        with torch.inference_mode():
            outputs = self.module(*args)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        return {name: out.detach().cpu().numpy().copy() for name, out in zip(self.output_names, outputs, strict=True)}
