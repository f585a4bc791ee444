"""mixmoe: Mixture-of-Experts training for PyTorch.

``import mixmoe`` has no side effects and does not import torch: the public names below load on
first access (``from mixmoe import MoE`` imports the layer and torch then). This keeps the
torch-free parts (``mixmoe.formats``, the readers in ``mixmoe.report``, ``mixmoe --help``) light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from mixmoe.config import GateConfig, MoEConfig
    from mixmoe.layers.moe import MoE
    from mixmoe.layers.transformer_mlp import FMoETransformerMLP, MixMOETransformerMLP
    from mixmoe.types import MoEAux, Routing

__all__ = [
    "FMoETransformerMLP",
    "GateConfig",
    "MixMOETransformerMLP",
    "MoE",
    "MoEAux",
    "MoEConfig",
    "Routing",
]
__version__ = "0.1.0"

_HOME = {
    "FMoETransformerMLP": "mixmoe.layers.transformer_mlp",
    "GateConfig": "mixmoe.config",
    "MixMOETransformerMLP": "mixmoe.layers.transformer_mlp",
    "MoE": "mixmoe.layers.moe",
    "MoEAux": "mixmoe.types",
    "MoEConfig": "mixmoe.config",
    "Routing": "mixmoe.types",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'mixmoe' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
