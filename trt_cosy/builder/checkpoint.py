"""Official ``.pt`` state_dicts into our modules: torch.load, weight-norm folding, strict load."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn

from ..errors import ModelDirError

__all__ = ["read_state_dict", "fold_weight_norm", "load_strict", "load_checkpoint"]

_LOGGER = logging.getLogger(__name__)
_NEW_G = ".parametrizations.weight.original0"
_NEW_V = ".parametrizations.weight.original1"
_OLD_G = ".weight_g"
_OLD_V = ".weight_v"

M = TypeVar("M", bound=nn.Module)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read an official checkpoint (a ``torch.save``d state_dict) on the CPU, tensors only."""
    path = Path(path)
    if not path.is_file():
        raise ModelDirError(f"{path} is missing; an official release has it. Re-download the release.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # torch raises many types for a corrupt zip/pickle
        raise ModelDirError(
            f"{path} is not a readable torch checkpoint ({type(exc).__name__}: {exc}). "
            "Re-download the release."
        ) from exc
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelDirError(f"{path} does not hold a state_dict of tensors; expected an official checkpoint.")
    # A ``generator.`` prefix (some exports of hift.pt) is stripped, as the official loader does.
    return {key.removeprefix("generator."): value for key, value in state.items()}


def _weight_norm(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    # w = g * v / ||v||, norm over every dim except 0  # g: [O, 1, 1], v: [O, I, K]
    dims = tuple(range(1, v.dim()))
    return g * v / v.norm(dim=dims, keepdim=True)


def fold_weight_norm(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace both weight-norm key forms by a plain ``<module>.weight``."""
    folded: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for g_suffix, v_suffix in ((_NEW_G, _NEW_V), (_OLD_G, _OLD_V)):
            if key.endswith(g_suffix):
                prefix = key[: -len(g_suffix)]
                if prefix + v_suffix not in state:
                    raise ModelDirError(f"checkpoint has {key} without {prefix + v_suffix}.")
                folded[prefix + ".weight"] = _weight_norm(value.float(), state[prefix + v_suffix].float())
                break
            if key.endswith(v_suffix):
                break
        else:
            folded[key] = value
    return folded


def load_strict(module: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """``load_state_dict(strict=True)`` with an error that names the file and the keys."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = sorted(
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != tuple(expected[k].shape)
    )
    if missing or unexpected or mismatched:
        def show(items: list[str]) -> str:
            return ", ".join(items[:8]) + (f" ... (+{len(items) - 8})" if len(items) > 8 else "")

        parts = []
        if missing:
            parts.append(f"missing keys: {show(missing)}")
        if unexpected:
            parts.append(f"unexpected keys: {show(unexpected)}")
        if mismatched:
            parts.append(f"shape mismatches: {show(mismatched)}")
        raise ModelDirError(
            f"{source} does not match the model the yaml describes ({'; '.join(parts)}). "
            "The checkpoint and cosyvoice2.yaml must come from the same release."
        )
    module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    _LOGGER.debug("loaded %d tensors from %s", len(state), source)


def load_checkpoint(
    module: M,
    path: Path,
    prepare: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> M:
    """``module`` with the official checkpoint ``path`` loaded strictly (``prepare`` first rewrites its
    state_dict: weight norm folded, unused keys dropped), in eval mode."""
    state = read_state_dict(path)
    if prepare is not None:
        state = prepare(state)
    load_strict(module, state, str(path))
    return module.eval()
