"""A Runner over a torch module whose forward follows a graph contract (the reference backend)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..runtime.backends.base import NamesFrom
from ..runtime.graphs import GraphSpec
from ..runtime.model import LoadedModel

__all__ = ["TorchRunner", "torch_reference_model"]


class TorchRunner(NamesFrom):
    """Calls ``module(*inputs in contract order)`` and names the outputs by the contract.

    Outputs are fresh numpy arrays owned by the caller.
    """

    def __init__(self, spec: GraphSpec, module: nn.Module):
        self.name = spec.name
        self.spec = spec
        self._names = spec  # input_names / output_names (NamesFrom)
        self.module = module.eval()

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [torch.from_numpy(np.ascontiguousarray(feed[name])) for name in self.input_names]
        with torch.inference_mode():
            outputs = self.module(*args)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        return {name: out.detach().cpu().numpy().copy() for name, out in zip(self.output_names, outputs, strict=True)}


def torch_reference_model(
    config: Any,
    specs: Mapping[str, GraphSpec],
    modules: Mapping[str, nn.Module],
    llm_tables: dict[str, np.ndarray],
    flow_noise: np.ndarray,
    **extra: Any,
) -> LoadedModel:
    """The torch reference model of any family: each graph's module behind a ``TorchRunner`` of its
    contract in ``specs``; ``extra``: further ``LoadedModel`` fields (CosyVoice3's ``hift_noise``)."""
    runners = {name: TorchRunner(specs[name], module) for name, module in modules.items()}
    return LoadedModel(
        config=config, backend="torch", runners=runners, llm_tables=llm_tables, flow_noise=flow_noise, **extra
    )
